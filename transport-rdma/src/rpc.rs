//! rdma-rpc's RDMA transport: [`rpc_core::Transport`] and [`rpc_core::Listener`] over an
//! [`RdmaConnection`], speaking [`rpc_core::rendezvous`]'s packet protocol.
//!
//! - Every packet is one SEND into one of the peer's posted receive slots; [`Credits`] keep a
//!   sender from overrunning them (no RNR retries, and no iWARP TERMINATE for a SEND that
//!   finds no receive). Credits ride on every packet; a pure credit return goes when half the
//!   window is owed.
//! - A message whose whole frame fits the eager threshold (and a slot) goes in one SEND.
//! - Larger ones go by rendezvous, in the direction [`RdmaOptions::push_up_to`] picks by size
//!   (each side for what it sends):
//!   - receiver-pull: the sender copies each attachment into a buffer of the connection's
//!     registered pool (unless it already is one) and sends `PullRts` with the inline part and
//!     the buffers' addresses and key; the receiver RDMA-READs every segment into buffers of
//!     its own pool, delivers the message with views of those buffers as its [`Payload`]s (no
//!     further copy) and sends `Fin`, on which the sender's buffers return to its pool;
//!   - sender-push: the sender copies the attachments into pool buffers and sends `PushRts`
//!     with the inline part and the lengths; the receiver grants buffers of its pool (`Cts`),
//!     the sender RDMA-WRITEs into them and sends `PushDone` (a SEND after the WRITEs on the
//!     same queue pair: it arrives after their data is placed, on InfiniBand, RoCE and iWARP
//!     alike, so one code path serves all three instead of WRITE-with-immediate, which iWARP
//!     lacks), and the receiver delivers views of the granted buffers.
//!
//!   A message's announcement holds its receive credit until the reader takes the message, so
//!   the buffers one peer can hold granted or read are bounded by the window (see the crate
//!   docs, "Buffer pools").
//!
//! - SENDs are pipelined (up to [`RdmaOptions::send_slots`] in flight); a transport whose two
//!   halves are dropped first sends what it accepted and waits for the peer's `Fin`s (at most
//!   10 s), then disconnects.
//! - An accepted connection is answered in [`rpc_core::Transport::establish`], in the
//!   connection's own task: a silent peer holds up no other.
//!
//! Both sides must use the same [`RdmaOptions::recv_slots`] and [`RdmaOptions::slot_size`]
//! (each grants the other its window with its first packet; a listener with a shared receive
//! queue grants less, and more on demand: see the crate docs).
//!
//! Not done yet: RDMA READs/WRITEs of one message in parallel, waiting for a pool buffer
//! instead of registering one when the pool is exhausted (attachments larger than the pool's
//! largest class use kept regions of their own, see the crate docs).

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::BytesMut;
use futures::channel::mpsc as fmpsc;
use futures::{ready, SinkExt, Stream, StreamExt};
use parking_lot::{Mutex, MutexGuard};
use rpc_core::ids::IdMap;
use rpc_core::rendezvous::{
    refuse, Credits, Direction, Incoming, Packet, Plan, Segment, Transfers, PACKET_HEADER_LEN,
    START_WINDOW,
};
use rpc_core::wire::{FrameRef, Kind, Limits, Message};
use rpc_core::{Config, Payload};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};

use crate::conn::{PendingConnection, PoolUse};
use crate::inbox::{self, inbox};
use crate::verbs::PoolBuf;
use crate::{
    FrozenBuffer, PoolMonitor, RdmaBuffer, RdmaConnection, RdmaError, RdmaListener, RdmaOptions,
    RemoteAccess, RemoteExposure, RemoteToken, SendCompletion,
};

