//! Pieces shared by client and server connections: the batching writer and keep-alive.

use std::cell::RefCell;
use std::io;
use std::time::Duration;

use bytes::Bytes;
use futures::{Sink, SinkExt};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::codec::{Codec, CodecError};
use crate::payload::collect_attachments;
use crate::wire::Message;
use crate::Payload;

/// Sends messages to a connection's writer task.
pub(crate) type Outbox = mpsc::UnboundedSender<Message>;

/// Drives a transport's writer: waits for a message, then takes every message already queued,
/// and flushes once, so that many calls share one system call (or one doorbell).
///
/// When `others_waiting()` says more messages are about to be queued (other calls in flight
/// whose callers were woken together), it yields once first, so that they join the same write
/// instead of each costing a system call; with nothing else in flight it writes at once.
///
/// Ends when every [`Outbox`] is dropped (after flushing what was queued and closing the
/// writer) or when writing fails; either way it cancels `closed`.
pub(crate) async fn write_loop<W>(
    mut writer: W,
    mut rx: mpsc::UnboundedReceiver<Message>,
    closed: CancellationToken,
    others_waiting: impl Fn() -> bool,
) where
    W: Sink<Message, Error = io::Error> + Unpin,
{
    let result: io::Result<()> = async {
        while let Some(msg) = rx.recv().await {
            if others_waiting() {
                tokio::task::yield_now().await;
            }
            writer.feed(msg).await?;
            while let Ok(msg) = rx.try_recv() {
                writer.feed(msg).await?;
            }
            writer.flush().await?;
        }
        writer.close().await
    }
    .await;
    if let Err(e) = result {
        if !closed.is_cancelled() {
            tracing::debug!(error = %e, "write failed; closing the connection");
        }
    }
    closed.cancel();
}

/// Keep-alive bookkeeping: counts received frames and decides, at each tick, whether to ping
/// or to give up on a silent peer.
pub(crate) struct KeepAlive {
    interval: Interval,
    period: Duration,
    timeout: Duration,
    seen: u64,
    seen_at_last_tick: u64,
    silent: Duration,
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
        }
    }

    /// Records a received frame.
    pub(crate) fn saw_frame(&mut self) {
        self.seen = self.seen.wrapping_add(1);
    }

    /// Waits for the next tick and says what to do.
    pub(crate) async fn tick(&mut self) -> Tick {
        self.interval.tick().await;
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
}

/// Encodes `value` with codec `C`, lifting payloads out into attachments.
///
/// The body is encoded into a per-thread scratch buffer and copied out once into an exactly
/// sized `Bytes`: one allocation per message, none for an empty body.
pub(crate) fn encode_body<C: Codec, T: Serialize + ?Sized>(
    value: &T,
) -> Result<(Bytes, Vec<Payload>), CodecError> {
    let mut attachments = Vec::new();
    let encode = |buf: &mut Vec<u8>, attachments: &mut Vec<Payload>| {
        buf.clear();
        collect_attachments(attachments, || C::encode(value, buf))?;
        Ok(Bytes::copy_from_slice(buf))
    };
    let body = SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut buf) => {
            let r = encode(&mut buf, &mut attachments);
            if buf.capacity() > 1 << 20 {
                // Do not keep a huge scratch buffer around after a large non-payload body.
                *buf = Vec::new();
            }
            r
        }
        // Re-entered from inside a Serialize impl: use a fresh buffer.
        Err(_) => encode(&mut Vec::new(), &mut attachments),
    })?;
    Ok((body, attachments))
}
