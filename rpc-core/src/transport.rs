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

use std::future::Future;
use std::io;
use std::sync::Arc;

use futures::{Sink, Stream};

use crate::payload::PayloadMemory;
use crate::wire::Message;

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

    /// Whether the client's writer should wait one scheduling turn for other calls' frames
    /// before writing, when calls are in flight, so that they share one write. Worth it where a
    /// write is a system call (TCP). The default is off.
    fn coalesce_writes(&self) -> bool {
        false
    }

    /// Memory this connection sends payloads from without a copy, if it has such (RDMA's
    /// registered pools); [`Client::payload_mut`](crate::Client::payload_mut) lends from it.
    /// Taken before [`Transport::split`]. The default has none: payloads are heap memory.
    fn payload_memory(&self) -> Option<Arc<dyn PayloadMemory>> {
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

/// Accepts connections of one transport.
pub trait Listener: Send + 'static {
    /// The connections it yields.
    type Transport: Transport;

    /// Waits for the next connection. An error concerns one attempt (a failed handshake, say);
    /// the listener stays usable.
    fn accept(&mut self) -> impl Future<Output = io::Result<Self::Transport>> + Send;
}