fn to_io(e: RdmaError) -> io::Error {
    let kind = match &e {
        RdmaError::Unavailable(_) => io::ErrorKind::Unsupported,
        RdmaError::Closed(_) => io::ErrorKind::ConnectionReset,
        RdmaError::Connect(_) => io::ErrorKind::ConnectionRefused,
        RdmaError::Timeout(_) => io::ErrorKind::TimedOut,
        RdmaError::InvalidArgument(_) => io::ErrorKind::InvalidInput,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

/// The options a transport actually uses: slots big enough for the config's eager messages.
fn effective(opts: &RdmaOptions, config: &Config) -> RdmaOptions {
    let mut o = opts.clone();
    o.recv_slots = o.recv_slots.max(4);
    o.connect_timeout = config.connect_timeout;
    o
}

impl RdmaOptions {
    /// The defaults with an `rdma://` endpoint's transport options applied: `device=NAME`,
    /// `busy_poll=0|1` (off, or the default spin), `busy_poll_us=N` (a fixed spin window),
    /// `busy_poll_max_us=N` (the adaptive window's ceiling), `poll_burst_us=N` (the
    /// polling burst, [`RdmaOptions::poll_burst`]), `recv_slots=N`,
    /// `slot_size=N` (both sides must agree on these two), `srq_slots=N` (a server's shared
    /// receive queue), `push_up_to=N` or
    /// `rendezvous=pull|push` (see [`RdmaOptions::push_up_to`]), `max_fallback_bytes=N`,
    /// `large_buffer_bytes=N`, `read_depth=N` (1 to 255, see [`RdmaOptions::read_depth`]),
    /// `inflight_bytes=N`, `max_inline=N` (see [`RdmaOptions::max_inline`]),
    /// `ack_timeout_ms=N` ([`RdmaOptions::ack_timeout`]; 0: rdma_cm's value).
    /// Other options are ignored.
    pub fn from_endpoint(ep: &rpc_core::Endpoint) -> Result<RdmaOptions, RdmaError> {
        let mut o = RdmaOptions::default();
        // an explicit ceiling wins over the one `busy_poll_us` and `busy_poll` imply, in any order
        let mut max = None;
        let num = |k: &str, v: &str| {
            v.parse::<u64>().map_err(|_| {
                RdmaError::InvalidArgument(format!("endpoint option {k}={v}: not a number"))
            })
        };
        for (k, v) in ep.options() {
            match k {
                "device" => o.device = Some(v.to_string()),
                "busy_poll" => match v {
                    "0" | "false" | "off" => {
                        o.busy_poll = std::time::Duration::ZERO;
                        o.busy_poll_max = std::time::Duration::ZERO;
                    }
                    "1" | "true" | "on" | "" => {}
                    _ => {
                        return Err(RdmaError::InvalidArgument(format!(
                            "endpoint option busy_poll={v}: use 0 or 1"
                        )))
                    }
                },
                "busy_poll_us" => {
                    // a fixed window
                    o.busy_poll = std::time::Duration::from_micros(num(k, v)?);
                    o.busy_poll_max = o.busy_poll;
                }
                "busy_poll_max_us" => max = Some(std::time::Duration::from_micros(num(k, v)?)),
                "poll_burst_us" => o.poll_burst = std::time::Duration::from_micros(num(k, v)?),
                "ack_timeout_ms" => {
                    o.ack_timeout =
                        Some(std::time::Duration::from_millis(num(k, v)?)).filter(|t| !t.is_zero());
                }
                "recv_slots" => o.recv_slots = num(k, v)? as usize,
                "push_up_to" => o.push_up_to = num(k, v)?,
                "max_fallback_bytes" => o.max_fallback_bytes = num(k, v)?,
                "large_buffer_bytes" => o.large_buffer_bytes = num(k, v)?,
                "rendezvous" => {
                    o.push_up_to = match v {
                        "pull" => 0,
                        "push" => u64::MAX,
                        _ => {
                            return Err(RdmaError::InvalidArgument(format!(
                                "endpoint option rendezvous={v}: use pull or push"
                            )))
                        }
                    }
                }
                "slot_size" => o.slot_size = num(k, v)? as usize,
                "srq_slots" => o.srq_slots = num(k, v)? as usize,
                "inflight_bytes" => o.inflight_bytes = num(k, v)?,
                "max_inline" => {
                    o.max_inline = u32::try_from(num(k, v)?).map_err(|_| {
                        RdmaError::InvalidArgument(format!(
                            "endpoint option max_inline={v}: too large"
                        ))
                    })?
                }
                "read_depth" => {
                    o.read_depth = u8::try_from(num(k, v)?)
                        .ok()
                        .filter(|&d| d > 0)
                        .ok_or_else(|| {
                            RdmaError::InvalidArgument(format!(
                                "endpoint option read_depth={v}: use 1 to 255"
                            ))
                        })?
                }
                _ => {}
            }
        }
        if let Some(max) = max {
            o.busy_poll_max = max;
        }
        Ok(o)
    }
}

/// Resolves an endpoint's `HOST:PORT` to a socket address (the first one found).
pub async fn resolve(ep: &rpc_core::Endpoint) -> Result<SocketAddr, RdmaError> {
    let authority = ep.authority();
    let mut addrs = tokio::net::lookup_host(authority.clone())
        .await
        .map_err(|e| RdmaError::Connect(format!("cannot resolve {authority}: {e}")))?;
    addrs
        .next()
        .ok_or_else(|| RdmaError::Connect(format!("{authority} resolves to no address")))
}

/// One RDMA connection carrying rdma-rpc messages.
pub struct RdmaTransport {
    state: State,
    config: Config,
    peer: String,
    push_up_to: u64,
    max_fallback_bytes: u64,
    /// the client's way to take responses in the completion dispatch (see `Deliver`), and the
    /// server's to take requests there
    shortcut: rpc_core::ResponseShortcut,
    /// the way to post from any task (the server's answers from there, a lone call's request)
    direct: Arc<Direct>,
}

enum State {
    /// accepted by a listener; [`rpc_core::Transport::establish`] completes it
    Pending(PendingConnection),
    Ready(RdmaConnection),
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("device", &self.device_name())
            .field("peer", &self.peer)
            .finish()
    }
}

impl RdmaTransport {
    /// Connects to an rdma-rpc server listening on `addr` (an IP address of its RDMA device).
    pub async fn connect(
        addr: SocketAddr,
        config: Config,
        opts: RdmaOptions,
    ) -> Result<RdmaTransport, RdmaError> {
        RdmaTransport::connect_tracked(addr, config, opts, PoolMonitor::default()).await
    }

    /// As [`RdmaTransport::connect`], with the connection's registered pools counted by
    /// `monitor` (see [`RdmaConnection::connect_tracked`]).
    pub async fn connect_tracked(
        addr: SocketAddr,
        config: Config,
        opts: RdmaOptions,
        monitor: PoolMonitor,
    ) -> Result<RdmaTransport, RdmaError> {
        let conn =
            RdmaConnection::connect_tracked(addr, effective(&opts, &config), monitor).await?;
        let mut t = RdmaTransport::new(conn, config, addr.to_string());
        t.push_up_to = opts.push_up_to;
        t.max_fallback_bytes = opts.max_fallback_bytes;
        Ok(t)
    }

    /// Connects to an `rdma://HOST:PORT[?options]` endpoint (see [`RdmaOptions::from_endpoint`]).
    pub async fn connect_endpoint(
        ep: &rpc_core::Endpoint,
        config: Config,
    ) -> Result<RdmaTransport, RdmaError> {
        RdmaTransport::connect_endpoint_tracked(ep, config, PoolMonitor::default()).await
    }

    /// As [`RdmaTransport::connect_endpoint`], with the connection's registered pools counted
    /// by `monitor` (see [`RdmaConnection::connect_tracked`]).
    pub async fn connect_endpoint_tracked(
        ep: &rpc_core::Endpoint,
        config: Config,
        monitor: PoolMonitor,
    ) -> Result<RdmaTransport, RdmaError> {
        let opts = RdmaOptions::from_endpoint(ep)?;
        let addr = resolve(ep).await?;
        RdmaTransport::connect_tracked(addr, config, opts, monitor).await
    }

    /// Wraps an established connection.
    pub fn new(conn: RdmaConnection, config: Config, peer: String) -> RdmaTransport {
        let peer = format!("{peer} via {}", conn.device_name());
        RdmaTransport {
            state: State::Ready(conn),
            config,
            peer,
            push_up_to: crate::DEFAULT_PUSH_UP_TO,
            max_fallback_bytes: crate::DEFAULT_MAX_FALLBACK_BYTES,
            shortcut: rpc_core::ResponseShortcut::new(),
            direct: Arc::default(),
        }
    }

    /// The counters of the connection's registered pools (for an accepted connection not yet
    /// established: those of its listener). Take it before handing the transport to a client
    /// or server; it stays valid after the connection is gone.
    pub fn pool_monitor(&self) -> PoolMonitor {
        match &self.state {
            State::Ready(c) => c.pool_monitor(),
            State::Pending(p) => p.pool_monitor(),
        }
    }

    /// The RDMA device the connection runs on ("" until an accepted one is established).
    pub fn device_name(&self) -> &str {
        match &self.state {
            State::Ready(c) => c.device_name(),
            State::Pending(_) => "",
        }
    }
}

impl rpc_core::Transport for RdmaTransport {
    type Reader = RdmaReader;
    type Writer = RdmaWriter;

    fn split(self) -> (RdmaReader, RdmaWriter) {
        let conn = match self.state {
            State::Ready(c) => c,
            State::Pending(_) => {
                // establish() was not called: a programming error, reported as a dead connection
                tracing::error!(
                    "transport-rdma: split() of an accepted connection before establish()"
                );
                let (_, in_rx) = inbox::<Delivery>();
                let (msg_tx, _) = fmpsc::channel::<Outgoing>(1);
                return (
                    RdmaReader {
                        rx: in_rx,
                        engine: None,
                        _close: None,
                    },
                    RdmaWriter {
                        tx: msg_tx,
                        close: None,
                        held: Vec::new(),
                        held_frames: 0,
                    },
                );
            }
        };
        let slots = conn.recv_slots() as u32;
        let accepted = conn.is_accepted();
        // Windows are granted, not assumed (see `Credits::starting`): a connection of a shared
        // receive queue starts with the 2 slots it holds and borrows more while busy; any
        // other grants all its slots with its first packet.
        let credits = match conn.srq_share() {
            Some(_) => Credits::starting(START_WINDOW, slots),
            None => Credits::starting(slots, slots),
        };
        // every message the config admits must fit (each of its buffers rounded up to a unit)
        let inbound_units = units(self.max_fallback_bytes)
            .max(units(self.config.max_message_size) + u64::from(self.config.max_attachments));
        let (ctl_tx, ctl_rx) = mpsc::unbounded_channel();
        let slot = conn.max_message_size();
        let engine = Arc::new(Engine {
            slot,
            pool: conn.pool_monitor(),
            conn,
            proto: Mutex::new(Proto {
                credits,
                transfers: Transfers::new(),
                push_lens: IdMap::default(),
                ops: 0,
                starved: false,
                heard: !accepted,
            }),
            credit_changed: Notify::new(),
            credit_waiters: AtomicUsize::new(0),
            ctl_tx,
            limits: self.config.limits(),
            eager_threshold: self.config.eager_threshold,
            eager_limit: Plan::eager_limit(slot, self.config.eager_threshold),
            push_up_to: self.push_up_to,
            inbound: Arc::new(Semaphore::new(
                usize::try_from(inbound_units).unwrap_or(Semaphore::MAX_PERMITS),
            )),
            inbound_units,
            max_window: slots,
            queued: AtomicUsize::new(0),
            batch: AtomicBool::new(false),
        });
        let _ = self.direct.0.set(DirectTo {
            engine: Arc::downgrade(&engine),
            burst: engine.conn.caller_burst(),
        });
        // an answer a lone caller took in place (`Direct::progress_with`): its slot's credit
        // goes back to the peer once the slot is posted again, by the poll after
        let weak = Arc::downgrade(&engine);
        engine.conn.on_lent_reposted(Box::new(move || {
            if let Some(engine) = weak.upgrade() {
                engine.release();
            }
        }));
        let (msg_tx, msg_rx) = fmpsc::channel(64);
        // Unbounded, yet at most `slots` messages: a delivered message holds its slot's credit
        // until the reader takes it (see `Inbound`).
        let (in_tx, in_rx) = inbox();
        engine.conn.offer_to(Box::new(RequestsInPlace {
            engine: Arc::downgrade(&engine),
            shortcut: self.shortcut.clone(),
            taken: AtomicBool::new(false),
        }));
        let deliver = Deliver {
            tx: in_tx,
            shortcut: self.shortcut,
        };
        tokio::spawn(Inbound::start(&engine, deliver));
        tokio::spawn(send_loop(Arc::clone(&engine), msg_rx, ctl_rx));
        // The connecting side grants the peer the rest of its window now, before any message
        // needs it; the accepting side's grant rides on its first packet, once it has heard
        // from the peer (see `Proto::heard`).
        if !accepted {
            let _ = engine.ctl_tx.send(Ctl::Credit);
        }
        let closer = Arc::new(CloseOnDrop(Arc::clone(&engine)));
        (
            RdmaReader {
                rx: in_rx,
                engine: Some(engine),
                _close: Some(Arc::clone(&closer)),
            },
            RdmaWriter {
                tx: msg_tx,
                close: Some(closer),
                held: Vec::new(),
                held_frames: 0,
            },
        )
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    fn response_shortcut(&self) -> Option<rpc_core::ResponseShortcut> {
        Some(self.shortcut.clone())
    }

    fn direct_send(&self) -> Option<Arc<dyn rpc_core::DirectSend>> {
        Some(self.direct.clone())
    }

    fn payload_memory(&self) -> Option<Arc<dyn rpc_core::payload::PayloadMemory>> {
        match &self.state {
            State::Ready(c) => Some(Arc::new(c.payload_memory())),
            State::Pending(_) => None,
        }
    }

    async fn establish(self) -> io::Result<RdmaTransport> {
        match self.state {
            State::Ready(_) => Ok(self),
            State::Pending(p) => {
                let conn = p.establish().await.map_err(to_io)?;
                let peer = format!("{} via {}", self.peer, conn.device_name());
                Ok(RdmaTransport {
                    state: State::Ready(conn),
                    config: self.config,
                    peer,
                    push_up_to: self.push_up_to,
                    max_fallback_bytes: self.max_fallback_bytes,
                    shortcut: self.shortcut,
                    direct: self.direct,
                })
            }
        }
    }
}

/// The connection's way to post a message from any task ([`rpc_core::DirectSend`]): a server
/// answers from the completion dispatch through it, a client posts a lone call's request (and
/// its caller polls the CQ for the answer through it, within the connection's spin window:
/// `RdmaConnection::poll_completions`). The connection's engine, once `split` has made it
/// (weak: the reader and the writer own it).
///
/// A message goes only on an idle link (nothing queued for the send loop, no SEND in flight),
/// as the writer's own posts do, and requests that came in a batch are left to the connection
/// task: under load the writer and the send loop pack answers together, which costs less per
/// message than a SEND each (taking the first request of each batch here cost 64-in-flight
/// throughput ~8% on rxe in a guest A/B, 2026-12-01).
#[derive(Default)]
struct Direct(OnceLock<DirectTo>);

/// What [`Direct`] sends through, set once the engine exists.
struct DirectTo {
    engine: std::sync::Weak<Engine>,
    /// the connection's `caller_burst`, fixed for its life (kept here: read once per call,
    /// with no upgrade of `engine`)
    burst: std::time::Duration,
}

impl Direct {
    fn engine(&self) -> Option<Arc<Engine>> {
        self.0.get().and_then(|to| to.engine.upgrade())
    }
}

impl rpc_core::DirectSend for Direct {
    fn ready(&self) -> bool {
        self.engine()
            .is_some_and(|e| e.idle() && !e.batch.load(Ordering::Relaxed))
    }

    fn try_send(&self, msg: &Message) -> bool {
        let Some(engine) = self.engine() else {
            return false;
        };
        // the frame's length, measured once for the test and the post
        let frame = msg.wire_len();
        if !engine.idle() || !engine.is_eager_frame(frame) {
            return false;
        }
        // not posted (no credit or slot after all, or the connection is closed): through the
        // writer, which waits, or reports the end
        matches!(
            engine.post_direct(std::slice::from_ref(msg), frame),
            Ok(true)
        )
    }

    fn spin_window(&self) -> std::time::Duration {
        self.engine()
            .map_or(std::time::Duration::ZERO, |e| e.conn.spin_window())
    }

    fn spin_burst(&self) -> std::time::Duration {
        self.0
            .get()
            .map_or(std::time::Duration::ZERO, |to| to.burst)
    }

    fn progress(&self) -> bool {
        self.engine().is_some_and(|e| e.conn.poll_completions())
    }

    fn progress_with(
        &self,
        id: u64,
        take: &mut dyn FnMut(&mut dyn rpc_core::LentFrame) -> bool,
    ) -> bool {
        let Some(engine) = self.engine() else {
            return false;
        };
        // (the slot of an answer taken here is posted again by the next poll, which returns its
        // credit: see where the engine sets `on_lent_reposted`)
        let mut taken = false;
        engine.conn.poll_completions_offering(&mut |slot, copy| {
            // one answer per call: anything after it goes the usual way
            let take_it = !taken && engine.lend_answer(slot, id, copy, take);
            taken |= take_it;
            take_it
        })
    }
}

/// A server's requests, taken where they arrive: each small received message is offered,
/// borrowed from its slot, to the server's taker of lent requests
/// ([`rpc_core::ResponseShortcut::offer_frame`]), which runs a request it can run at once
/// and copies out what the handler keeps (one copy into the poller's arena, as the usual
/// path makes); no `Message` is made for the packet, and it never reaches the receive side
/// (`Inbound`). Everything else, and a request the taker does not take, goes on as usual.
struct RequestsInPlace {
    engine: std::sync::Weak<Engine>,
    shortcut: rpc_core::ResponseShortcut,
    /// a request was taken: its slot's credit is owed once the slot is posted again
    taken: AtomicBool,
}

impl crate::conn::Offered for RequestsInPlace {
    fn offer(&self, msg: &[u8], copy: &mut dyn FnMut(&[u8]) -> bytes::Bytes) -> bool {
        if !self.shortcut.takes_frames() {
            return false;
        }
        let Some(engine) = self.engine.upgrade() else {
            return false;
        };
        let Some(eager) = Packet::peek_eager(msg, &engine.limits) else {
            return false;
        };
        if eager.frame.header.kind != Kind::Request || eager.starved {
            return false;
        }
        let taken = self.shortcut.offer_frame(&mut Lent {
            engine: &engine,
            eager,
            copy,
        });
        if taken {
            self.taken.store(true, Ordering::Relaxed);
        }
        taken
    }

    fn reposted(&self) {
        if self.taken.swap(false, Ordering::Relaxed) {
            if let Some(engine) = self.engine.upgrade() {
                engine.release();
            }
        }
    }
}

/// A received packet lent where it lies: a request to the server's taker (see
/// [`RequestsInPlace`]), an answer to its caller (`Direct::progress_with`).
struct Lent<'a, 'c> {
    engine: &'a Engine,
    /// the packet, read by `Packet::peek_eager`
    eager: rpc_core::rendezvous::Eager<'a>,
    copy: &'c mut dyn FnMut(&[u8]) -> bytes::Bytes,
}

impl rpc_core::LentFrame for Lent<'_, '_> {
    fn frame(&self) -> FrameRef<'_> {
        self.eager.frame
    }

    fn accept(&mut self) -> bool {
        self.engine.count_received(self.eager.credits)
    }

    fn own(&mut self) -> (bytes::Bytes, rpc_core::wire::Attachments) {
        let frame = &self.eager.frame;
        // nothing to copy (a body of at most one byte, empty attachments), or one copy
        frame
            .owned_if_tiny()
            .unwrap_or_else(|| frame.split_copy((self.copy)(self.eager.rest)))
    }
}

/// Receiving half of an [`RdmaTransport`].
pub struct RdmaReader {
    rx: inbox::Receiver<Delivery>,
    engine: Option<Arc<Engine>>,
    _close: Option<Arc<CloseOnDrop>>,
}

impl Stream for RdmaReader {
    type Item = io::Result<Message>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let d = match self.rx.poll_recv(cx) {
            Poll::Ready(Some(d)) => d,
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        if let (true, Some(engine)) = (d.credit, &self.engine) {
            // taken: the slot's credit goes back to the peer
            engine.release();
        }
        Poll::Ready(Some(d.item))
    }
}

/// What the receive side (`Inbound`) hands the reader: a message (or why the connection ended), and
/// whether taking it frees its receive slot's credit (a batch's slot is free once its last
/// message is taken).
struct Delivery {
    item: io::Result<Message>,
    credit: bool,
}

/// The receive side's end of the reader's channel, and the client's shortcut past it.
#[derive(Clone)]
struct Deliver {
    tx: inbox::Sender<Delivery>,
    /// A client takes its responses here, in the task that found them (the completion
    /// dispatch, or a transfer's task), and wakes the caller: no hand-off to its reader task.
    shortcut: rpc_core::ResponseShortcut,
}

impl Deliver {
    /// Hands on a message whose slot credit goes back when the reader takes it; `Err` (the
    /// client took it at once through its shortcut, or the reader is gone) means the caller
    /// must release the credit.
    fn message(&self, msg: Message, credit: bool) -> Result<(), ()> {
        let msg = self.shortcut.offer(msg).ok_or(())?;
        self.tx
            .send(Delivery {
                item: Ok(msg),
                credit,
            })
            .map_err(drop)
    }

    /// Tells the reader why the connection ends.
    fn error(&self, e: io::Error) {
        let _ = self.tx.send(Delivery {
            item: Err(e),
            credit: false,
        });
    }
}

/// Sending half of an [`RdmaTransport`].
///
/// Small messages given while nothing waits in the send loop are held here and, at the flush,
/// posted by the caller's own task as one SEND when a credit and a send slot are free: no
/// hand-off to the send loop. Everything else (rendezvous messages, what comes while the send
/// loop has work, what finds no credit or slot) goes through the send loop, after what is held.
pub struct RdmaWriter {
    tx: fmpsc::Sender<Outgoing>,
    close: Option<Arc<CloseOnDrop>>,
    /// eager messages to post directly at the next flush (they fit one packet together)
    held: Vec<Message>,
    /// their frames' length
    held_frames: u64,
}

/// What the writer hands the send loop: messages in order.
enum Outgoing {
    One(Message),
    /// held messages, then the one that could not join them
    Many(Vec<Message>),
}

impl Outgoing {
    fn len(&self) -> usize {
        match self {
            Outgoing::One(_) => 1,
            Outgoing::Many(v) => v.len(),
        }
    }

    fn push_to(self, q: &mut VecDeque<Message>) {
        match self {
            Outgoing::One(m) => q.push_back(m),
            Outgoing::Many(v) => q.extend(v),
        }
    }
}

fn closed_pipe(_: fmpsc::SendError) -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "RDMA connection closed")
}

