//! What a transport provides: a connection that moves [`Message`]s, and a listener.
//!
//! A transport owns framing and bulk movement; the protocol above it (multiplexing, credits,
//! deadlines, cancellation, keep-alive) lives in [`crate::client`] and [`crate::server`] and is
//! the same for every transport.
//!
//! Contract for implementations:
//! - [`Transport::split`] gives a reader and a writer that are used from two tasks at once.
//! - The reader yields each received message once, in order, with its attachments as
//!   [`Payload`](crate::Payload)s that are views of the receive buffers where possible. A
//!   frame that breaks the protocol yields an `io::Error` (of kind `InvalidData`, wrapping a
//!   [`FrameError`](crate::wire::FrameError) when the header was readable) and the reader ends.
//! - The writer takes messages with `feed`/`start_send` and writes them on `flush`; it may
//!   batch everything fed since the last flush into one system call or one doorbell. A message
//!   whose [`wire_len`](Message::wire_len) is at most the eager threshold goes inline; larger
//!   ones move their attachments on the bulk path.
//! - Both halves end with an error or `None` when the connection is gone; the protocol then
//!   fails the calls in flight with `ConnectionClosed`.
//! - Optionally, a transport that receives in a task of its own offers each received message
//!   to a [`ResponseShortcut`] first, so that a client completes its calls there (see
//!   [`Transport::response_shortcut`]). If it can also send from there without waiting
//!   ([`Transport::direct_send`]), a server answers requests whose handler finishes at once
//!   there too: run to completion, with no hand-off to the connection's task.

use std::fmt;
use std::future::Future;
use std::io;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::{Sink, Stream};

use crate::payload::PayloadMemory;
use crate::wire::{Attachments, FrameRef, Message};

/// One established connection of some transport.
pub trait Transport: Send + 'static {
    /// Receiving half.
    type Reader: Stream<Item = io::Result<Message>> + Send + Unpin + 'static;
    /// Sending half.
    type Writer: Sink<Message, Error = io::Error> + Send + Unpin + 'static;

    /// Splits the connection into halves that two tasks can drive at once.
    fn split(self) -> (Self::Reader, Self::Writer);

    /// The peer's address, for logs.
    fn peer(&self) -> String;

    /// Whether writes should wait one scheduling turn for more frames, so that they share one
    /// write: the client's writer when calls are in flight, the server after a turn that read
    /// several requests at once. Worth it where a write is a system call (TCP); over RDMA, a
    /// turn given up costs more than the packets it saves. The default is off.
    fn coalesce_writes(&self) -> bool {
        false
    }

    /// Memory this connection sends payloads from without a copy, if it has such (RDMA's
    /// registered pools); [`Client::payload_mut`](crate::Client::payload_mut) lends from it.
    /// Taken before [`Transport::split`]. The default has none: payloads are heap memory.
    fn payload_memory(&self) -> Option<Arc<dyn PayloadMemory>> {
        None
    }

    /// A way to hand received responses to the client from wherever the transport receives
    /// them, if it offers one (see [`ResponseShortcut`]). Taken before [`Transport::split`].
    /// The default has none: every message goes through the reader.
    fn response_shortcut(&self) -> Option<ResponseShortcut> {
        None
    }

    /// A way to send a message at once from any task, without waiting (see [`DirectSend`]),
    /// if the transport offers one. With it and a [`ResponseShortcut`], a server takes
    /// requests in the shortcut, runs their handlers there and sends the answers of those that
    /// finish on their first poll through it; a client sends a lone call's request through it
    /// on an idle link. Taken before [`Transport::split`]. The default has none.
    fn direct_send(&self) -> Option<Arc<dyn DirectSend>> {
        None
    }

    /// Completes the server side of an accepted connection (a TLS handshake, say). Servers
    /// call it in the connection's own task, bounded by `connect_timeout`, so a slow peer
    /// cannot hold up accepting others. The default does nothing.
    fn establish(self) -> impl Future<Output = io::Result<Self>> + Send
    where
        Self: Sized,
    {
        std::future::ready(Ok(self))
    }
}

