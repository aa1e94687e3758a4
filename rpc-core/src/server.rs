//! The server's side: [`Service`] (implemented by generated `FooServer`s), per-connection
//! dispatch with cancellation, deadlines, panic isolation and flow control, and graceful
//! shutdown.

use std::any::Any;
use std::cell::Cell;
use std::future::Future;
use std::io;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use futures::{FutureExt, Sink, SinkExt, StreamExt};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{mpsc, Notify};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::codec::direct::{DecodeBody, EncodeBody, Serde};
use crate::codec::Codec;
use crate::conn::{KeepAlive, Outbox, Tick};
use crate::ids::IdMap;
use crate::payload::{PayloadMemory, PayloadMut};
use crate::transport::{DirectSend, LentFrame, Listener, Transport};
use crate::wire::{Attachments, FrameError, Header, Kind, Message};
use crate::{Config, Secret, ServerError, ServerErrorKind};

/// A set of methods served under one name. Implemented by the `FooServer<S>` types that
/// `#[rdma_service]` generates; there is rarely a reason to implement it by hand.
pub trait Service: Send + Sync + 'static {
    /// The service (trait) name.
    const NAME: &'static str;

    /// The name of method id `method`, or `None` if it is not served.
    fn method_name(&self, method: u32) -> Option<&'static str>;

    /// Runs method `method` on `request` and encodes its result.
    fn dispatch(
        &self,
        method: u32,
        request: Request,
    ) -> impl Future<Output = Result<Reply, ServerError>> + Send + '_;
}

/// A received request's encoded arguments.
#[derive(Debug)]
pub struct Request {
    body: Bytes,
    attachments: Attachments,
}

impl Request {
    /// A request from an encoded body and its attachments.
    pub fn new(body: Bytes, attachments: impl Into<Attachments>) -> Request {
        Request {
            body,
            attachments: attachments.into(),
        }
    }

    /// Decodes the arguments of method `name`; failure is a `BadRequest` for the caller.
    pub fn decode<C: Codec, T: DeserializeOwned>(
        self,
        name: &'static str,
    ) -> Result<T, ServerError> {
        self.decode_via(Serde::<C>::new(), name)
    }

    /// As [`decode`](Self::decode), through the body path `_via` (a value of a zero-sized
    /// type: generated servers pass what [`crate::codec::direct::Probe`] picked for the
    /// method's arguments).
    pub fn decode_via<D: DecodeBody<T>, T>(
        self,
        _via: D,
        name: &'static str,
    ) -> Result<T, ServerError> {
        D::decode(&self.body, self.attachments).map_err(|e| {
            ServerError::new(
                ServerErrorKind::BadRequest,
                format!("could not decode the arguments of {name}: {e}"),
            )
        })
    }
}

/// An encoded result, ready to send.
#[derive(Debug)]
pub struct Reply {
    body: Bytes,
    attachments: Attachments,
}

impl Reply {
    /// Encodes a method's result.
    pub fn encode<C: Codec, T: Serialize + ?Sized>(value: &T) -> Result<Reply, ServerError> {
        Reply::encode_via(Serde::<C>::new(), value)
    }

    /// As [`encode`](Self::encode), through the body path `_via` (a value of a zero-sized
    /// type: generated servers pass what [`crate::codec::direct::Probe`] picked for the
    /// method's result).
    pub fn encode_via<E: EncodeBody<T>, T: ?Sized>(
        _via: E,
        value: &T,
    ) -> Result<Reply, ServerError> {
        let (body, attachments) = E::encode(value).map_err(|e| {
            ServerError::new(
                ServerErrorKind::Internal,
                format!("could not encode the result: {e}"),
            )
        })?;
        Ok(Reply { body, attachments })
    }
}

/// Stops a running server: it takes no new connections or calls, lets the calls in flight
/// finish and answer, then closes every connection and `serve` returns.
#[derive(Debug, Clone, Default)]
pub struct ShutdownHandle {
    token: CancellationToken,
    /// Set before `token` is cancelled: read for every request, where the token's own check
    /// (a mutex) would cost more than the rest of the bookkeeping.
    flag: Arc<AtomicBool>,
}

impl ShutdownHandle {
    /// A handle not yet triggered.
    pub fn new() -> ShutdownHandle {
        ShutdownHandle::default()
    }

    /// Starts a graceful shutdown (idempotent).
    pub fn shutdown(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.token.cancel();
    }

    /// Whether shutdown has started.
    pub fn is_shutting_down(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Resolves once shutdown has started.
    pub async fn started(&self) {
        self.token.cancelled().await
    }
}

/// Counters a server exposes (for tests and metrics).
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections being served now.
    pub connections: std::sync::atomic::AtomicUsize,
    /// Handlers running now.
    pub handlers: std::sync::atomic::AtomicUsize,
}

#[derive(Clone)]
struct Ctx {
    config: Config,
    handler_slots: Arc<Slots>,
    shutdown: CancellationToken,
    /// The shutdown handle's flag: set once shutdown has started.
    shutting_down: Arc<AtomicBool>,
    stats: Arc<ServerStats>,
}

/// The server's handler slots (`max_concurrent_handlers`), shared by its connections.
///
/// A counter instead of a `tokio::sync::Semaphore`: taking and giving back a slot is one atomic
/// operation each when nobody waits (the semaphore takes a lock on every release, and most
/// handlers hold their slot only for one inline poll). Waiters are woken one at a time.
struct Slots {
    free: AtomicUsize,
    /// Connections waiting in [`Slots::take`].
    waiters: AtomicUsize,
    freed: Notify,
}

impl Slots {
    fn new(n: usize) -> Slots {
        Slots {
            free: AtomicUsize::new(n),
            waiters: AtomicUsize::new(0),
            freed: Notify::new(),
        }
    }