impl RdmaWriter {
    /// Posts the held messages now if a credit and a send slot are free; else hands them to
    /// the send loop (once the channel has room). `Ready(Ok)`: nothing is held any more.
    fn poll_post_held(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.held.is_empty() {
            return Poll::Ready(Ok(()));
        }
        let engine = &self.close.as_ref().expect("held only with an engine").0;
        if !engine
            .post_direct(&self.held, self.held_frames)
            .map_err(to_io)?
        {
            ready!(self.tx.poll_ready(cx)).map_err(closed_pipe)?;
            let out = Outgoing::Many(std::mem::take(&mut self.held));
            engine.queued.fetch_add(out.len(), Ordering::Release);
            self.tx.start_send(out).map_err(closed_pipe)?;
        }
        self.held.clear();
        self.held_frames = 0;
        Poll::Ready(Ok(()))
    }
}

impl futures::Sink<Message> for RdmaWriter {
    type Error = io::Error;

    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.tx.poll_ready(cx).map_err(closed_pipe)
    }

    fn start_send(mut self: Pin<&mut Self>, item: Message) -> io::Result<()> {
        let this = &mut *self;
        let Some(close) = &this.close else {
            return this.tx.start_send(Outgoing::One(item)).map_err(closed_pipe);
        };
        let engine = &close.0;
        // Only on an idle link (nothing queued, no SEND in flight), which is where a hand-off
        // costs a round trip most: under load the send loop packs what accumulates while its
        // SENDs are out into fewer, fuller packets, which costs less per message than posting
        // each flush's worth at once (posting each flush halved 64-in-flight throughput).
        if engine.queued.load(Ordering::Acquire) == 0
            && (!this.held.is_empty() || engine.conn.sends_idle())
            && engine.is_eager(&item)
        {
            let frames = this.held_frames + item.wire_len();
            let fits = this.held.is_empty()
                || (this.held.len() < MAX_BATCH && Packet::batch_len(frames) <= engine.slot as u64);
            if fits {
                this.held_frames = frames;
                this.held.push(item);
                return Ok(());
            }
            // a full packet's worth: it goes now, if it can
            if engine
                .post_direct(&this.held, this.held_frames)
                .map_err(to_io)?
            {
                this.held.clear();
                this.held_frames = item.wire_len();
                this.held.push(item);
                return Ok(());
            }
        }
        // through the send loop, after what is held
        let out = if this.held.is_empty() {
            Outgoing::One(item)
        } else {
            let mut v = std::mem::take(&mut this.held);
            v.push(item);
            this.held_frames = 0;
            Outgoing::Many(v)
        };
        engine.queued.fetch_add(out.len(), Ordering::Release);
        this.tx.start_send(out).map_err(closed_pipe)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_post_held(cx))?;
        self.tx.poll_flush_unpin(cx).map_err(closed_pipe)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_post_held(cx))?;
        self.tx.poll_close_unpin(cx).map_err(closed_pipe)
    }
}