type Taker = Box<dyn Fn(Message) -> Option<Message> + Send + Sync>;

/// Sends a message at once, from whatever task calls it, when that needs no waiting: the
/// server's run-to-completion path answers through it from the task that received the request
/// (see [`Transport::direct_send`]).
///
/// Messages sent through it may overtake messages fed to the transport's writer and not yet
/// flushed, so it is used only where that cannot matter or cannot happen: by a server for its
/// answers (which the client matches by id), and by a client only while it holds the writer,
/// idle, for a lone call's request. It never blocks.
pub trait DirectSend: Send + Sync + 'static {
    /// Whether a message sent now would most likely go at once: a server looks before it runs
    /// a handler, so that an answer rarely has to take the slow path after all (and under
    /// load, when the writer packs answers together, it leaves them to the writer).
    fn ready(&self) -> bool;

    /// Sends `msg` now, if it can go without waiting: whether it went (if not, the caller sends
    /// it through the writer). The message is encoded as it is posted, so the transport keeps
    /// nothing of it, and the caller keeps it to send otherwise (no move of the message in and
    /// out). It looks at the link itself: a client calls it without asking
    /// [`ready`](Self::ready) first.
    fn try_send(&self, msg: &Message) -> bool;

    /// How long the caller of a lone call may receive for itself ([`progress`](Self::progress))
    /// while it waits for its answer, counted from when it started waiting; zero (the default)
    /// if the transport receives only in a task of its own.
    fn spin_window(&self) -> Duration {
        Duration::ZERO
    }

    /// How long each of that caller's bursts of receiving lasts before it lets the runtime's
    /// other ready tasks run once (then it spins on, within the window). Zero (the default)
    /// means the client's own, 10 µs, which is also the least it takes. A longer burst keeps
    /// the scheduler's code off the caller's path between its request and its answer, at the
    /// price of the thread's other tasks, which wait up to this long.
    fn spin_burst(&self) -> Duration {
        Duration::ZERO
    }

    /// Receives what has arrived, from the calling task, as the transport's receiving task
    /// would (responses reach the client through the [`ResponseShortcut`], everything else
    /// through the reader); whether it found anything. It never blocks, and returns at once
    /// if another task is receiving. The default finds nothing.
    fn progress(&self) -> bool {
        false
    }

    /// As [`progress`](Self::progress), but the answer to call `id`, if it arrives now as a
    /// small message, is lent to `take` *borrowed* from the transport's receive buffer instead
    /// of going through the [`ResponseShortcut`]: the caller decodes it there, with no
    /// [`Message`] made for it. `take` is called only for a [`Kind::Response`] with that id;
    /// it returns true if it took the answer (after [`LentFrame::accept`] said yes), which is
    /// then consumed (it reaches neither the shortcut nor the reader), and is not called
    /// again. Everything else received in the same poll goes on as in `progress`. Whether
    /// anything was found. The default is `progress`, which never calls `take`.
    ///
    /// [`Kind::Response`]: crate::wire::Kind::Response
    fn progress_with(&self, id: u64, take: &mut dyn FnMut(&mut dyn LentFrame) -> bool) -> bool {
        let _ = (id, take);
        self.progress()
    }
}

/// A path by which a transport hands received responses to the client from where it receives
/// them (the task that polled a completion queue, say) instead of through
/// [`Transport::Reader`]: the caller is woken by that task, with no hand-off to the client's
/// reader task in between.
///
/// The transport creates one per connection, returns it from
/// [`Transport::response_shortcut`] and [`offer`](Self::offer)s every message it receives,
/// in order, before queueing it for the reader; a message given back goes to the reader as
/// usual, one taken counts as read (its receive credit, if any, may go back at once). Until
/// the client installs its taker (once its greeting is done), every message is given back.
/// The client's taker takes only responses and never blocks, so it may be called from any
/// thread, and a response may overtake frames still queued for the reader, which the client
/// handles independently of it.
///
/// On a server whose transport also has a [`DirectSend`], the server installs a taker of its
/// own once the greeting is done: it takes requests whose handler finishes on its first poll
/// while the link is idle, and answers them through the [`DirectSend`] (run to completion);
/// every other message, and every request it cannot take so, is given back. It then runs
/// handlers' first polls in the transport's receiving task, which must therefore be a task
/// of a tokio runtime (a handler that has to wait is spawned from there). Such a server also
/// takes requests *borrowed* from where the transport received them, if the transport
/// [`offer_frame`](Self::offer_frame)s them, with no [`Message`] made for them.
#[derive(Clone, Default)]
pub struct ResponseShortcut(Arc<Takers>);