    /// Takes a slot if one is free.
    fn try_take(&self) -> bool {
        let mut free = self.free.load(Ordering::Relaxed);
        loop {
            if free == 0 {
                return false;
            }
            match self.free.compare_exchange_weak(
                free,
                free - 1,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
    }

    /// Gives back a slot taken with [`Slots::try_take`] or [`Slots::take`].
    fn give(&self) {
        self.free.fetch_add(1, Ordering::SeqCst);
        // Either a waiter sees the slot when it checks after registering, or it registered
        // before this load and is woken (a wake-up with nobody listening is kept by `Notify`).
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.freed.notify_one();
        }
    }

    /// Waits for a slot and takes it. Dropping the future takes none.
    async fn take(&self) {
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::SeqCst);
            }
        }
        if self.try_take() {
            return;
        }
        self.waiters.fetch_add(1, Ordering::SeqCst);
        let _waiting = Waiting(&self.waiters);
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.try_take() {
                return;
            }
            freed.await;
        }
    }
}

/// A slot held by a handler running in its own task; given back when dropped.
struct Slot(Arc<Slots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.give();
    }
}

/// Serves `service` on every connection `listener` accepts until `shutdown` is triggered, then
/// drains: calls in flight finish and are answered, new ones are refused with
/// `ShuttingDown`, and this returns when every connection is closed.
pub async fn serve<L: Listener, S: Service>(
    mut listener: L,
    service: S,
    config: Config,
    shutdown: ShutdownHandle,
    stats: Arc<ServerStats>,
) {
    let service = Arc::new(service);
    let ctx = Ctx {
        handler_slots: Arc::new(Slots::new(config.max_concurrent_handlers)),
        config,
        shutdown: shutdown.token.clone(),
        shutting_down: shutdown.flag.clone(),
        stats,
    };
    let connections = TaskTracker::new();
    // one per connection served; taken when accepted, so the limit holds before anything is
    // read from a connection or reserved for it
    let conn_permits = Arc::new(tokio::sync::Semaphore::new(ctx.config.max_connections));
    loop {
        tokio::select! {
            biased;
            _ = ctx.shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(transport) => {
                    let span = tracing::info_span!("rpc_conn", service = S::NAME, peer = %transport.peer());
                    match conn_permits.clone().try_acquire_owned() {
                        Ok(permit) => {
                            connections.spawn(serve_connection(transport, service.clone(), ctx.clone(), permit).instrument(span));
                        }
                        Err(_) => {
                            connections.spawn(refuse_connection(transport, ctx.clone()).instrument(span));
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    if is_resource_exhaustion(&e) {
                        // Out of file descriptors or memory: give the system a moment instead
                        // of spinning on the same error.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            },
        }
    }
    drop(listener);
    tracing::info!("shutting down: draining connections");
    connections.close();
    connections.wait().await;
}

fn is_resource_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(23) | Some(24) | Some(12) | Some(105))
}

/// Handlers running in their own task, by request id (only those can be cancelled).
type Calls = Arc<Mutex<IdMap<AbortHandle>>>;
type Outcome = Result<Result<Reply, ServerError>, Box<dyn Any + Send>>;

/// The future of one call to a service (see [`handler_future`]).
async fn handler_future<S: Service>(
    service: Arc<S>,
    method: u32,
    request: Request,
    memory: Option<Arc<dyn PayloadMemory>>,
) -> Result<Reply, ServerError> {
    Lending {
        memory,
        work: service.dispatch(method, request),
    }
    .await
}

thread_local! {
    /// The memory of the connection whose request the handler being polled on this thread
    /// serves (see [`Lending`]), for [`payload_mut`].
    static LENDER: Cell<Option<Arc<dyn PayloadMemory>>> = const { Cell::new(None) };
}

/// A handler's future with its connection's memory lent to [`payload_mut`] while it is polled:
/// the memory is put in [`LENDER`] for each poll and taken back after it (a panic included),
/// so code that runs outside a handler's poll, a task the handler spawned included, sees
/// whatever was there before (nothing, outside every handler).
///
/// What `tokio::task_local!`'s scope does, in less: a `Cell` swapped in and out, where the
/// task-local took a `RefCell` borrow, its access errors and a guard generic over the value,
/// ~160 distinct instructions on a server's small call (callgrind, rxe, 2026-12-05).
#[pin_project::pin_project]
struct Lending<F> {
    /// the memory, while the handler is not being polled
    memory: Option<Arc<dyn PayloadMemory>>,
    #[pin]
    work: F,
}

impl<F: Future> Future for Lending<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _lent = Lent::enter(this.memory);
        this.work.poll(cx)
    }
}

/// Memory lent to [`LENDER`] for one poll (see [`Lending`]); taken back when dropped.
struct Lent<'a> {
    /// where the memory goes back to
    home: &'a mut Option<Arc<dyn PayloadMemory>>,
    /// what `LENDER` held before, put back then
    before: Option<Arc<dyn PayloadMemory>>,
}

impl<'a> Lent<'a> {
    fn enter(home: &'a mut Option<Arc<dyn PayloadMemory>>) -> Lent<'a> {
        let before = LENDER.with(|l| l.replace(home.take()));
        Lent { home, before }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let before = self.before.take();
        // (`try_with`: a thread being torn down has no `LENDER` any more; the memory is then
        // dropped with it)
        if let Ok(memory) = LENDER.try_with(|l| l.replace(before)) {
            *self.home = memory;
        }
    }
}

/// In a handler, a buffer of `len` bytes to fill in place and return as a
/// [`Payload`](crate::Payload) ([`PayloadMut::freeze`]) without a copy: lent by the connection the request
/// came on, where its transport has such memory (RDMA: a registered buffer the client then
/// reads from where it is). Elsewhere (over TCP, outside a handler or in a task the handler
/// spawned, or with no buffer free), zeroed heap memory. A lent buffer's bytes are not
/// zeroed: write all of them. The client can read the region it comes from (that is how it
/// takes the answer): fill it only with what you answer that client.
pub fn payload_mut(len: usize) -> PayloadMut {
    let lent = LENDER
        .try_with(|l| {
            // taken out and put back: a `Cell` lends no reference (`lend` does not reach
            // `LENDER`: it is the transport's memory)
            let memory = l.take();
            let lent = memory.as_ref().and_then(|m| m.lend(len));
            l.set(memory);
            lent
        })
        .ok()
        .flatten();
    lent.unwrap_or_else(|| PayloadMut::zeroed(len))
}

/// A handler future in a reusable box: the connection keeps one box and runs each handler's
/// first poll in it; only a handler that has to wait takes the box away (with it into its own
/// task), and the connection gets a new one. Handlers that answer at once allocate nothing.
struct Inline<F>(Pin<Box<Option<F>>>);

impl<F: Future> Future for Inline<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let work = this.0.as_mut().as_pin_mut().expect("a handler in the box");
        let out = work.poll(cx);
        if out.is_ready() {
            this.0.set(None);
        }
        out
    }
}