/// When both halves are gone: finish sending what was accepted (and let the peer read our
/// exposed buffers), then close the connection; see `send_loop`.
struct CloseOnDrop(Arc<Engine>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if self.0.ctl_tx.send(Ctl::Drain).is_err() {
            self.0.shutdown();
        }
    }
}

/// The most messages one SEND carries (see `send_loop`).
const MAX_BATCH: usize = 64;

/// The longest packet a direct post encodes on the stack and posts inline (where the queue
/// pair takes that much inline, `RdmaConnection::max_inline`), rather than in a send slot: a
/// small call's request or answer is well under it.
const INLINE_PACKET: usize = 256;

/// How long a closed transport waits for its last messages to go and the peer's last `Fin`s.
const DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A buffer of one of our pull transfers, held (out of the pool) until the peer's `Fin`, or
/// until the connection is closed (QP in the error state: the device serves no more READs).
enum Held {
    /// an empty attachment
    Empty,
    /// a pool buffer the attachment was copied into
    Pool(PoolBuf),
    /// the attachment itself, already a view of this connection's pool (lent by it, or a
    /// payload received on it): no copy; the payload keeps its buffer out of the pool
    View(Payload),
    /// the pool had no buffer: one registered for this transfer only
    Own {
        // drop order: revoke the peer's access, free the memory, then release its budget
        exposure: RemoteExposure,
        buf: RdmaBuffer,
        /// for a buffer granted to the peer's push: its share of the fallback budget
        budget: Option<Reserved>,
    },
    /// the pool had no buffer for a push source: one registered (local access) for it
    Local(RdmaBuffer),
}

impl Held {
    /// A buffer the peer has written (a granted push buffer) as the received payload.
    fn into_payload(self) -> Result<Payload, RdmaError> {
        match self {
            Held::Empty => Ok(Payload::new()),
            Held::Pool(buf) => Ok(Payload::from_owner(buf.freeze())),
            Held::View(p) => Ok(p),
            Held::Own {
                exposure,
                buf,
                budget,
            } => {
                drop(exposure);
                let frozen = buf.freeze().map_err(|_| RdmaError::BufferBusy)?;
                Ok(match budget {
                    Some(reserved) => Payload::from_owner(Budgeted {
                        buf: frozen,
                        _reserved: reserved,
                    }),
                    None => Payload::from_owner(frozen),
                })
            }
            Held::Local(buf) => buf
                .freeze()
                .map(Payload::from_owner)
                .map_err(|_| RdmaError::BufferBusy),
        }
    }
}

struct Proto {
    credits: Credits,
    transfers: Transfers<Held>,
    /// the attachment lengths of our push transfers awaiting the peer's `Cts`
    push_lens: IdMap<Vec<u64>>,
    /// rendezvous READs/WRITEs running (see `Op`)
    ops: usize,
    /// we have been blocked on send credits since our last packet (the next one says so)
    starved: bool,
    /// the peer's first packet has arrived. The accepting side sends nothing before that:
    /// iWARP's MPA forbids it (an FPDU that reaches the connecting side before it has read
    /// the MPA reply fails its connection set-up: siw reports EINVAL), and our protocol never
    /// needs it (the connecting side's first packet grants its window).
    heard: bool,
}

impl Proto {
    /// Whether a packet may go now: the peer has been heard from, and a credit is free (for
    /// `data`, one besides the one kept for returning credits).
    fn may_send(&self, data: bool) -> bool {
        self.heard
            && if data {
                self.credits.can_send()
            } else {
                self.credits.available() >= 1
            }
    }

    /// Takes a credit and encodes a packet with `encode`, given the credits it returns to the
    /// peer; marks it starved if we were blocked since our last packet.
    fn encode_packet(&mut self, encode: impl FnOnce(&mut BytesMut, u16)) -> BytesMut {
        let (credits, starved) = self.take_credits();
        let mut out = BytesMut::with_capacity(256);
        encode(&mut out, credits);
        if starved {
            Packet::mark_starved(&mut out);
        }
        out
    }

    /// As [`encode_packet`](Self::encode_packet), in place: into `out` (a send slot), which
    /// `encode` fills exactly.
    fn encode_packet_into(&mut self, out: &mut [u8], encode: impl FnOnce(&mut [u8], u16)) {
        let (credits, starved) = self.take_credits();
        encode(out, credits);
        if starved {
            Packet::mark_starved(out);
        }
    }

    /// The credits to return with the next packet, and whether we were blocked on credits
    /// since our last packet (that packet is then marked so).
    fn take_credits(&mut self) -> (u16, bool) {
        let credits = self.credits.take().unwrap_or(0);
        (credits, std::mem::take(&mut self.starved))
    }
}

enum Ctl {
    Fin(u64),
    Refuse(u64, u32),
    /// grant these buffers for the peer's push transfer
    Cts(u64, Vec<Segment>),
    /// our push transfer is written
    PushDone(u64),
    Credit,
    /// both halves were dropped: close once everything accepted went out
    Drain,
    /// something a drain waits for may have changed
    Recheck,
    Shutdown,
}

struct Engine {
    conn: RdmaConnection,
    proto: Mutex<Proto>,
    credit_changed: Notify,
    /// tasks in `when_sendable`: only then is `credit_changed` notified on every packet (its
    /// lock and wake-up list cost ~60 distinct instructions per message, callgrind)
    credit_waiters: AtomicUsize,
    ctl_tx: mpsc::UnboundedSender<Ctl>,
    limits: Limits,
    eager_threshold: usize,
    /// the longest packet that goes eager (`Plan::eager_limit` of `slot` and
    /// `eager_threshold`)
    eager_limit: usize,
    /// messages with at most this many bulk bytes go by sender-push, larger ones by pull
    push_up_to: u64,
    /// the budget of fallback buffers for the peer's transfers into us, in `BUDGET_UNIT`s
    /// (see [`RdmaOptions::max_fallback_bytes`])
    inbound: Arc<Semaphore>,
    inbound_units: u64,
    /// the largest receive window we grant the peer (our `recv_slots`)
    max_window: u32,
    /// messages handed to the send loop and not yet posted: while there are any, the writer
    /// posts nothing itself (they go first)
    queued: AtomicUsize,
    /// the receive side is handing on a batch (set and read under its lock, in `on_packet`)
    batch: AtomicBool,
    slot: usize,
    pool: PoolMonitor,
}

/// Encodes eager messages into one packet that fills `out` exactly: alone, or as a batch.
#[inline]
fn encode_eager(out: &mut [u8], credits: u16, msgs: &[Message]) {
    match msgs {
        [one] => Packet::encode_eager_exact(out, credits, one),
        _ => {
            let mut rest = &mut *out;
            Packet::encode_eager_batch(&mut rest, credits, msgs);
            debug_assert!(rest.is_empty(), "a packet fills its slot's length");
        }
    }
}

fn lock(m: &Mutex<Proto>) -> MutexGuard<'_, Proto> {
    m.lock()
}

impl Engine {
    /// Lends the answer to call `id` to `take`, borrowed from `slot` (a received packet), if
    /// `slot` is that answer as an eager packet (see `Packet::peek_eager`); whether `take`
    /// took it. Taken, it is consumed: its credits were counted when `take` accepted it, as
    /// in `on_packet`, and the caller owes its slot's credit back
    /// ([`release`](Self::release)) once the slot is posted again. Anything else (another
    /// call's answer, a packet of its sender starved of credits, a violation) is left to
    /// `on_packet`, untouched.
    fn lend_answer(
        &self,
        slot: &[u8],
        id: u64,
        copy: &mut dyn FnMut(&[u8]) -> bytes::Bytes,
        take: &mut dyn FnMut(&mut dyn rpc_core::LentFrame) -> bool,
    ) -> bool {
        let Some(eager) = Packet::peek_eager(slot, &self.limits) else {
            return false;
        };
        // (a shared receive queue's packets are never offered: see `poll_completions_offering`)
        let header = &eager.frame.header;
        if header.kind != Kind::Response || header.id != id || eager.starved {
            return false;
        }
        take(&mut Lent {
            engine: self,
            eager,
            copy,
        })
    }

    /// Counts a packet read in place and consumed as received, with the `credits` it returns,
    /// as `on_packet` counts one; false (nothing counted) if that breaks the credit rule:
    /// `on_packet` then finds the violation again and ends the connection.
    fn count_received(&self, credits: u16) -> bool {
        {
            let mut p = lock(&self.proto);
            if p.credits.on_receive(credits).is_err() {
                return false;
            }
            if !p.heard {
                p.heard = true;
                self.credit_changed.notify_waiters();
            }
        }
        // the credits it returned may be what a send loop waits for
        self.credits_changed();
        true
    }

    /// A received packet was consumed: owe the peer its credit, and return a half window.
    fn release(&self) {
        let mut p = lock(&self.proto);
        p.credits.on_slot_reposted();
        if let Some(share) = self.conn.srq_share() {
            // A shared receive queue: give the slot back to the other connections while the
            // budget is low (a window grows when the peer says it is starved, see
            // `on_packet`).
            if share.budget_low() {
                let k = p.credits.shrink(1);
                share.give_back(k);
            }
        }
        if p.credits.should_return() {
            let _ = self.ctl_tx.send(Ctl::Credit);
        }
        drop(p);
        // a send loop blocked on data credit may now return what it owes
        self.credits_changed();
    }

    /// Wakes the tasks waiting in `when_sendable`, if there are any; called after the change,
    /// made under the protocol lock, that they wait for. (A waiter counts itself in before it
    /// looks under that lock, so a change it did not see finds it counted.)
    fn credits_changed(&self) {
        if self.credit_waiters.load(Ordering::SeqCst) != 0 {
            self.credit_changed.notify_waiters();
        }
    }

    fn shutdown(&self) {
        self.conn.close();
        // transfers waiting for budget give up
        self.inbound.close();
        let _ = self.ctl_tx.send(Ctl::Shutdown);
        self.credit_changed.notify_waiters();
    }