#[derive(Default)]
struct Takers {
    messages: OnceLock<Taker>,
    frames: OnceLock<FrameTaker>,
}

/// A server's taker of borrowed requests (see [`ResponseShortcut::offer_frame`]).
pub(crate) type FrameTaker = Box<dyn Fn(&mut dyn LentFrame) -> bool + Send + Sync>;

/// A received frame a transport lends, borrowed from where it arrived: a request to a server's
/// taker ([`ResponseShortcut::offer_frame`]), an answer to the caller waiting for it
/// ([`DirectSend::progress_with`]).
pub trait LentFrame {
    /// The frame.
    fn frame(&self) -> FrameRef<'_>;

    /// Called by a taker that has decided to take the frame, before it acts on it: the
    /// transport counts it as received (the credits it carries, say). False if it may not be
    /// taken after all; the taker then gives it back as it was.
    fn accept(&mut self) -> bool;

    /// The frame's body and attachments, copied into memory the taker may keep.
    fn own(&mut self) -> (Bytes, Attachments);
}

impl ResponseShortcut {
    /// A shortcut with no taker yet.
    pub fn new() -> ResponseShortcut {
        ResponseShortcut::default()
    }

    /// Offers a received message to the client; gives it back unless the client took it.
    #[inline]
    pub fn offer(&self, msg: Message) -> Option<Message> {
        match self.0.messages.get() {
            Some(take) => take(msg),
            None => Some(msg),
        }
    }

    /// Whether a taker of borrowed requests is installed (a server's, see
    /// [`offer_frame`](Self::offer_frame)): a transport that finds none need not read its
    /// frames in place for it.
    #[inline]
    pub fn takes_frames(&self) -> bool {
        self.0.frames.get().is_some()
    }

    /// Offers a received request borrowed from where it arrived, before (instead of) making
    /// a [`Message`] of it and [`offer`](Self::offer)ing that: true if the server took it (it
    /// called [`LentFrame::accept`], which said yes, and then ran the request, copying out what
    /// it keeps with [`LentFrame::own`]). False if it was not taken: nothing of it was used,
    /// and it is the transport's to hand on as usual, `accept` not called or answered no.
    /// Offers must come in the order messages were received, as [`offer`](Self::offer)s do.
    pub fn offer_frame(&self, lent: &mut dyn LentFrame) -> bool {
        match self.0.frames.get() {
            Some(take) => take(lent),
            None => false,
        }
    }

    /// Installs the client's taker; false if one was installed already.
    pub(crate) fn install(&self, take: Taker) -> bool {
        self.0.messages.set(take).is_ok()
    }

    /// Installs a server's taker of borrowed requests; false if one was installed already.
    pub(crate) fn install_frames(&self, take: FrameTaker) -> bool {
        self.0.frames.set(take).is_ok()
    }
}

impl fmt::Debug for ResponseShortcut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseShortcut")
            .field("installed", &self.0.messages.get().is_some())
            .field("takes_frames", &self.takes_frames())
            .finish()
    }
}

/// Accepts connections of one transport.
pub trait Listener: Send + 'static {
    /// The connections it yields.
    type Transport: Transport;

    /// Waits for the next connection. An error concerns one attempt (a failed handshake, say);
    /// the listener stays usable.
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Transport>> + Send;
}