/// Requests read in one turn from which a server on a transport that coalesces writes
/// ([`Transport::coalesce_writes`]) yields once for more before it flushes the answers.
///
/// Measured on TCP loopback (2026-11-30, `calls`, 2-worker runtime, best two of four runs):
/// with 64 calls in flight on one connection, a threshold of 2 or 8 gave 3-6% more calls/s
/// than no yield; with 64 over 8 connections (8 each, so bunches of up to 8), 2 cost 10% and
/// 8 nothing. Over RDMA the same yield cost a third of the 64-in-flight throughput, so it is
/// off there.
const BUNCH: usize = 8;

/// What became of a request handled by [`Conn::start_request`].
enum Step {
    /// Answered at once: send this.
    Answer(Message),
    /// Running in its own task, which answers through the outbox.
    Spawned,
    /// Not on the fast path (shutdown, unknown method, duplicate id or no free handler
    /// slot): see [`Conn::on_request`].
    Slow(Message),
}

/// What to do after a frame.
#[derive(PartialEq, Eq)]
enum Flow {
    Continue,
    Close,
}

/// One connection's state, driven by a single task that reads, runs handlers that finish on
/// their first poll inline, and writes everything it produced with one flush. Handlers that
/// have to wait get their own task and send their answer through `outbox`.
struct Conn<S, W, H, F> {
    service: Arc<S>,
    /// Makes a handler future (`handler_future::<S>`; a parameter so that `F` can be named).
    make: H,
    /// The box the next handler's first poll runs in (always `None` between requests).
    inline: Pin<Box<Option<F>>>,
    ctx: Ctx,
    writer: W,
    /// Answers of handlers that ran in their own task, waiting to be written.
    answers: mpsc::UnboundedReceiver<Message>,
    /// Whether a handler has ever run in its own task here: until one has, `answers` stays
    /// empty and the connection task does not poll it (an empty poll of tokio's channel, with
    /// its waker registration, cost ~650 instructions per turn: callgrind, small calls over
    /// RDMA, 2026-12-01).
    spawned: bool,
    /// Handlers that run in tasks of their own.
    running: Handlers,
    draining: bool,
    /// The connection's memory for payloads it sends without a copy, lent to its handlers.
    memory: Option<Arc<dyn PayloadMemory>>,
    /// The run-to-completion path, where the transport has one.
    fast: Option<Arc<FastPath<S, H, F>>>,
}