    /// Sends one packet once credits allow it (`data`: needs two credits, else one).
    async fn send_packet(
        &self,
        data: bool,
        encode: impl FnOnce(&mut BytesMut, u16),
    ) -> Result<SendCompletion, RdmaError> {
        let out = self
            .when_sendable(data, |p| p.encode_packet(encode))
            .await?;
        self.conn.start_send(&out).await
    }

    /// Sends eager messages (one, or several that fit one packet; `frames` bytes of frames)
    /// from the send loop once credits allow, encoded in a send slot (no buffer, no copy).
    ///
    /// The send loop waits for the completion (see `send_loop`'s `pending`) rather than
    /// leaving it to the completion driver, as [`post_direct`](Self::post_direct) does: the
    /// slot is then free again only once the loop has looked, so that the writer takes the
    /// link for idle (and posts on its own) only once the loop has caught up. Freed at once,
    /// the writer posted each flush's worth and 64 in flight fell to 40% on rxe and siw.
    async fn send_eager(&self, msgs: &[Message], frames: u64) -> Result<SendCompletion, RdmaError> {
        let len = usize::try_from(Packet::packet_len(msgs, frames)).unwrap_or(usize::MAX);
        let mut slot = self.conn.send_slot(len)?;
        let bytes = slot.bytes()?;
        self.when_sendable(true, |p| {
            p.encode_packet_into(bytes, |out, credits| encode_eager(out, credits, msgs));
        })
        .await?;
        let permit = self.conn.send_permit().await?;
        self.conn.post_slot(slot, permit)
    }

    /// Waits until a packet may go (`data`: it needs two credits, else one), then runs
    /// `encode` under the protocol lock (it takes the packet's credits).
    async fn when_sendable<R>(
        &self,
        data: bool,
        encode: impl FnOnce(&mut Proto) -> R,
    ) -> Result<R, RdmaError> {
        let mut encode = Some(encode);
        let _counted = rpc_core::permits::Waiting::count(&self.credit_waiters);
        loop {
            let notified = self.credit_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let credit_return = {
                let mut p = lock(&self.proto);
                if p.may_send(data) {
                    let encode = encode.take().expect("encoded once, then sent");
                    return Ok(encode(&mut p));
                }
                if data && p.heard && p.credits.should_return() {
                    // Blocked on data credit while owing the peer half a window: return it now,
                    // with the credit kept for this, or both sides could wait on each other
                    // forever (each one's credits ride only on the other's data).
                    let credits = p.credits.take().unwrap_or(0);
                    let mut out = BytesMut::with_capacity(PACKET_HEADER_LEN);
                    Packet::encode_control(&mut out, credits, &Packet::Credit);
                    Packet::mark_starved(&mut out);
                    p.starved = false;
                    Some(out)
                } else {
                    if data && p.heard {
                        p.starved = true;
                    }
                    None
                }
            };
            if let Some(ret) = credit_return {
                // The send loop keeps a send slot free for the packet it is handling: use it
                // and give it back before sending the data.
                self.conn.start_send(&ret).await?.wait().await?;
                continue;
            }
            if self.conn.is_closed() {
                return Err(RdmaError::Closed(Some("waiting for send credits".into())));
            }
            notified.await;
        }
    }

    /// Whether nothing waits for the send loop and no SEND is in flight.
    fn idle(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0 && self.conn.sends_idle()
    }

    /// Whether `msg` goes whole in one packet (then it may share one with others).
    fn is_eager(&self, msg: &Message) -> bool {
        self.is_eager_frame(msg.wire_len())
    }

    /// [`is_eager`](Self::is_eager) for a message of `frame` bytes on the wire (its
    /// `wire_len`): `Plan::for_message`'s test for `Plan::Eager`.
    fn is_eager_frame(&self, frame: u64) -> bool {
        Packet::batch_len(frame) <= self.eager_limit as u64
    }

    /// Posts eager messages (one, or several that fit one packet; `frames` bytes of frames)
    /// now, from the caller's task, if a credit and a send slot are free: `Ok(false)` if not
    /// (nothing was taken then). The packet is encoded in the send slot itself: no buffer and
    /// no copy in between.
    fn post_direct(&self, msgs: &[Message], frames: u64) -> Result<bool, RdmaError> {
        let Some(permit) = self.conn.try_send_permit() else {
            return Ok(false);
        };
        let len = usize::try_from(Packet::packet_len(msgs, frames)).unwrap_or(usize::MAX);
        if len <= self.conn.max_inline().min(INLINE_PACKET) {
            // an inline SEND: encoded on the stack, copied by the post, no send slot
            let mut packet = [0u8; INLINE_PACKET];
            let packet = &mut packet[..len];
            {
                let mut p = lock(&self.proto);
                if !p.may_send(true) {
                    return Ok(false);
                }
                p.encode_packet_into(packet, |out, credits| {
                    encode_eager(out, credits, msgs);
                });
            }
            self.conn.post_inline_now(packet, permit)?;
            return Ok(true);
        }
        let mut slot = self.conn.send_slot(len)?;
        {
            let mut p = lock(&self.proto);
            if !p.may_send(true) {
                return Ok(false);
            }
            p.encode_packet_into(slot.bytes()?, |out, credits| {
                encode_eager(out, credits, msgs);
            });
        }
        self.conn.post_slot_now(slot, permit)?;
        Ok(true)
    }

    /// Sends `msg`: eager, or by rendezvous of its attachments (sender-push up to
    /// `push_up_to` bulk bytes, receiver-pull above). A body too large for a receive slot
    /// beside its header goes by rendezvous too, as the last segment of a marked announcement
    /// ([`rendezvous::lift_body`](rpc_core::rendezvous::lift_body)), so that a call with a
    /// large non-payload argument or result goes over RDMA as it goes over TCP; so does the
    /// body of a message that is not eager and has no payload.
    async fn send_message(&self, msg: Message) -> Result<SendCompletion, RdmaError> {
        let direction_of = |msg: &Message| {
            let bulk: u64 = msg.attachments.iter().map(|a| a.len() as u64).sum();
            if bulk <= self.push_up_to {
                Direction::Push
            } else {
                Direction::Pull
            }
        };
        // A message whose body goes as its last segment (see `lift_body`): one whose body does
        // not fit a slot beside its header, and one that would take a rendezvous with no
        // segment at all (a body over the eager threshold and no payload). A rendezvous
        // announcement with no segment left a connection of a shared receive queue waiting for
        // send credits in some runs (rxe, its first rendezvous: 5 of 8 runs with a 9,000-byte
        // body, 2026-12-07; the cause was not found), so none is sent.
        let lift = |msg: Message, why: String| {
            if msg.attachments.len() >= usize::from(self.limits.max_attachments) {
                return Err(RdmaError::InvalidArgument(why));
            }
            let lifted = rpc_core::rendezvous::lift_body(msg);
            match Plan::for_message(
                &lifted,
                self.slot,
                self.eager_threshold,
                direction_of(&lifted),
            ) {
                Ok(plan @ Plan::Rendezvous(_)) => Ok((lifted, plan, true)),
                // (a lifted message is longer than one that did not go eager)
                Ok(Plan::Eager) | Err(_) => Err(RdmaError::InvalidArgument(why)),
            }
        };
        let (msg, plan, body_last) =
            match Plan::for_message(&msg, self.slot, self.eager_threshold, direction_of(&msg)) {
                Ok(Plan::Rendezvous(_)) if msg.attachments.is_empty() => {
                    lift(msg, "a rendezvous with no segment".into())?
                }
                Ok(plan) => (msg, plan, false),
                Err(e) => lift(msg, e.to_string())?,
            };
        let mark = |out: &mut BytesMut, start: usize| {
            if body_last {
                Packet::mark_body_last(&mut out[start..]);
            }
        };
        match plan {
            Plan::Eager => {
                let frames = msg.wire_len();
                self.send_eager(std::slice::from_ref(&msg), frames).await
            }
            Plan::Rendezvous(Direction::Push) => {
                // the sources, written to the peer's grant when its Cts comes: a payload that
                // lies in this connection's pools (lent by it, or received on it) as it is;
                // others copied into pool buffers (or, the pool exhausted, a registered buffer)
                let mut held = Vec::with_capacity(msg.attachments.len());
                let mut lens = Vec::with_capacity(msg.attachments.len());
                for a in &msg.attachments {
                    lens.push(a.len() as u64);
                    if a.is_empty() {
                        held.push(Held::Empty);
                    } else if self.conn.can_write_from(a) {
                        held.push(Held::View(a.clone()));
                    } else if let Some(mut buf) = self.conn.lease_buffer(a.len(), PoolUse::Source) {
                        buf.bytes_mut().copy_from_slice(a);
                        self.pool.count_copy(a.len());
                        held.push(Held::Pool(buf));
                    } else {
                        self.pool.count_fallback();
                        let mut buf = self.conn.alloc_buffer(a.len())?;
                        buf.bytes_mut()?.copy_from_slice(a);
                        self.pool.count_copy(a.len());
                        held.push(Held::Local(buf));
                    }
                }
                let id = {
                    let mut p = lock(&self.proto);
                    let id = p.transfers.start_push(held);
                    p.push_lens.insert(id, lens);
                    id
                };
                self.send_packet(true, |out, c| {
                    let start = out.len();
                    Packet::encode_push_rts(out, c, id, &msg);
                    mark(out, start);
                })
                .await
            }
            Plan::Rendezvous(Direction::Pull) => {
                let mut held = Vec::with_capacity(msg.attachments.len());
                let mut segments = Vec::with_capacity(msg.attachments.len());
                for a in &msg.attachments {
                    if a.is_empty() {
                        segments.push(Segment {
                            addr: 0,
                            len: 0,
                            rkey: 0,
                        });
                        held.push(Held::Empty);
                        continue;
                    }
                    if let Some((addr, rkey)) = self.conn.pool_address_of(a) {
                        segments.push(Segment {
                            addr,
                            len: a.len() as u64,
                            rkey,
                        });
                        held.push(Held::View(a.clone()));
                        continue;
                    }
                    if let Some(mut buf) = self.conn.lease_buffer(a.len(), PoolUse::Source) {
                        buf.bytes_mut().copy_from_slice(a);
                        self.pool.count_copy(a.len());
                        let (addr, rkey) = buf.remote();
                        segments.push(Segment {
                            addr,
                            len: a.len() as u64,
                            rkey,
                        });
                        held.push(Held::Pool(buf));
                        continue;
                    }
                    // the pool is exhausted (or the attachment is larger than its largest
                    // class): register a buffer for this transfer rather than wait (waiting
                    // here could deadlock two peers that both wait for the other's Fin)
                    self.pool.count_fallback();
                    let mut buf = self.conn.alloc_buffer(a.len())?;
                    buf.bytes_mut()?.copy_from_slice(a);
                    self.pool.count_copy(a.len());
                    let exposure = buf.expose(RemoteAccess::Read)?;
                    let t = exposure.token();
                    segments.push(Segment {
                        addr: t.addr,
                        len: t.len,
                        rkey: t.rkey,
                    });
                    held.push(Held::Own {
                        exposure,
                        buf,
                        budget: None,
                    });
                }
                let id = lock(&self.proto).transfers.start_pull(held);
                self.send_packet(true, |out, c| {
                    let start = out.len();
                    Packet::encode_pull_rts(out, c, id, &msg, &segments);
                    mark(out, start);
                })
                .await
            }
        }
    }

