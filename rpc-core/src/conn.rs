//! Pieces shared by client and server connections: keep-alive and body encoding.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::codec::{Codec, CodecError};
use crate::payload::collect_attachments;
use crate::wire::{Attachments, Message};

/// Sends messages to a connection's writer task.
pub(crate) type Outbox = mpsc::UnboundedSender<Message>;

/// Keep-alive bookkeeping: counts received frames and decides, at each tick, whether to ping
/// or to give up on a silent peer.
pub(crate) struct KeepAlive {
    interval: Interval,
    period: Duration,
    timeout: Duration,
    seen: u64,
    seen_at_last_tick: u64,
    silent: Duration,
    /// frames received elsewhere (a transport's shortcut), counted as traffic too
    also: Option<Arc<AtomicU64>>,
}

/// What a keep-alive tick asks for.
pub(crate) enum Tick {
    /// Traffic was seen: nothing to do.
    Alive,
    /// Silent for a period: send a ping.
    Ping,
    /// Silent for the timeout: the peer is gone.
    Dead(Duration),
}

impl KeepAlive {
    pub(crate) fn new(period: Duration, timeout: Duration) -> KeepAlive {
        let mut interval = tokio::time::interval_at(Instant::now() + period, period);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        KeepAlive {
            interval,
            period,
            timeout,
            seen: 0,
            seen_at_last_tick: 0,
            silent: Duration::ZERO,
            also: None,
        }
    }

    /// Counts `frames` (received where this connection's task does not see them) as traffic
    /// too, looked at on each tick.
    pub(crate) fn count_also(&mut self, frames: Arc<AtomicU64>) {
        self.also = Some(frames);
    }

    /// Records a received frame.
    pub(crate) fn saw_frame(&mut self) {
        self.seen = self.seen.wrapping_add(1);
    }

    /// Waits for the next tick and says what to do.
    pub(crate) async fn tick(&mut self) -> Tick {
        std::future::poll_fn(|cx| self.poll_tick(cx)).await
    }

    /// Polls for the next tick and says what to do.
    pub(crate) fn poll_tick(&mut self, cx: &mut Context<'_>) -> Poll<Tick> {
        ready!(self.interval.poll_tick(cx));
        Poll::Ready(self.judge())
    }

    fn judge(&mut self) -> Tick {
        if let Some(also) = &self.also {
            // frames counted there since the last tick
            self.seen = self.seen.wrapping_add(also.swap(0, Ordering::Relaxed));
        }
        if self.seen != self.seen_at_last_tick {
            self.seen_at_last_tick = self.seen;
            self.silent = Duration::ZERO;
            return Tick::Alive;
        }
        self.silent += self.period;
        if self.silent >= self.timeout {
            Tick::Dead(self.silent)
        } else {
            Tick::Ping
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    /// Small encoded bodies are cut from this chunk (see [`body_bytes`]).
    static CHUNK: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// The largest scratch buffer a thread keeps: one grown past it by a large non-payload body is
/// freed.
const SCRATCH_KEPT: usize = 1 << 20;

/// Size of the per-thread chunks small bodies are cut from.
const CHUNK_SIZE: usize = 16 * 1024;
/// Largest body cut from a chunk; larger ones get their own allocation.
const CHUNK_MAX_BODY: usize = 256;

/// Encodes `value` with codec `C`, lifting payloads out into attachments.
///
/// The body is encoded into a per-thread scratch buffer and copied out once (see
/// [`body_bytes`]): no allocation per small message, none for an empty body.
pub(crate) fn encode_body<C: Codec, T: Serialize + ?Sized>(
    value: &T,
) -> Result<(Bytes, Attachments), CodecError> {
    let mut attachments = Attachments::new();
    let encode = |buf: &mut Vec<u8>, attachments: &mut Attachments| {
        buf.clear();
        collect_attachments(attachments, || C::encode(value, buf))?;
        Ok(body_bytes(buf))
    };
    let body = SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut buf) => {
            let r = encode(&mut buf, &mut attachments);
            if buf.capacity() > SCRATCH_KEPT {
                *buf = Vec::new();
            }
            r
        }
        // Re-entered from inside a Serialize impl: use a fresh buffer.
        Err(_) => encode(&mut Vec::new(), &mut attachments),
    })?;
    Ok((body, attachments))
}

/// The per-thread scratch buffer bodies are encoded into, taken out (empty if it is in use):
/// for an encoder that cannot borrow it for the whole of its work ([`crate::codec::direct`]).
/// Give it back with [`give_scratch`].
pub(crate) fn take_scratch() -> Vec<u8> {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut buf) => std::mem::take(&mut *buf),
        Err(_) => Vec::new(),
    })
}

/// Puts back a buffer from [`take_scratch`] (unless the thread has one again, or it grew huge).
pub(crate) fn give_scratch(mut buf: Vec<u8>) {
    if buf.capacity() > SCRATCH_KEPT {
        return;
    }
    buf.clear();
    SCRATCH.with(|s| {
        if let Ok(mut cur) = s.try_borrow_mut() {
            if cur.capacity() < buf.capacity() {
                *cur = buf;
            }
        }
    });
}

/// A `Bytes` holding a copy of `encoded`.
///
/// A body of at most one byte needs no memory ([`tiny_body`](crate::wire::tiny_body)); a
/// small body is a view into a per-thread 16 KiB chunk shared by many bodies (the chunk is
/// freed when the last of them is dropped), so it costs a reference count instead of a
/// `malloc` and a `free`; a larger one is allocated to size.
#[inline]
pub(crate) fn body_bytes(encoded: &[u8]) -> Bytes {
    // empty, or one byte (a lone payload's index): no memory of its own
    match crate::wire::tiny_body(encoded) {
        Some(tiny) => tiny,
        None => copied_body(encoded),
    }
}

/// [`body_bytes`] of a body longer than a byte.
fn copied_body(encoded: &[u8]) -> Bytes {
    if encoded.len() > CHUNK_MAX_BODY {
        return Bytes::copy_from_slice(encoded);
    }
    CHUNK.with(|c| match c.try_borrow_mut() {
        Ok(mut chunk) => {
            if chunk.capacity() - chunk.len() < encoded.len() {
                *chunk = BytesMut::with_capacity(CHUNK_SIZE);
            }
            chunk.extend_from_slice(encoded);
            chunk.split().freeze()
        }
        Err(_) => Bytes::copy_from_slice(encoded),
    })
}