impl<S, W, H, F> Conn<S, W, H, F>
where
    S: Service,
    W: Sink<Message, Error = io::Error> + Unpin,
    H: Fn(Arc<S>, u32, Request, Option<Arc<dyn PayloadMemory>>) -> F,
    F: Future<Output = Result<Reply, ServerError>> + Send + 'static,
{
    async fn send(&mut self, msg: Message) -> io::Result<()> {
        self.writer.feed(msg).await
    }

    async fn refuse(&mut self, id: u64, kind: ServerErrorKind, message: &str) -> io::Result<()> {
        self.send(error_message(id, kind, message)).await
    }

    /// Starts draining if shutdown was triggered (idempotent): no new calls on this
    /// connection, the client is told with a go-away frame.
    async fn check_shutdown(&mut self) -> io::Result<()> {
        if !self.draining && self.ctx.shutting_down.load(Ordering::SeqCst) {
            self.draining = true;
            // from here on every request comes here (and is refused)
            if let Some(fast) = &self.fast {
                fast.close();
            }
            self.running.tracker.close();
            self.send(Message::control(Kind::GoAway, 0)).await?;
        }
        Ok(())
    }

    async fn on_frame(&mut self, msg: Message) -> io::Result<Flow> {
        let id = msg.header.id;
        match msg.header.kind {
            Kind::Request => match self.start_request(msg) {
                Step::Answer(answer) => self.send(answer).await?,
                Step::Spawned => {}
                // Boxed: keeps this future (moved on every frame) small.
                Step::Slow(msg) => return Box::pin(self.on_request(msg)).await,
            },
            Kind::Cancel => {
                if let Some(h) = self.running.calls.lock().remove(&id) {
                    tracing::debug!(id, "call cancelled by the client");
                    h.abort();
                }
            }
            Kind::Ping => self.send(Message::control(Kind::Pong, id)).await?,
            Kind::Pong => {}
            // Greeting without credentials required: accept it.
            Kind::Hello => self.send(Message::control(Kind::Hello, 0)).await?,
            Kind::Response | Kind::GoAway => {
                tracing::warn!(kind = %msg.header.kind, "client sent a server-only frame; closing");
                return Ok(Flow::Close);
            }
        }
        Ok(Flow::Continue)
    }

    /// The fast path of a request: no shutdown, a known method, a new id and a free handler
    /// slot, checked without waiting; anything else is left to [`Conn::on_request`].
    fn start_request(&mut self, msg: Message) -> Step {
        let (id, method) = (msg.header.id, msg.header.method);
        // Shutdown may have started while this task was busy with earlier frames.
        if self.draining || self.ctx.shutting_down.load(Ordering::Relaxed) {
            return Step::Slow(msg);
        }
        let Some(name) = self.service.method_name(method) else {
            return Step::Slow(msg);
        };
        if self.running.has(id) {
            return Step::Slow(msg);
        }
        if !self.ctx.handler_slots.try_take() {
            return Step::Slow(msg);
        }
        // The deadline counts from when the request was read.
        let deadline = deadline_of(&msg.header);
        match self.run(id, method, name, msg, deadline) {
            Some(answer) => Step::Answer(answer),
            None => Step::Spawned,
        }
    }

    /// Every request that is not on the fast path: refusals, and the wait for a free handler
    /// slot.
    async fn on_request(&mut self, msg: Message) -> io::Result<Flow> {
        let id = msg.header.id;
        let method = msg.header.method;
        self.check_shutdown().await?;
        if self.draining {
            self.refuse(
                id,
                ServerErrorKind::ShuttingDown,
                "the server is shutting down",
            )
            .await?;
            return Ok(Flow::Continue);
        }
        let Some(name) = self.service.method_name(method) else {
            tracing::warn!(
                id,
                method = format_args!("{method:#010x}"),
                "unknown method"
            );
            let text = format!("{} serves no method with id {method:#010x}", S::NAME);
            self.refuse(id, ServerErrorKind::UnknownMethod, &text)
                .await?;
            return Ok(Flow::Continue);
        };
        if self.running.calls.lock().contains_key(&id) {
            tracing::warn!(id, "duplicate request id from client");
            let text = "a call with this request id is already running";
            self.refuse(id, ServerErrorKind::BadRequest, text).await?;
            return Ok(Flow::Continue);
        }
        // The deadline counts from when the request was read, so the wait for a slot below
        // counts against it.
        let deadline = deadline_of(&msg.header);
        // Over the concurrency limit this waits, and the connection is not read meanwhile.
        self.wait_for_slot().await?;
        // A slot is taken from here on: `run` or the refusal gives it back.
        if deadline.is_some_and(|d| d <= Instant::now()) {
            // The caller has given up: spend no handler on it.
            self.ctx.handler_slots.give();
            let text = format!("{name} waited for a free handler past the caller's deadline");
            self.refuse(id, ServerErrorKind::DeadlineExceeded, &text)
                .await?;
            return Ok(Flow::Continue);
        }
        if let Some(answer) = self.run(id, method, name, msg, deadline) {
            self.send(answer).await?;
        }
        Ok(Flow::Continue)
    }

    /// Runs request `msg`'s handler, holding a handler slot already taken (see
    /// [`first_poll`]); `None` if it went on in a task of its own.
    fn run(
        &mut self,
        id: u64,
        method: u32,
        name: &'static str,
        msg: Message,
        deadline: Option<Instant>,
    ) -> Option<Message> {
        let request = Request::new(msg.body, msg.attachments);
        let work = (self.make)(self.service.clone(), method, request, self.memory.clone());
        let call = Call {
            id,
            name,
            deadline,
            max_attachments: self.ctx.config.max_attachments,
        };
        let answer = first_poll(
            &mut self.inline,
            work,
            &self.ctx.handler_slots,
            &self.running,
            call,
        );
        self.spawned |= answer.is_none();
        answer
    }

    /// Waits for a handler slot and takes it. While waiting, answers of this connection's
    /// finished handlers are still written: holding them back until a slot frees would add
    /// up to a whole queue's wait to calls that are already done.
    ///
    /// The connection is not read meanwhile (that is the back-pressure), so the client's
    /// keep-alive pings go unanswered; the server pings it instead, once per keep-alive
    /// interval, so that a client whose calls wait longer than its keep-alive timeout does not
    /// take a busy server for a dead one and close a connection that will be served. (The
    /// server does not judge the client's silence while it is not reading it.)
    async fn wait_for_slot(&mut self) -> io::Result<()> {
        let slots = self.ctx.handler_slots.clone();
        let acquire = slots.take();
        tokio::pin!(acquire);
        let period = self.ctx.config.keepalive_interval;
        let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = &mut acquire => return Ok(()),
                Some(answer) = self.answers.recv() => {
                    self.send(answer).await?;
                    while let Ok(answer) = self.answers.try_recv() {
                        self.send(answer).await?;
                    }
                    self.flush().await?;
                }
                _ = ping.tick() => {
                    self.send(Message::control(Kind::Ping, 0)).await?;
                    self.flush().await?;
                }
            }
        }
    }

    async fn flush(&mut self) -> io::Result<()> {
        // Usually the socket takes everything at once: then no timer is needed. (A pending
        // flush registered a no-op waker; the poll below registers the task's.)
        if let Some(r) = self.writer.flush().now_or_never() {
            return r;
        }
        let limit = self.ctx.config.keepalive_timeout;
        match tokio::time::timeout(limit, self.writer.flush()).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client has not read its answers for the keep-alive timeout",
            )),
        }
    }
}

/// Where a handler that has to wait goes: its own task, tracked with the connection's others
/// (`tracker`), cancellable through `calls`, answering through `outbox`. The connection task
/// and its run-to-completion path share one (cloned).
#[derive(Clone)]
struct Handlers {
    calls: Calls,
    outbox: Outbox,
    stats: Arc<ServerStats>,
    tracker: TaskTracker,
}

impl Handlers {
    /// Whether call `id` has a handler running in a task of its own (a duplicate request id).
    /// Only those are in `calls`; with none running there is no lock to take.
    #[inline]
    fn has(&self, id: u64) -> bool {
        !self.tracker.is_empty() && self.calls.lock().contains_key(&id)
    }

    fn spawn<F>(&self, work: Inline<F>, call: Call, slot: Slot)
    where
        F: Future<Output = Result<Reply, ServerError>> + Send + 'static,
    {
        let Call {
            id,
            name,
            deadline,
            max_attachments,
        } = call;
        let task = run_call(
            work,
            name,
            deadline,
            max_attachments,
            id,
            self.calls.clone(),
            self.outbox.clone(),
            slot,
            self.stats.clone(),
        );
        // The task removes itself from `calls` under this lock, so it cannot finish before
        // its abort handle is in the table.
        let mut table = self.calls.lock();
        let span = tracing::debug_span!("handler", method = name, id);
        let handle = self.tracker.spawn(task.instrument(span));
        table.insert(id, handle.abort_handle());
    }
}