    /// Reads the peer's segments into registered buffers: the payloads of the message.
    async fn pull(&self, segments: &[Segment]) -> Result<Vec<Payload>, RdmaError> {
        // the sinks first: pool buffers where the pool lends, the others registered, their
        // budget reserved in one go
        let mut sinks = Vec::with_capacity(segments.len());
        let mut fallback = Vec::new();
        for s in segments {
            let len = usize::try_from(s.len)
                .map_err(|_| RdmaError::InvalidArgument("segment too large".into()))?;
            let sink = if len == 0 {
                None
            } else if let Some(buf) = self.conn.lease_buffer(len, PoolUse::PullSink) {
                Some(Some(buf))
            } else {
                fallback.push(len);
                Some(None)
            };
            sinks.push(sink);
        }
        let mut reserved = self.reserve_inbound(&fallback).await?.into_iter();
        let mut out = Vec::with_capacity(segments.len());
        for (s, sink) in segments.iter().zip(sinks) {
            let len = s.len as usize;
            let token = RemoteToken {
                addr: s.addr,
                len: s.len,
                rkey: s.rkey,
            };
            match sink {
                None => out.push(Payload::new()),
                Some(Some(buf)) => {
                    // the payload is a view of the pool buffer the data arrived in
                    let buf = self.conn.read_into_pool(buf, &token, len).await?;
                    out.push(Payload::from_owner(buf.freeze()));
                }
                Some(None) => {
                    let reserved = reserved
                        .next()
                        .ok_or_else(|| RdmaError::InvalidArgument("budget miscounted".into()))?;
                    self.pool.count_fallback();
                    let mut buf = self.conn.alloc_buffer(len)?;
                    self.conn.read(&mut buf, 0, &token, 0, len).await?;
                    let frozen = buf.freeze().map_err(|_| RdmaError::BufferBusy)?;
                    out.push(Payload::from_owner(Budgeted {
                        buf: frozen,
                        _reserved: reserved,
                    }));
                }
            }
        }
        Ok(out)
    }

    /// Reserves the fallback budget for buffers of `lens` bytes, all at once (two transfers
    /// that each hold part of the budget and wait for the rest would wait for ever); waits
    /// while earlier transfers' buffers hold it.
    async fn reserve_inbound(&self, lens: &[usize]) -> Result<Vec<Reserved>, RdmaError> {
        let total: u64 = lens.iter().map(|&l| units(l as u64)).sum();
        if total == 0 {
            return Ok(Vec::new());
        }
        if total > self.inbound_units {
            return Err(RdmaError::InvalidArgument(format!(
                "the peer's transfer needs {} bytes of registered buffers, more than this \
                 connection's budget (max_fallback_bytes)",
                lens.iter().sum::<usize>()
            )));
        }
        let count = u32::try_from(total)
            .map_err(|_| RdmaError::InvalidArgument("transfer too large".into()))?;
        let mut permit = Arc::clone(&self.inbound)
            .acquire_many_owned(count)
            .await
            .map_err(|_| {
                RdmaError::Closed(Some("closed while waiting for buffer budget".into()))
            })?;
        let mut out = Vec::with_capacity(lens.len());
        for &len in lens {
            let share = permit
                .split(units(len as u64) as usize)
                .ok_or_else(|| RdmaError::InvalidArgument("budget miscounted".into()))?;
            self.pool.hold_fallback_bytes(len as u64);
            out.push(Reserved {
                _permit: share,
                bytes: len as u64,
                pool: self.pool.clone(),
            });
        }
        Ok(out)
    }
}

/// Granularity of the fallback budget.
const BUDGET_UNIT: u64 = 4096;

fn units(bytes: u64) -> u64 {
    bytes.div_ceil(BUDGET_UNIT)
}

/// A fallback buffer's share of its connection's budget, held until the buffer (or the payload
/// received in it) is dropped.
struct Reserved {
    _permit: OwnedSemaphorePermit,
    bytes: u64,
    pool: PoolMonitor,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.pool.release_fallback_bytes(self.bytes);
    }
}

/// A payload received in a fallback buffer: the buffer, then its budget, go when it is dropped.
struct Budgeted {
    buf: FrozenBuffer,
    _reserved: Reserved,
}

impl AsRef<[u8]> for Budgeted {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_ref()
    }
}

impl Engine {
    /// Buffers for the peer's push transfer of attachments of `lens` bytes, and their segments
    /// (waits while the fallback budget is taken, see `reserve_inbound`).
    async fn grant(&self, lens: &[u64]) -> Result<(Vec<Held>, Vec<Segment>), RdmaError> {
        let mut leased = Vec::with_capacity(lens.len());
        let mut fallback = Vec::new();
        for &len in lens {
            let len = usize::try_from(len)
                .map_err(|_| RdmaError::InvalidArgument("attachment too large".into()))?;
            let buf = if len == 0 {
                None
            } else {
                let buf = self.conn.lease_buffer(len, PoolUse::PushGrant);
                if buf.is_none() {
                    fallback.push(len);
                }
                buf
            };
            leased.push((len, buf));
        }
        let mut reserved = self.reserve_inbound(&fallback).await?.into_iter();
        let mut held = Vec::with_capacity(lens.len());
        let mut segments = Vec::with_capacity(lens.len());
        for (len, buf) in leased {
            if len == 0 {
                segments.push(Segment {
                    addr: 0,
                    len: 0,
                    rkey: 0,
                });
                held.push(Held::Empty);
            } else if let Some(buf) = buf {
                let (addr, rkey) = buf.remote();
                segments.push(Segment {
                    addr,
                    len: len as u64,
                    rkey,
                });
                held.push(Held::Pool(buf));
            } else {
                let budget = reserved
                    .next()
                    .ok_or_else(|| RdmaError::InvalidArgument("budget miscounted".into()))?;
                self.pool.count_fallback();
                let buf = self.conn.alloc_buffer(len)?;
                let exposure = buf.expose(RemoteAccess::Write)?;
                let t = exposure.token();
                segments.push(Segment {
                    addr: t.addr,
                    len: t.len,
                    rkey: t.rkey,
                });
                held.push(Held::Own {
                    exposure,
                    buf,
                    budget: Some(budget),
                });
            }
        }
        Ok((held, segments))
    }