/// A request being run: its id, its method's name and its caller's deadline, and the most
/// payloads its answer may carry (see [`reply_message`]).
struct Call {
    id: u64,
    name: &'static str,
    deadline: Option<Instant>,
    max_attachments: u16,
}

/// Runs a handler's first poll in the reusable box `inline`, holding a handler slot already
/// taken from `slots`, so that a handler that needs no I/O answers without a task or a
/// wake-up: its answer is returned and the slot given back. One that has to wait takes the
/// box with it into a task of its own (`to`), keeping the slot, and this returns `None`.
fn first_poll<F>(
    inline: &mut Pin<Box<Option<F>>>,
    work: F,
    slots: &Arc<Slots>,
    to: &Handlers,
    call: Call,
) -> Option<Message>
where
    F: Future<Output = Result<Reply, ServerError>> + Send + 'static,
{
    inline.set(Some(work));
    let first = {
        let mut cx = Context::from_waker(Waker::noop());
        let work = inline.as_mut().as_pin_mut().expect("just set");
        std::panic::catch_unwind(AssertUnwindSafe(|| work.poll(&mut cx)))
    };
    let outcome: Outcome = match first {
        // (the finished future, `handler_future`'s, which holds nothing once finished, is
        // dropped by the next request's `set`, off the path from this request to its answer)
        Ok(Poll::Ready(r)) => Ok(r),
        Err(panic) => {
            inline.set(None);
            Err(panic)
        }
        Ok(Poll::Pending) => {
            let work = Inline(std::mem::replace(inline, Box::pin(None)));
            to.spawn(work, call, Slot(slots.clone()));
            return None;
        }
    };
    slots.give();
    Some(reply_message(
        call.id,
        call.name,
        outcome,
        call.max_attachments,
    ))
}

/// A connection's run-to-completion path, on transports that receive in a task of their own
/// and can send from there ([`Transport::direct_send`]): the transport offers it each request
/// where it finds it (RDMA: the task that polled the completion queue), and when the link is
/// idle it runs the handler's first poll there and sends the answer itself. The connection's
/// task is then not woken at all for a call; it still handles everything else (other frames,
/// requests given back, handlers that wait, shutdown).
///
/// Measured in the guest (small calls over RDMA, 2026-12-01): callgrind counts 6,045
/// instructions per call on the server against 10,137 through the connection task (event
/// mode, rxe; that includes a wake-up less per call); busy-poll p50 over 10 alternated rounds,
/// 53.8 against 57.2 µs on rxe and 106.1 against 115.8 µs on siw.
struct FastPath<S, H, F> {
    service: Arc<S>,
    make: H,
    ctx: Ctx,
    running: Handlers,
    memory: Option<Arc<dyn PayloadMemory>>,
    sender: Arc<dyn DirectSend>,
    /// requests taken here (the connection's keep-alive counts them as traffic)
    taken: Arc<AtomicU64>,
    /// the connection's span, entered around the handlers run here
    span: tracing::Span,
    /// Held for the whole of a request taken here, answer sent or queued included: the
    /// connection task closes it before it drains or ends, so that nothing taken here is
    /// left behind (an answer queued after its last look at `outbox`, a handler spawned after
    /// it waited for them).
    gate: Mutex<Gate<F>>,
}

struct Gate<F> {
    open: bool,
    /// the box a handler's first poll runs in (`None` between requests)
    inline: Pin<Box<Option<F>>>,
}

impl<S, H, F> FastPath<S, H, F>
where
    S: Service,
    H: Fn(Arc<S>, u32, Request, Option<Arc<dyn PayloadMemory>>) -> F + Send + Sync + 'static,
    F: Future<Output = Result<Reply, ServerError>> + Send + 'static,
{
    /// Takes `msg` if it is a request that can be run here now; gives it back if not (it then
    /// goes to the connection task, which refuses or waits as its case needs).
    fn take(&self, msg: Message) -> Option<Message> {
        let Some((gate, name)) = self.admit(&msg.header) else {
            return Some(msg);
        };
        let request = Request::new(msg.body, msg.attachments);
        self.run(gate, &msg.header, name, request);
        None
    }

    /// [`take`](Self::take) for a request the transport lends borrowed: what the handler
    /// keeps of it (body, attachments) is copied out through the transport.
    fn take_lent(&self, lent: &mut dyn LentFrame) -> bool {
        let header = lent.frame().header;
        let Some((gate, name)) = self.admit(&header) else {
            return false;
        };
        if !lent.accept() {
            self.ctx.handler_slots.give();
            return false;
        }
        let (body, attachments) = lent.own();
        self.run(gate, &header, name, Request::new(body, attachments));
        true
    }

    /// Whether a request of `header` can be run here now: if so, it holds a handler slot and
    /// the gate (returned, with the method's name) until it is answered or handed to a task.
    fn admit(
        &self,
        header: &Header,
    ) -> Option<(parking_lot::MutexGuard<'_, Gate<F>>, &'static str)> {
        if header.kind != Kind::Request {
            return None;
        }
        let gate = self.gate.lock();
        if !gate.open || self.ctx.shutting_down.load(Ordering::Relaxed) || !self.sender.ready() {
            return None;
        }
        let name = self.service.method_name(header.method)?;
        if self.running.has(header.id) || !self.ctx.handler_slots.try_take() {
            return None;
        }
        Some((gate, name))
    }

    /// Runs an admitted request (see [`admit`](Self::admit)) to its first poll, and answers
    /// it if that finished it.
    fn run(
        &self,
        mut gate: parking_lot::MutexGuard<'_, Gate<F>>,
        header: &Header,
        name: &'static str,
        request: Request,
    ) {
        let (id, method) = (header.id, header.method);
        self.taken.fetch_add(1, Ordering::Relaxed);
        let deadline = deadline_of(header);
        let _entered = self.span.enter();
        let work = (self.make)(self.service.clone(), method, request, self.memory.clone());
        let call = Call {
            id,
            name,
            deadline,
            max_attachments: self.ctx.config.max_attachments,
        };
        let Some(answer) = first_poll(
            &mut gate.inline,
            work,
            &self.ctx.handler_slots,
            &self.running,
            call,
        ) else {
            return;
        };
        if !self.sender.try_send(&answer) {
            // the link got busy meanwhile: through the connection task's writer
            let _ = self.running.outbox.send(answer);
        }
    }
}

impl<S, H, F> FastPath<S, H, F> {
    /// Takes no more requests; waits for one being taken now to be done.
    fn close(&self) {
        self.gate.lock().open = false;
    }
}

/// Serves one connection until the peer goes away or the server has drained.
/// Answers a connection over `max_connections` with an `Overloaded` error before its greeting
/// is read, and closes it once the greeting (or the end of the stream) is in.
async fn refuse_connection<T: Transport>(transport: T, ctx: Ctx) {
    let limit = ctx.config.connect_timeout;
    let max = ctx.config.max_connections;
    tracing::warn!(
        max,
        "connection refused: the server is at its connection limit"
    );
    let Ok(Ok(transport)) = tokio::time::timeout(limit, transport.establish()).await else {
        return;
    };
    let (mut reader, mut writer) = transport.split();
    let refusal = error_message(
        0,
        ServerErrorKind::Overloaded,
        &format!("the server is at its limit of {max} connections"),
    );
    let _ = tokio::time::timeout(limit, async {
        writer.send(refusal).await?;
        // Close only once the client's greeting (or its end) is in: closing earlier makes
        // TCP reset the connection over the unread greeting, which can destroy the refusal
        // on its way, and makes an RDMA client's greeting fail before it reads the refusal.
        let _ = reader.next().await;
        writer.close().await
    })
    .await;
}

async fn serve_connection<T: Transport, S: Service>(
    transport: T,
    service: Arc<S>,
    ctx: Ctx,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let transport =
        match tokio::time::timeout(ctx.config.connect_timeout, transport.establish()).await {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "connection set-up failed");
                return;
            }
            Err(_) => {
                tracing::warn!("connection set-up timed out");
                return;
            }
        };
    ctx.stats.connections.fetch_add(1, Relaxed);
    tracing::debug!("connection open");
    let memory = transport.payload_memory();
    let coalesce = transport.coalesce_writes();
    let direct = transport
        .direct_send()
        .and_then(|sender| Some((transport.response_shortcut()?, sender)));
    let (mut reader, writer) = transport.split();
    let (outbox, answers) = mpsc::unbounded_channel();
    let mut keepalive = KeepAlive::new(ctx.config.keepalive_interval, ctx.config.keepalive_timeout);
    let mut writer = writer;
    if let Some(token) = &ctx.config.auth_token {
        if !authenticate(&mut reader, &mut writer, token, &ctx.config).await {
            drop(permit);
            ctx.stats.connections.fetch_sub(1, Relaxed);
            return;
        }
    }
    let running = Handlers {
        calls: Arc::default(),
        outbox,
        stats: ctx.stats.clone(),
        tracker: TaskTracker::new(),
    };
    let mut conn = Conn {
        service,
        make: handler_future::<S>,
        inline: Box::pin(None),
        ctx,
        writer,
        answers,
        spawned: false,
        running,
        draining: false,
        memory,
        fast: None,
    };
    if let Some((shortcut, sender)) = direct {
        let taken = Arc::new(AtomicU64::new(0));
        keepalive.count_also(taken.clone());
        let fast = Arc::new(FastPath {
            service: conn.service.clone(),
            make: conn.make,
            ctx: conn.ctx.clone(),
            running: conn.running.clone(),
            memory: conn.memory.clone(),
            sender,
            taken,
            span: tracing::Span::current(),
            gate: Mutex::new(Gate {
                open: true,
                inline: Box::pin(None),
            }),
        });
        let weak = Arc::downgrade(&fast);
        let installed = shortcut.install(Box::new(move |msg| match weak.upgrade() {
            Some(fast) => fast.take(msg),
            None => Some(msg),
        }));
        let weak = Arc::downgrade(&fast);
        let installed = installed
            && shortcut.install_frames(Box::new(move |lent| {
                weak.upgrade().is_some_and(|fast| fast.take_lent(lent))
            }));
        if installed {
            // handlers spawned there answer through `answers`: always look at it
            conn.spawned = true;
            conn.fast = Some(fast);
        }
    }
    // The shutdown future is made and registered (with this task's waker) once, and polled
    // again only once the flag says shutdown has started: a new `cancelled()` future every
    // turn registered with the token and unregistered again, and even a standing one takes
    // the token's lock on every poll (~350 instructions per turn, 3% of the server's work
    // for a small call over RDMA). The flag is read inside the branch's future, not in a
    // precondition: `select!` evaluates those once, so a connection idle when shutdown began
    // was woken by the token, found the branch disabled, and noticed only at its next
    // keep-alive tick (5 s later by default).
    let shutdown = conn.ctx.shutdown.clone();
    let shutdown = shutdown.cancelled();
    tokio::pin!(shutdown);
    let started = conn.ctx.shutting_down.clone();
    let result: io::Result<()> = async {
        // (ready at once if shutdown has already started: the flag then says so)
        let _ = futures::poll!(&mut shutdown);
        loop {
            let shutdown_began = std::future::poll_fn(|cx| {
                if started.load(Ordering::SeqCst) {
                    shutdown.as_mut().poll(cx)
                } else {
                    Poll::Pending
                }
            });
            let flow = tokio::select! {
                biased;
                () = shutdown_began, if !conn.draining => {
                    conn.check_shutdown().await?;
                    Flow::Continue
                }
                _ = conn.running.tracker.wait(), if conn.draining => {
                    // Every handler has queued its answer before its task ended.
                    while let Ok(answer) = conn.answers.try_recv() {
                        conn.send(answer).await?;
                    }
                    tracing::debug!("drained");
                    Flow::Close
                }
                Some(answer) = conn.answers.recv(), if conn.spawned => {
                    conn.send(answer).await?;
                    while let Ok(answer) = conn.answers.try_recv() {
                        conn.send(answer).await?;
                    }
                    Flow::Continue
                }
                next = reader.next() => {
                    let mut next = Some(next);
                    // frames read in this turn, and whether it yielded once for more
                    let mut frames = 0usize;
                    let mut yielded = false;
                    let mut flow = Flow::Continue;
                    // Take every frame already received before flushing once.
                    while let Some(frame) = next.take() {
                        flow = match frame {
                            Some(Ok(msg)) => {
                                keepalive.saw_frame();
                                frames += 1;
                                if msg.header.kind == Kind::Request {
                                    // The common case without an `on_frame` future.
                                    match conn.start_request(msg) {
                                        Step::Answer(answer) => conn.send(answer).await?,
                                        Step::Spawned => {}
                                        Step::Slow(msg) => {
                                            Box::pin(conn.on_request(msg)).await?;
                                        }
                                    }
                                    Flow::Continue
                                } else {
                                    conn.on_frame(msg).await?
                                }
                            }
                            Some(Err(e)) => {
                                if let Some(FrameError::TooLarge { kind: Kind::Request, id, len, limit }) = FrameError::from_io(&e) {
                                    let text = format!("request of {len} bytes exceeds the server's limit of {limit} bytes");
                                    conn.refuse(*id, ServerErrorKind::TooLarge, &text).await?;
                                }
                                if e.kind() == io::ErrorKind::InvalidData {
                                    tracing::warn!(error = %e, "unreadable frame; closing the connection");
                                } else {
                                    // the connection broke (reset, a failed transfer): no
                                    // fault of the frames
                                    tracing::info!(error = %e, "connection failed; closing it");
                                }
                                Flow::Close
                            }
                            None => Flow::Close,
                        };
                        if flow == Flow::Close {
                            break;
                        }
                        next = reader.next().now_or_never();
                        if next.is_none()
                            && flow == Flow::Continue
                            && coalesce
                            && frames >= BUNCH
                            && !yielded
                        {
                            // Requests came in a bunch: the client has many calls in
                            // flight, and the rest of its bunch is likely being written. Let
                            // the runtime's other tasks run (and its I/O driver look) once
                            // before answering, so that they are read and answered with one
                            // flush (see `BUNCH`). A lone call never waits.
                            yielded = true;
                            tokio::task::yield_now().await;
                            next = reader.next().now_or_never();
                        }
                    }
                    flow
                }
                tick = keepalive.tick() => match tick {
                    Tick::Alive => Flow::Continue,
                    Tick::Ping => {
                        conn.send(Message::control(Kind::Ping, 0)).await?;
                        Flow::Continue
                    }
                    Tick::Dead(silent) => {
                        tracing::warn!(?silent, "client stopped answering keep-alives; closing");
                        Flow::Close
                    }
                },
            };
            conn.flush().await?;
            if flow == Flow::Close {
                return Ok(());
            }
        }
    }
    .await;
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection failed");
    }
    if let Some(fast) = conn.fast.take() {
        fast.close();
    }
    // The peer is gone or we are done: stop whatever still runs for it.
    let left: Vec<AbortHandle> = conn.running.calls.lock().drain().map(|(_, h)| h).collect();
    if !left.is_empty() {
        tracing::debug!(calls = left.len(), "aborting calls of a closed connection");
    }
    for h in left {
        h.abort();
    }
    conn.running.tracker.close();
    conn.running.tracker.wait().await;
    let limit = conn.ctx.config.keepalive_timeout;
    let _ = tokio::time::timeout(limit, conn.writer.close()).await;
    // the place is free before the count says so
    drop(permit);
    conn.ctx.stats.connections.fetch_sub(1, Relaxed);
    tracing::debug!("connection closed");
}