    /// Writes our push transfer's sources into the peer's granted buffers.
    async fn push(&self, sources: Vec<Held>, segments: &[Segment]) -> Result<(), RdmaError> {
        for (h, s) in sources.into_iter().zip(segments) {
            let token = RemoteToken {
                addr: s.addr,
                len: s.len,
                rkey: s.rkey,
            };
            let len = s.len as usize;
            match h {
                Held::Empty => {}
                // the buffer goes back to the pool once the WRITE completed
                Held::Pool(buf) => drop(self.conn.write_from_pool(buf, &token, len).await?),
                Held::Local(mut buf) => self.conn.write(&mut buf, 0, &token, 0, len).await?,
                Held::View(p) => self.conn.write_from_view(p, &token).await?,
                Held::Own { .. } => {
                    return Err(RdmaError::InvalidArgument(
                        "push source neither a pool, a view nor a local buffer".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// A rendezvous READ or WRITE running in its own task; a drain waits for it (the `Fin` or
/// `PushDone` it ends with must go out before the connection closes).
struct Op {
    engine: Arc<Engine>,
}

impl Op {
    fn start(engine: &Arc<Engine>) -> Op {
        lock(&engine.proto).ops += 1;
        Op {
            engine: Arc::clone(engine),
        }
    }

    /// The transfer failed: the connection ends, and the reader hears why.
    fn fail(&self, deliver: &Deliver, e: RdmaError) {
        tracing::debug!("transport-rdma: rendezvous transfer failed, closing: {e}");
        deliver.error(to_io(e));
        self.engine.shutdown();
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        lock(&self.engine.proto).ops -= 1;
        let _ = self.engine.ctl_tx.send(Ctl::Recheck);
    }
}

fn violation(v: rpc_core::rendezvous::ProtocolViolation) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, v)
}

/// Receives packets: credits, deliveries, rendezvous reads, transfer bookkeeping.
///
/// Each packet is handled by the task that found its completion on the CQ (the completion
/// driver, or a task busy-polling for its own completion), as part of that poll: no task
/// hand-off between the CQ and the reader. Handling never blocks: transfers (READs, WRITEs,
/// grants that may wait for budget) run in tasks of their own.
///
/// It never waits for the reader: the credits piggybacked on packets queued behind a message
/// the reader has not taken yet may be exactly what our own send loop waits for, and the
/// reader may be waiting for that send loop (a server answering calls). Instead, a delivered
/// message keeps its slot's credit until the reader takes it ([`Engine::release`]), so the
/// peer can never get more than a window of messages ahead of the reader.
struct Inbound {
    /// weak: the connection (inside the engine) holds this receiver
    engine: std::sync::Weak<Engine>,
    /// until the stream ends; dropping it then ends the reader's stream
    deliver: Option<Deliver>,
}

impl Inbound {
    /// Installs the receive side on `engine`'s connection; returns the task that passes on
    /// the end of the stream (it holds the engine until then, as the connection's reader).
    fn start(engine: &Arc<Engine>, deliver: Deliver) -> impl std::future::Future<Output = ()> {
        let inbound = Mutex::new(Inbound {
            engine: Arc::downgrade(engine),
            deliver: Some(deliver),
        });
        engine.conn.deliver_to(Box::new(move |item| {
            lock_inbound(&inbound).on_receive(item)
        }));
        let engine = Arc::clone(engine);
        async move { engine.conn.forward_end().await }
    }

    fn on_receive(&mut self, item: Result<Option<bytes::Bytes>, RdmaError>) {
        let Some(deliver) = &self.deliver else {
            // ended: a late end of stream, or data flushed after it
            return;
        };
        let Some(engine) = self.engine.upgrade() else {
            self.deliver = None;
            return;
        };
        let end = match item {
            Ok(Some(data)) => match on_packet(&engine, deliver, data) {
                Ok(()) => return,
                Err(e) => Some(e),
            },
            Ok(None) => None,
            Err(e) => Some(to_io(e)),
        };
        let deliver = self.deliver.take().expect("checked above");
        if let Some(e) = end {
            tracing::debug!("transport-rdma: connection ends: {e}");
            deliver.error(e);
        }
        engine.shutdown();
        // the connection is closed (QP in the error state): the device no longer reads our
        // exposed buffers, so they may go
        drop(lock(&engine.proto).transfers.drain());
    }
}

fn lock_inbound(m: &Mutex<Inbound>) -> MutexGuard<'_, Inbound> {
    m.lock()
}

/// Handles one received packet; `Err` ends the connection.
fn on_packet(engine: &Arc<Engine>, deliver: &Deliver, data: bytes::Bytes) -> Result<(), io::Error> {
    // a message for the reader, or (the reader is gone) the credit straight back
    let hand_on = |msg: Message| {
        if deliver.message(msg, true).is_err() {
            engine.release();
        }
    };
    let starved = Packet::is_starved(&data);
    let (packet, credits) = match Packet::parse(data, &engine.limits) {
        Ok(x) => x,
        Err(v) => return Err(violation(v)),
    };
    {
        let mut p = lock(&engine.proto);
        if let Err(v) = p.credits.on_receive(credits) {
            return Err(violation(v));
        }
        if !p.heard {
            // the accepting side may send from now on
            p.heard = true;
            engine.credit_changed.notify_waiters();
        }
        // A peer starved of credits on a shared receive queue: widen its window by half
        // again (at least 2, up to `recv_slots`) while the budget lends; granted with our
        // next packet.
        if let (true, Some(share)) = (starved, engine.conn.srq_share()) {
            let w = p.credits.window();
            if w < engine.max_window {
                let want = (w / 2).max(2).min(engine.max_window - w);
                let got = share.borrow(want);
                p.credits.grow(got);
                if got > 0 && p.credits.should_return() {
                    let _ = engine.ctl_tx.send(Ctl::Credit);
                }
            }
        }
    }
    // RdmaConnection::recv_bytes reposted the slot already; a message's credit goes back
    // when the reader takes it, a control packet's now
    // (a push announcement holds its credit until the reader takes the message, which
    // bounds the buffers granted to one peer by the window)
    let message = matches!(
        packet,
        Packet::Eager(_) | Packet::EagerBatch(_) | Packet::PullRts { .. } | Packet::PushRts { .. }
    );
    if !message {
        engine.release();
    } else {
        engine.credits_changed();
    }
    match packet {
        Packet::Eager(msg) => hand_on(msg),
        Packet::EagerBatch(msgs) => {
            // the slot's credit rides on the batch's last message
            let last = msgs.len() - 1;
            // a batch means the peer is busy: a server leaves its requests to the connection
            // task, which answers them together (see `Direct`)
            engine.batch.store(true, Ordering::Relaxed);
            for (i, msg) in msgs.into_iter().enumerate() {
                if deliver.message(msg, i == last).is_err() && i == last {
                    engine.release();
                }
            }
            engine.batch.store(false, Ordering::Relaxed);
        }
        Packet::PullRts { id, head, segments } => {
            // the READs run in a task of their own: a long transfer holds up no other packet
            // (keep-alives, small calls, credits)
            let op = Op::start(engine);
            let deliver = deliver.clone();
            tokio::spawn(async move {
                match op.engine.pull(&segments).await {
                    Ok(payloads) => {
                        let _ = op.engine.ctl_tx.send(Ctl::Fin(id));
                        if deliver.message(head.into_message(payloads), true).is_err() {
                            op.engine.release();
                        }
                    }
                    Err(e) => op.fail(&deliver, e),
                }
            });
        }
        Packet::Fin { id } => match lock(&engine.proto).transfers.on_fin(id) {
            // dropping the buffers revokes the peer's access and frees them
            Ok(bufs) => {
                drop(bufs);
                let _ = engine.ctl_tx.send(Ctl::Recheck);
            }
            Err(v) => return Err(violation(v)),
        },
        Packet::Refuse { id, reason } => {
            let refused = {
                let mut p = lock(&engine.proto);
                p.push_lens.remove(&id);
                p.transfers.on_refuse(id)
            };
            match refused {
                Ok(bufs) => {
                    drop(bufs);
                    tracing::warn!("transport-rdma: peer refused transfer {id} (reason {reason}); message dropped");
                }
                Err(v) => return Err(violation(v)),
            }
        }
        Packet::PushRts { id, head } => {
            // granting may wait for the fallback budget: in a task of its own, like transfers
            let op = Op::start(engine);
            let deliver = deliver.clone();
            tokio::spawn(async move {
                let engine = &op.engine;
                match engine.grant(&head.lens).await {
                    Ok((bufs, segments)) => {
                        let begun = lock(&engine.proto)
                            .transfers
                            .begin_incoming(id, Incoming::Granted { head, bufs });
                        match begun {
                            Ok(()) => {
                                let _ = engine.ctl_tx.send(Ctl::Cts(id, segments));
                            }
                            Err(v) => {
                                deliver.error(violation(v));
                                engine.shutdown();
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!("transport-rdma: no buffers for the peer's push {id}: {e}");
                        engine.release();
                        let _ = engine.ctl_tx.send(Ctl::Refuse(id, refuse::NO_BUFFERS));
                    }
                }
            });
        }
        Packet::Cts { id, segments } => {
            let sources = {
                let mut p = lock(&engine.proto);
                let lens = p.push_lens.get(&id).cloned().unwrap_or_default();
                let r = p.transfers.on_cts(id, &segments, lens.into_iter());
                if r.is_ok() {
                    p.push_lens.remove(&id);
                }
                r
            };
            match sources {
                Ok(sources) => {
                    // the WRITEs run in a task of their own, as pulls do
                    let op = Op::start(engine);
                    let deliver = deliver.clone();
                    tokio::spawn(async move {
                        match op.engine.push(sources, &segments).await {
                            Ok(()) => {
                                let _ = op.engine.ctl_tx.send(Ctl::PushDone(id));
                            }
                            Err(e) => op.fail(&deliver, e),
                        }
                    });
                }
                Err(v) => return Err(violation(v)),
            }
        }
        Packet::PushDone { id } => {
            let done = lock(&engine.proto).transfers.on_push_done(id);
            match done {
                Ok((head, bufs)) => {
                    let payloads: Result<Vec<Payload>, RdmaError> =
                        bufs.into_iter().map(Held::into_payload).collect();
                    match payloads {
                        Ok(p) => hand_on(head.into_message(p)),
                        Err(e) => return Err(to_io(e)),
                    }
                }
                Err(v) => return Err(violation(v)),
            }
        }
        Packet::Credit => {}
    }
    Ok(())
}

/// Sends messages from the writer and control packets from the receive side (`Inbound`). After a drain
/// request it closes the connection once the writer's messages are sent and the peer has read
/// every exposed buffer (or after `DRAIN_LIMIT`).
async fn send_loop(
    engine: Arc<Engine>,
    mut msgs: fmpsc::Receiver<Outgoing>,
    mut ctl: mpsc::UnboundedReceiver<Ctl>,
) {
    let mut msgs_open = true;
    let mut drain_deadline: Option<tokio::time::Instant> = None;
    // SENDs posted and not yet completed: several in flight (they arrive in posting order);
    // at most `send_slots`, so posting never waits for a slot that only this loop frees
    let mut pending = futures::stream::FuturesUnordered::new();
    let max_pending = engine.conn.send_slots().max(1);
    // messages taken from the writer and not sent yet, in order
    let mut backlog: VecDeque<Message> = VecDeque::new();
    // the eager messages of the packet being sent (kept, so that it is allocated once)
    let mut batch: Vec<Message> = Vec::new();
    loop {
        while pending.len() >= max_pending {
            if let Some(Err(e)) = pending.next().await {
                tracing::debug!("transport-rdma: send failed, closing the connection: {e}");
                engine.shutdown();
                return;
            }
        }
        let drained = drain_deadline.filter(|_| {
            !msgs_open && backlog.is_empty() && ctl.is_empty() && pending.is_empty() && {
                let p = lock(&engine.proto);
                p.transfers.is_empty() && p.ops == 0
            }
        });
        if let Some(deadline) = drained {
            // and the writer's own SENDs have completed (every slot is back)
            let _ = tokio::time::timeout_at(deadline, engine.conn.sends_done()).await;
            engine.shutdown();
            return;
        }
        enum Item {
            Ctl(Ctl),
            Msg(Message),
        }
        let deadline = drain_deadline.unwrap_or_else(tokio::time::Instant::now);
        let item = if let Some(m) = backlog.pop_front() {
            Item::Msg(m)
        } else {
            tokio::select! {
            biased;
            Some(done) = pending.next(), if !pending.is_empty() => {
                if let Err(e) = done {
                    tracing::debug!("transport-rdma: send failed, closing the connection: {e}");
                    engine.shutdown();
                    return;
                }
                continue;
            },
            c = ctl.recv() => match c {
                Some(c) => Item::Ctl(c),
                None => return,
            },
            m = msgs.next(), if msgs_open => match m {
                Some(out) => {
                    out.push_to(&mut backlog);
                    continue;
                },
                None => {
                    msgs_open = false;
                    continue;
                },
            },
            () = tokio::time::sleep_until(deadline), if drain_deadline.is_some() => {
                tracing::debug!("transport-rdma: drain took longer than {DRAIN_LIMIT:?}; closing");
                engine.shutdown();
                return;
            },
            }
        };
        let res = match item {
            Item::Ctl(Ctl::Shutdown) => return,
            Item::Ctl(Ctl::Drain) => {
                drain_deadline = Some(tokio::time::Instant::now() + DRAIN_LIMIT);
                continue;
            }
            Item::Ctl(Ctl::Recheck) => continue,
            Item::Ctl(Ctl::Credit) => {
                if !lock(&engine.proto).credits.should_return() {
                    continue;
                }
                engine
                    .send_packet(false, |out, c| {
                        Packet::encode_control(out, c, &Packet::Credit)
                    })
                    .await
            }
            Item::Ctl(Ctl::Fin(id)) => {
                engine
                    .send_packet(true, |out, c| {
                        Packet::encode_control(out, c, &Packet::Fin { id })
                    })
                    .await
            }
            Item::Ctl(Ctl::Cts(id, segments)) => {
                engine
                    .send_packet(true, |out, c| Packet::encode_cts(out, c, id, &segments))
                    .await
            }
            Item::Ctl(Ctl::PushDone(id)) => {
                engine
                    .send_packet(true, |out, c| {
                        Packet::encode_control(out, c, &Packet::PushDone { id })
                    })
                    .await
            }
            Item::Ctl(Ctl::Refuse(id, reason)) => {
                engine
                    .send_packet(true, |out, c| {
                        Packet::encode_control(out, c, &Packet::Refuse { id, reason })
                    })
                    .await
            }
            Item::Msg(m) if engine.is_eager(&m) => {
                // Small messages the writer has ready go in one SEND: one work request, one
                // receive slot and one completion on each side for all of them.
                batch.clear();
                let mut frames = m.wire_len();
                let mut first = Some(m);
                while batch.len() < MAX_BATCH {
                    let next = match backlog.pop_front() {
                        Some(next) => next,
                        None => match msgs.try_recv() {
                            Ok(out) => {
                                out.push_to(&mut backlog);
                                continue;
                            }
                            Err(e) => {
                                msgs_open &= !e.is_closed();
                                break;
                            }
                        },
                    };
                    let fits = Packet::batch_len(frames + next.wire_len()) <= engine.slot as u64;
                    if !(fits && engine.is_eager(&next)) {
                        backlog.push_front(next);
                        break;
                    }
                    frames += next.wire_len();
                    // the first companion found: only now is there a batch to allocate
                    batch.extend(first.take());
                    batch.push(next);
                }
                batch.extend(first);
                let res = engine.send_eager(&batch, frames).await;
                engine.queued.fetch_sub(batch.len(), Ordering::Release);
                batch.clear();
                res
            }
            Item::Msg(m) => {
                let res = engine.send_message(m).await;
                engine.queued.fetch_sub(1, Ordering::Release);
                res
            }
        };
        match res {
            Ok(done) => pending.push(done.settled()),
            Err(e) => {
                tracing::debug!("transport-rdma: send failed, closing the connection: {e}");
                engine.shutdown();
                return;
            }
        }
    }
}

/// Accepts rdma-rpc connections.
pub struct RdmaRpcListener {
    inner: RdmaListener,
    config: Config,
    push_up_to: u64,
    max_fallback_bytes: u64,
}

impl std::fmt::Debug for RdmaRpcListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaRpcListener")
            .field("inner", &self.inner)
            .finish()
    }
}

impl RdmaRpcListener {
    /// Listens on `addr` (an IP address of an RDMA device). Needs a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        config: Config,
        opts: RdmaOptions,
    ) -> Result<RdmaRpcListener, RdmaError> {
        let inner = RdmaListener::bind(addr, effective(&opts, &config))?;
        Ok(RdmaRpcListener {
            inner,
            config,
            push_up_to: opts.push_up_to,
            max_fallback_bytes: opts.max_fallback_bytes,
        })
    }

    /// Listens on an `rdma://HOST:PORT[?options]` endpoint (see [`RdmaOptions::from_endpoint`]).
    pub async fn bind_endpoint(
        ep: &rpc_core::Endpoint,
        config: Config,
    ) -> Result<RdmaRpcListener, RdmaError> {
        let opts = RdmaOptions::from_endpoint(ep)?;
        let addr = resolve(ep).await?;
        RdmaRpcListener::bind(addr, config, opts)
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr()
    }

    /// The counters of the registered pools of every connection it accepted.
    pub fn pool_monitor(&self) -> PoolMonitor {
        self.inner.pool_monitor()
    }

    /// Watches its shared receive queues ([`RdmaOptions::srq_slots`]).
    pub fn shared_receive_monitor(&self) -> crate::SharedReceiveMonitor {
        self.inner.shared_receive_monitor()
    }
}

impl rpc_core::Listener for RdmaRpcListener {
    type Transport = RdmaTransport;

    /// Returns as soon as a connection request arrives; the set-up finishes in
    /// [`rpc_core::Transport::establish`], in the connection's own task.
    async fn accept(&mut self) -> io::Result<RdmaTransport> {
        let pending = self.inner.next_request().await.map_err(to_io)?;
        Ok(RdmaTransport {
            state: State::Pending(pending),
            config: self.config.clone(),
            peer: "incoming RDMA connection".into(),
            push_up_to: self.push_up_to,
            max_fallback_bytes: self.max_fallback_bytes,
            shortcut: rpc_core::ResponseShortcut::new(),
            direct: Arc::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn opts(query: &str) -> RdmaOptions {
        let ep: rpc_core::Endpoint = format!("rdma://h:1?{query}").parse().expect("endpoint");
        RdmaOptions::from_endpoint(&ep).expect("options")
    }

    #[test]
    fn spin_options_from_the_endpoint() {
        let d = RdmaOptions::default();
        assert!(d.busy_poll < d.busy_poll_max, "the default window adapts");
        let o = opts("busy_poll_us=2000");
        assert_eq!(
            (o.busy_poll, o.busy_poll_max),
            (Duration::from_millis(2), Duration::from_millis(2))
        );
        let o = opts("busy_poll=0");
        assert_eq!(
            (o.busy_poll, o.busy_poll_max),
            (Duration::ZERO, Duration::ZERO)
        );
        let o = opts("busy_poll_max_us=300");
        assert_eq!(
            (o.busy_poll, o.busy_poll_max),
            (d.busy_poll, Duration::from_micros(300))
        );
        // an explicit ceiling holds whichever option comes first
        for q in [
            "busy_poll_us=100&busy_poll_max_us=900",
            "busy_poll_max_us=900&busy_poll_us=100",
        ] {
            let o = opts(q);
            assert_eq!(
                (o.busy_poll, o.busy_poll_max),
                (Duration::from_micros(100), Duration::from_micros(900)),
                "{q}"
            );
        }
        assert!(
            RdmaOptions::from_endpoint(&"rdma://h:1?busy_poll_max_us=x".parse().unwrap()).is_err()
        );
    }

    #[test]
    fn poll_burst_from_the_endpoint() {
        assert_eq!(opts("").poll_burst, Duration::ZERO, "off by default");
        assert_eq!(
            opts("busy_poll_us=2000&poll_burst_us=200").poll_burst,
            Duration::from_micros(200)
        );
        assert!(
            RdmaOptions::from_endpoint(&"rdma://h:1?poll_burst_us=-1".parse().unwrap()).is_err()
        );
    }

    #[test]
    fn read_depth_from_the_endpoint() {
        assert_eq!(opts("").read_depth, crate::DEFAULT_READ_DEPTH);
        assert_eq!(opts("read_depth=16").read_depth, 16);
        assert_eq!(opts("").inflight_bytes, crate::DEFAULT_INFLIGHT_BYTES);
        assert_eq!(opts("inflight_bytes=33554432").inflight_bytes, 32 << 20);
        assert_eq!(opts("").max_inline, crate::DEFAULT_MAX_INLINE);
        assert_eq!(opts("max_inline=0").max_inline, 0);
        assert_eq!(opts("max_inline=200").max_inline, 200);
        let ep: rpc_core::Endpoint = "rdma://h:1?max_inline=x".parse().unwrap();
        let err = RdmaOptions::from_endpoint(&ep).expect_err("x").to_string();
        assert!(err.contains("max_inline"), "{err}");
        for bad in ["0", "256", "x"] {
            let ep: rpc_core::Endpoint = format!("rdma://h:1?read_depth={bad}").parse().unwrap();
            let err = RdmaOptions::from_endpoint(&ep).expect_err(bad).to_string();
            assert!(err.contains("read_depth"), "{bad}: {err}");
        }
    }

    #[test]
    fn ack_timeout_from_the_endpoint() {
        use std::time::Duration;
        assert_eq!(opts("").ack_timeout, Some(crate::DEFAULT_ACK_TIMEOUT));
        assert_eq!(opts("ack_timeout_ms=0").ack_timeout, None);
        assert_eq!(
            opts("ack_timeout_ms=67").ack_timeout,
            Some(Duration::from_millis(67))
        );
        let ep: rpc_core::Endpoint = "rdma://h:1?ack_timeout_ms=soon".parse().unwrap();
        let err = RdmaOptions::from_endpoint(&ep)
            .expect_err("soon")
            .to_string();
        assert!(err.contains("ack_timeout_ms"), "{err}");
    }
}