/// Waits for the client's greeting and checks its token; answers with a greeting, or with an
/// `Unauthenticated` error before closing. No handler runs for a connection that fails.
async fn authenticate<R, W>(reader: &mut R, writer: &mut W, token: &Secret, config: &Config) -> bool
where
    R: futures::Stream<Item = io::Result<Message>> + Unpin,
    W: Sink<Message, Error = io::Error> + Unpin,
{
    let first = tokio::time::timeout(config.connect_timeout, reader.next()).await;
    let accepted =
        matches!(&first, Ok(Some(Ok(m))) if m.header.kind == Kind::Hello && token.matches(&m.body));
    let limit = config.connect_timeout;
    if accepted {
        return tokio::time::timeout(limit, writer.send(Message::control(Kind::Hello, 0)))
            .await
            .is_ok_and(|r| r.is_ok());
    }
    let why = match first {
        Err(_) => "no greeting in time",
        Ok(Some(Ok(m))) if m.header.kind == Kind::Hello => "wrong token",
        Ok(Some(Ok(_))) => "no greeting before other frames",
        Ok(Some(Err(_))) | Ok(None) => "unreadable or no greeting",
    };
    tracing::warn!(reason = why, "peer failed authentication; dropping it");
    let refusal = error_message(0, ServerErrorKind::Unauthenticated, "authentication failed");
    let _ = tokio::time::timeout(limit, async {
        writer.send(refusal).await?;
        writer.close().await
    })
    .await;
    false
}

fn error_message(id: u64, kind: ServerErrorKind, message: &str) -> Message {
    Message {
        header: Header {
            kind: Kind::Response,
            flags: 0,
            id,
            method: 0,
            aux: kind.code(),
        },
        body: Bytes::copy_from_slice(message.as_bytes()),
        attachments: Attachments::new(),
    }
}

/// The response frame for a handler's outcome. A result with more payloads than
/// `max_attachments` (the most a peer with this server's configuration reads in one frame, and
/// never more than the wire's count can say) is answered with an `Internal` error instead:
/// the caller learns why, and its connection's other calls go on.
fn reply_message(id: u64, name: &'static str, outcome: Outcome, max_attachments: u16) -> Message {
    match outcome {
        Ok(Ok(reply)) if reply.attachments.len() > usize::from(max_attachments) => {
            let text = format!(
                "the result of {name} has {} payloads, more than the limit of {max_attachments}",
                reply.attachments.len()
            );
            tracing::error!(method = name, error = %text, "result not sent");
            error_message(id, ServerErrorKind::Internal, &text)
        }
        Ok(Ok(reply)) => Message {
            header: Header {
                kind: Kind::Response,
                flags: 0,
                id,
                method: 0,
                aux: 0,
            },
            body: reply.body,
            attachments: reply.attachments,
        },
        Ok(Err(e)) => {
            if e.kind == ServerErrorKind::BadRequest {
                tracing::warn!(method = name, error = %e.message, "bad request");
            }
            error_message(id, e.kind, &e.message)
        }
        Err(panic) => {
            let what = panic_message(&*panic);
            tracing::error!(method = name, panic = %what, "handler panicked");
            let text = format!("{name} panicked: {what}");
            error_message(id, ServerErrorKind::Panicked, &text)
        }
    }
}

/// When the caller of a request gives up: `aux` microseconds from now (0: never).
fn deadline_of(header: &Header) -> Option<Instant> {
    match header.aux {
        0 => None,
        us => Some(Instant::now() + Duration::from_micros(us as u64)),
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_call<F: Future<Output = Result<Reply, ServerError>>>(
    work: Inline<F>,
    name: &'static str,
    deadline: Option<Instant>,
    max_attachments: u16,
    id: u64,
    calls: Calls,
    outbox: Outbox,
    _slot: Slot,
    stats: Arc<ServerStats>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    stats.handlers.fetch_add(1, Relaxed);
    struct Count(Arc<ServerStats>);
    impl Drop for Count {
        fn drop(&mut self) {
            self.0.handlers.fetch_sub(1, Relaxed);
        }
    }
    let _count = Count(stats);
    let work = AssertUnwindSafe(work).catch_unwind();
    let outcome = match deadline {
        None => work.await,
        Some(d) => match tokio::time::timeout_at(d, work).await {
            Ok(r) => r,
            Err(_) => {
                tracing::debug!("deadline passed; dropped the handler");
                Ok(Err(ServerError::new(
                    ServerErrorKind::DeadlineExceeded,
                    format!("{name} did not finish before the caller's deadline"),
                )))
            }
        },
    };
    // Still in the table means nobody cancelled the call: answer it.
    if calls.lock().remove(&id).is_some() {
        let _ = outbox.send(reply_message(id, name, outcome, max_attachments));
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}

#[cfg(test)]
mod lending_tests {
    use super::*;
    use crate::payload::LentBuffer;
    use crate::Payload;

    /// A fake lender (in-process, no transport): lends zeroed buffers and counts them.
    struct Counting(AtomicUsize);

    struct Buf(Vec<u8>);

    impl LentBuffer for Buf {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0
        }
        fn freeze(self: Box<Self>) -> Payload {
            Payload::from(self.0)
        }
    }

    impl PayloadMemory for Counting {
        fn lend(&self, len: usize) -> Option<PayloadMut> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Some(PayloadMut::lent(Box::new(Buf(vec![0; len]))))
        }
    }

    fn memory() -> (Arc<Counting>, Option<Arc<dyn PayloadMemory>>) {
        let m = Arc::new(Counting(AtomicUsize::new(0)));
        let dynm: Arc<dyn PayloadMemory> = m.clone();
        (m, Some(dynm))
    }

    fn poll_once<F: Future>(f: Pin<&mut F>) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn memory_is_lent_only_while_its_handler_is_polled() {
        assert!(!payload_mut(4).is_lent(), "outside every handler: the heap");
        let (a, memory) = memory();
        let mut first = true;
        let mut work = std::pin::pin!(Lending {
            memory,
            work: std::future::poll_fn(|_| {
                assert!(
                    payload_mut(4).is_lent(),
                    "inside its poll: the connection's"
                );
                if std::mem::take(&mut first) {
                    Poll::Pending
                } else {
                    Poll::Ready(())
                }
            }),
        });
        assert!(poll_once(work.as_mut()).is_pending());
        assert!(!payload_mut(4).is_lent(), "between polls: the heap again");
        assert!(poll_once(work.as_mut()).is_ready());
        assert!(!payload_mut(4).is_lent());
        assert_eq!(a.0.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn an_inner_handler_lends_its_own_and_gives_the_outer_back() {
        let (a, outer) = memory();
        let (b, inner) = memory();
        let mut work = std::pin::pin!(Lending {
            memory: outer,
            work: async move {
                let _ = payload_mut(1);
                Lending {
                    memory: inner,
                    work: async { payload_mut(1).is_lent() },
                }
                .await;
                payload_mut(1).is_lent()
            },
        });
        assert_eq!(poll_once(work.as_mut()), Poll::Ready(true));
        assert_eq!(
            a.0.load(Ordering::SeqCst),
            2,
            "the outer lent before and after"
        );
        assert_eq!(b.0.load(Ordering::SeqCst), 1, "the inner lent once");
        assert!(!payload_mut(4).is_lent());
    }

    #[test]
    fn a_panicking_handler_leaves_nothing_lent() {
        let (a, memory) = memory();
        let mut work = Box::pin(Lending {
            memory,
            work: std::future::poll_fn(|_| -> Poll<()> { panic!("handler bug") }),
        });
        let got = std::panic::catch_unwind(AssertUnwindSafe(|| poll_once(work.as_mut())));
        assert!(got.is_err());
        assert!(!payload_mut(4).is_lent(), "the panic left the memory lent");
        assert!(work.memory.is_some(), "the memory went back to its handler");
        assert_eq!(a.0.load(Ordering::SeqCst), 0);
    }
}
