//! The caller's side of a connection: request ids, the table of calls in flight, credits,
//! deadlines and cancellation, over any [`Transport`].

use std::collections::VecDeque;
use std::fmt;
use std::future::{poll_fn, Future};
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::task::AtomicWaker;
use futures::{Sink, Stream, StreamExt};
use parking_lot::{Mutex, MutexGuard};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::codec::direct::{DecodeBody, EncodeBody, Serde};
use crate::codec::Codec;
use crate::conn::{KeepAlive, Tick};
use crate::payload::{PayloadMemory, PayloadMut};
use crate::permits::{Permit, Permits, TryAcquireError};
use crate::transport::{DirectSend, LentFrame, ResponseShortcut, Transport};
use crate::wire::{Attachments, Header, Kind, Message};
use crate::{Config, RpcError, ServerError, ServerErrorKind};

/// State shared by the call futures and the connection's reader and writer tasks.
///
/// Everything a call touches is behind one lock, taken once to send (register the call with
/// its waker and queue its frame) and once to collect the answer; the reader takes it once per
/// turn for every answer it read in that turn.
struct State {
    /// Shared (weakly) with the transport's [`ResponseShortcut`], if it has one.
    table: Arc<Mutex<Table>>,
    /// Responses taken through the shortcut since the keep-alive's last tick: traffic (see
    /// `KeepAlive::count_also`).
    shortcut_answers: Arc<AtomicU64>,
    credits: Permits,
    /// Cancelled when the connection is gone (for [`Client::closed`]).
    closed: CancellationToken,
    /// Set with `closed`; cheap to test on every turn of the reader.
    shut: AtomicBool,
    /// The server said it is draining (go-away): no new calls on this connection.
    going_away: AtomicBool,
    /// The reader task, woken when the connection is closed from this side.
    reader: AtomicWaker,
    /// The transport's writer, shared by the writer task and the caller of a lone call, who
    /// writes its own frame (see [`Table::writing`]).
    sink: Box<dyn FrameSink>,
    /// The transport's direct sender, if it has one: the caller of a lone call posts its frame
    /// through it when the link is idle, past the writer's machinery (see [`write_direct`]).
    direct: Option<Arc<dyn DirectSend>>,
}

/// The calls in flight and the frames waiting for the writer.
///
/// Calls live in reusable completion slots: a request id is a slot's index (low 32 bits) and
/// its generation (high 32 bits), so finding a call is an index, not a hash, and an answer
/// that comes after its call was cancelled finds a newer generation and is dropped.
struct Table {
    slots: Vec<Slot>,
    /// Indices of free slots.
    free: Vec<u32>,
    /// Calls sent and not yet answered.
    waiting: usize,
    /// Frames for the writer task, in order.
    outgoing: VecDeque<Message>,
    /// The writer task, when it waits for frames.
    writer: Option<Waker>,
    /// Someone (the writer task, or a caller writing its own frame) is using the sink; others
    /// queue their frames in `outgoing`.
    writing: bool,
    /// A caller's frame was handed to the sink but not yet flushed: the writer task finishes.
    flush_pending: bool,
    /// Set once the connection is gone; no call is registered after that.
    closed: bool,
}

struct Slot {
    generation: u32,
    state: SlotState,
}

enum SlotState {
    Free,
    /// Sent; the caller's waker once it has polled.
    Waiting(Option<Waker>),
    /// Answered (or failed), not yet collected.
    Done(Result<Message, RpcError>),
}

impl Table {
    fn new() -> Table {
        Table {
            slots: Vec::new(),
            free: Vec::new(),
            waiting: 0,
            outgoing: VecDeque::new(),
            writer: None,
            writing: false,
            flush_pending: false,
            closed: false,
        }
    }

    /// Takes a free slot for a new call, whose caller `waker` wakes; returns the call's
    /// request id.
    #[inline(always)]
    fn register(&mut self, waker: Waker) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(self.slots.len()).expect("fewer than 2^32 calls in flight");
                self.slots.push(Slot {
                    generation: 1,
                    state: SlotState::Free,
                });
                i
            }
        };
        let slot = &mut self.slots[index as usize];
        slot.state = SlotState::Waiting(Some(waker));
        self.waiting += 1;
        (u64::from(slot.generation) << 32) | u64::from(index)
    }

    /// The slot of call `id`, if it is still that call's.
    #[inline]
    fn slot(&mut self, id: u64) -> Option<&mut Slot> {
        let slot = self.slots.get_mut(id as u32 as usize)?;
        (slot.generation == (id >> 32) as u32).then_some(slot)
    }

    /// Frees call `id`'s slot for reuse, under a new generation.
    #[inline(always)]
    fn release(&mut self, id: u64) {
        let index = id as u32;
        let slot = &mut self.slots[index as usize];
        slot.state = SlotState::Free;
        slot.generation = match slot.generation.wrapping_add(1) {
            0 => 1,
            g => g,
        };
        self.free.push(index);
    }

    /// Frees call `id`'s slot after its caller took the answer itself, where the transport
    /// received it ([`DirectSend::progress_with`]).
    #[inline]
    fn taken(&mut self, id: u64) {
        let Some(slot) = self.slot(id) else { return };
        // (a connection closed meanwhile counted it out already)
        if matches!(slot.state, SlotState::Waiting(_)) {
            self.waiting -= 1;
        }
        self.release(id);
    }

    /// Records call `id`'s outcome; returns the waker to wake (outside the lock). An answer
    /// to a call no longer waiting (cancelled, timed out) is dropped.
    fn complete(&mut self, id: u64, outcome: Result<Message, RpcError>) -> Option<Waker> {
        let slot = self.slot(id)?;
        let SlotState::Waiting(waker) = &mut slot.state else {
            return None;
        };
        let waker = waker.take();
        slot.state = SlotState::Done(outcome);
        self.waiting -= 1;
        waker
    }

    /// Queues a frame for the writer; returns the writer's waker if it has to be woken.
    fn queue(&mut self, msg: Message) -> Option<Waker> {
        self.outgoing.push_back(msg);
        self.writer.take()
    }

    /// Whether the caller of the call just registered should write its frame itself: it is
    /// the only call in flight and the sink is idle. Claims the sink if so.
    ///
    /// That saves the hand-off to the writer task (a wake-up and a task switch) on an idle
    /// connection. With other calls in flight the frame goes to the writer task as before, so
    /// that frames share one write.
    fn claim_sink(&mut self) -> bool {
        let idle =
            self.waiting == 1 && !self.writing && !self.flush_pending && self.outgoing.is_empty();
        self.writing |= idle;
        idle
    }

    /// Gives the sink back after a caller's write; returns the writer's waker if it has
    /// something to do.
    fn release_sink(&mut self, unflushed: bool) -> Option<Waker> {
        self.writing = false;
        self.flush_pending |= unflushed;
        if self.flush_pending || self.closed || !self.outgoing.is_empty() {
            self.writer.take()
        } else {
            None
        }
    }
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock()
    }

    /// Queues a frame for the writer, unless the connection is gone.
    fn send(&self, msg: Message) {
        let writer = {
            let mut t = self.lock();
            if t.closed {
                return;
            }
            t.queue(msg)
        };
        if let Some(w) = writer {
            w.wake();
        }
    }

    /// Fails every call in flight and refuses new ones; the writer sends what is queued and
    /// closes, the reader stops. Idempotent.
    fn close(&self) {
        let (callers, writer) = {
            let mut t = self.lock();
            if t.closed {
                return;
            }
            t.closed = true;
            t.waiting = 0;
            let mut callers = Vec::new();
            for slot in &mut t.slots {
                if let SlotState::Waiting(w) = &mut slot.state {
                    callers.extend(w.take());
                    slot.state = SlotState::Done(Err(RpcError::ConnectionClosed));
                }
            }
            (callers, t.writer.take())
        };
        // Closed before any caller hears of it, so a failed call sees a closed client.
        self.shut.store(true, Ordering::Release);
        self.closed.cancel();
        self.credits.close();
        self.reader.wake();
        writer.into_iter().chain(callers).for_each(Waker::wake);
    }

    fn is_shut(&self) -> bool {
        self.shut.load(Ordering::Acquire)
    }
}

/// Held by every client handle and call future; when the last one goes, the connection closes.
struct Inner {
    state: Arc<State>,
    config: Config,
    peer: String,
    memory: Option<Arc<dyn PayloadMemory>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.state.close();
    }
}

/// A connection to a server, shared by cheap clones; many calls from many tasks run on it at
/// once and are answered out of order.
///
/// Generated clients (`FooClient`) wrap one. Calls beyond
/// [`Config::max_in_flight`] wait for a slot. Dropping a call's future cancels it: the server
/// is told and stops the handler.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
    timeout: Option<Duration>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("peer", &self.inner.peer)
            .field("timeout", &self.timeout)
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// The transport's ways past its reader and writer, taken before it is split.
struct Paths {
    shortcut: Option<ResponseShortcut>,
    direct: Option<Arc<dyn DirectSend>>,
}

impl Paths {
    fn of<T: Transport>(transport: &T) -> Paths {
        Paths {
            shortcut: transport.response_shortcut(),
            direct: transport.direct_send(),
        }
    }
}

impl Client {
    /// Starts the protocol over an established connection: spawns its reader and writer
    /// tasks on the current tokio runtime.
    ///
    /// This skips the greeting ([`Client::handshake`] does it), so it suits servers without
    /// an [`auth_token`](Config::auth_token), in-process transports and tests.
    pub fn new<T: Transport>(transport: T, config: Config) -> Client {
        let peer = transport.peer();
        let coalesce = transport.coalesce_writes();
        let memory = transport.payload_memory();
        let paths = Paths::of(&transport);
        let (reader, writer) = transport.split();
        Client::start(reader, writer, peer, config, coalesce, memory, paths)
    }

    /// Greets the server (presenting [`Config::auth_token`] if set), waits for its answer
    /// within [`Config::connect_timeout`], then starts the protocol as [`Client::new`] does.
    /// A server that refuses the credentials makes this fail with an `Unauthenticated`
    /// [`RpcError::Server`].
    pub async fn handshake<T: Transport>(transport: T, config: Config) -> Result<Client, RpcError> {
        use futures::{SinkExt, StreamExt};
        let peer = transport.peer();
        let coalesce = transport.coalesce_writes();
        let memory = transport.payload_memory();
        let paths = Paths::of(&transport);
        let (mut reader, mut writer) = transport.split();
        let token = config
            .auth_token
            .as_ref()
            .map(|t| bytes::Bytes::copy_from_slice(t.expose()))
            .unwrap_or_default();
        let hello = Message {
            header: Header::new(Kind::Hello, 0),
            body: token,
            attachments: Attachments::new(),
        };
        let greeting = async {
            // A server that refuses the connection may answer and close before the greeting
            // is out: then its answer, if it arrived, says more than the failed send.
            let sent = writer.send(hello).await;
            loop {
                match reader.next().await.transpose() {
                    // the server's keep-alive may ping before it has read our greeting
                    Ok(Some(m)) if sent.is_ok() && m.header.kind == Kind::Ping => {
                        writer
                            .send(Message::control(Kind::Pong, m.header.id))
                            .await?;
                    }
                    Ok(Some(m)) if sent.is_ok() && m.header.kind == Kind::Pong => {}
                    Ok(Some(answer)) => return Ok(Some(answer)),
                    other => return sent.and(other),
                }
            }
        };
        let answer = tokio::time::timeout(config.connect_timeout, greeting)
            .await
            .map_err(|_| {
                RpcError::Unavailable(format!(
                    "{peer}: no greeting from the server within {:?}",
                    config.connect_timeout
                ))
            })??;
        match answer {
            Some(m) if m.header.kind == Kind::Hello => Ok(Client::start(
                reader, writer, peer, config, coalesce, memory, paths,
            )),
            Some(m) if m.header.kind == Kind::Response && m.header.aux != 0 => {
                Err(RpcError::Server(ServerError::new(
                    ServerErrorKind::from_code(m.header.aux),
                    String::from_utf8_lossy(&m.body).into_owned(),
                )))
            }
            Some(m) => Err(RpcError::Protocol(format!(
                "expected the server's greeting, got a {} frame",
                m.header.kind
            ))),
            None => Err(RpcError::ConnectionClosed),
        }
    }

    fn start<R, W>(
        reader: R,
        writer: W,
        peer: String,
        config: Config,
        coalesce: bool,
        memory: Option<Arc<dyn PayloadMemory>>,
        paths: Paths,
    ) -> Client
    where
        R: Stream<Item = io::Result<Message>> + Send + Unpin + 'static,
        W: Sink<Message, Error = io::Error> + Send + Unpin + 'static,
    {
        let window = config.max_in_flight.min(Permits::MAX);
        let state = Arc::new(State {
            sink: Box::new(Mutex::new(Some(writer))),
            table: Arc::new(Mutex::new(Table::new())),
            shortcut_answers: Arc::new(AtomicU64::new(0)),
            credits: Permits::new(window),
            closed: CancellationToken::new(),
            shut: AtomicBool::new(false),
            going_away: AtomicBool::new(false),
            reader: AtomicWaker::new(),
            direct: paths.direct,
        });
        if let Some(shortcut) = paths.shortcut {
            let installed = shortcut.install(Box::new(take_response(
                Arc::downgrade(&state.table),
                Arc::clone(&state.shortcut_answers),
            )));
            debug_assert!(
                installed,
                "a transport's response shortcut serves one client"
            );
        }
        let span = tracing::info_span!("rpc_client", peer = %peer);
        tokio::spawn(write_loop(state.clone(), coalesce, window).instrument(span.clone()));
        tokio::spawn(read_loop(reader, state.clone(), config.clone()).instrument(span));
        Client {
            inner: Arc::new(Inner {
                state,
                config,
                peer,
                memory,
            }),
            timeout: None,
        }
    }

    /// A handle on the same connection whose calls fail with
    /// [`RpcError::DeadlineExceeded`] when no answer came within `timeout`. The deadline
    /// travels with each request; the server drops the work once it has passed.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        Client {
            inner: self.inner.clone(),
            timeout: Some(timeout),
        }
    }

    /// The timeout of this handle's calls, if any.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// A buffer of `len` bytes to fill in and send as a [`Payload`](crate::Payload)
    /// ([`PayloadMut::freeze`]): from the connection's registered memory where the transport
    /// has some (RDMA), so that a payload sent on this connection is not copied on the way
    /// out; else (TCP, or that memory all in use) zeroed heap memory. Its bytes are not
    /// zeroed when lent: write all of them.
    pub fn payload_mut(&self, len: usize) -> PayloadMut {
        self.inner
            .memory
            .as_ref()
            .and_then(|m| m.lend(len))
            .unwrap_or_else(|| PayloadMut::zeroed(len))
    }

    /// The server's address.
    pub fn peer(&self) -> &str {
        &self.inner.peer
    }

    /// The connection's configuration.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Whether the connection is gone (calls fail with [`RpcError::ConnectionClosed`]).
    pub fn is_closed(&self) -> bool {
        // the flag set with `closed` (the token's own test takes a lock: this is read on every
        // call through a reconnecting client)
        self.inner.state.is_shut()
    }

    /// Whether the server said it is shutting down (go-away): calls already sent are answered,
    /// new ones fail with [`RpcError::Unavailable`]; a caller that can should connect anew.
    pub fn is_going_away(&self) -> bool {
        self.inner.state.going_away.load(Ordering::Acquire)
    }

    /// Resolves when the connection is gone.
    pub fn closed(&self) -> impl Future<Output = ()> + Send + 'static {
        let token = self.inner.state.closed.clone();
        async move { token.cancelled().await }
    }

    /// Number of calls waiting for an answer.
    pub fn in_flight(&self) -> usize {
        self.inner.state.lock().waiting
    }

    /// Calls method `method` (named `name`, for errors and traces) with `args`, decoding the
    /// answer as `R`. Arguments are encoded before this returns, so the future does not
    /// borrow them.
    pub fn call<C, A, R>(
        &self,
        method: u32,
        name: &'static str,
        args: &A,
    ) -> impl Future<Output = Result<R, RpcError>> + Send + 'static
    where
        C: Codec,
        A: Serialize + ?Sized,
        R: DeserializeOwned + Send + 'static,
    {
        let deadline = self.timeout.map(|t| Instant::now() + t);
        self.send::<C, R>(Prepared::new::<C, A>(method, name, args), deadline)
    }

    /// Sends a call encoded beforehand with [`Prepared::new`], failing with
    /// [`RpcError::DeadlineExceeded`] at `deadline` (this handle's own timeout is not used).
    pub fn send<C, R>(
        &self,
        prepared: Result<Prepared, RpcError>,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<R, RpcError>> + Send + 'static
    where
        C: Codec,
        R: DeserializeOwned + Send + 'static,
    {
        self.send_via::<Serde<C>, R>(prepared, deadline)
    }

    /// As [`send`](Self::send), decoding the answer with `D` (see [`crate::codec::direct`]:
    /// generated clients pick the body path of each method's result there).
    pub fn send_via<D, R>(
        &self,
        prepared: Result<Prepared, RpcError>,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<R, RpcError>> + Send + 'static
    where
        D: DecodeBody<R> + 'static,
        R: Send + 'static,
    {
        // A span per call costs ~7% of a small call's instructions even when nothing listens:
        // make one only when debug tracing is on.
        let span = if tracing::enabled!(tracing::Level::DEBUG) {
            let name = prepared.as_ref().map_or("?", |p| p.name);
            tracing::debug_span!("call", method = name)
        } else {
            tracing::Span::none()
        };
        Call::<D, R> {
            inner: self.inner.clone(),
            unsent: Some(prepared.map(|p| p.msg)),
            credit_wait: None,
            credit: false,
            id: 0,
            done: false,
            spin: SpinState::default(),
            deadline,
            sleep: None,
            span,
            decode: PhantomData,
        }
    }
}

/// A call's encoded arguments, ready to send on any connection (so a client that reconnects
/// can encode before it knows which connection the call will take).
#[derive(Debug)]
pub struct Prepared {
    name: &'static str,
    msg: Message,
}

impl Prepared {
    /// Encodes `args` for method `method` (named `name`) with codec `C`, lifting payloads
    /// out into attachments.
    pub fn new<C: Codec, A: Serialize + ?Sized>(
        method: u32,
        name: &'static str,
        args: &A,
    ) -> Result<Prepared, RpcError> {
        Prepared::encode::<Serde<C>, A>(method, name, args)
    }

    /// As [`new`](Self::new), encoding `args` with `E` (see [`crate::codec::direct`]:
    /// generated clients pick the body path of each method's arguments there).
    pub fn encode<E: EncodeBody<A>, A: ?Sized>(
        method: u32,
        name: &'static str,
        args: &A,
    ) -> Result<Prepared, RpcError> {
        let (body, attachments) = E::encode(args).map_err(RpcError::Codec)?;
        Ok(Prepared {
            name,
            msg: Message {
                header: Header {
                    kind: Kind::Request,
                    flags: 0,
                    id: 0,
                    method,
                    aux: 0,
                },
                body,
                attachments,
            },
        })
    }

    /// The method's name.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// Waits for one of the connection's credits, until `deadline`.
async fn wait_for_credit(
    credits: &Permits,
    deadline: Option<Instant>,
) -> Result<Permit<'_>, RpcError> {
    let acquired = match deadline {
        Some(d) => tokio::time::timeout_at(d, credits.acquire())
            .await
            .map_err(|_| RpcError::DeadlineExceeded)?,
        None => credits.acquire().await,
    };
    acquired.map_err(|_| RpcError::ConnectionClosed)
}

/// A call's wait for a credit (see [`Call::credit_wait`]).
type CreditWait = Pin<Box<dyn Future<Output = Result<(), RpcError>> + Send>>;

/// The future of one call ([`Client::send`]): takes one of the connection's credits (or
/// waits for one, until the deadline), sends the call when first polled, then waits in the
/// call's slot for the answer, failing with `DeadlineExceeded` at the deadline, and decodes it
/// with `C` as an `R`. Dropped (or timed out) before the answer came, it frees the slot and
/// tells the server to stop the handler.
///
/// One named future for the whole call, rather than an `async` block around an inner future
/// and a tracing wrapper: it is built in place, holds no copy of the request beside its
/// state, and enters a span only when one was made (debug tracing on). docs/latency.md,
/// "A named call future", has the measurements.
///
/// A lone call's caller that receives for itself (see [`SpinState`]) decodes a small answer
/// where the transport received it, borrowed ([`DirectSend::progress_with`]): the answer then
/// never passes through the call's slot.
#[pin_project::pin_project(PinnedDrop, project = CallProj)]
struct Call<D, R> {
    inner: Arc<Inner>,
    /// The request (or why it could not be encoded), until the first poll with a credit
    /// sends it.
    unsent: Option<Result<Message, RpcError>>,
    /// Waits for a credit when none was free (boxed: rarely taken, and inline it would make
    /// every call's future larger).
    credit_wait: Option<CreditWait>,
    /// Holds one of the connection's credits, returned when the call ends.
    credit: bool,
    id: u64,
    /// Nothing left to undo on drop (answered, failed, cancelled, or never sent).
    done: bool,
    /// Whether, and since when, a lone call's caller receives for itself (see [`SpinState`]).
    spin: SpinState,
    deadline: Option<Instant>,
    /// The deadline's timer, made when the call is sent (inside the runtime).
    #[pin]
    sleep: Option<tokio::time::Sleep>,
    /// The call's span; `Span::none()` unless debug tracing was on.
    span: tracing::Span,
    decode: PhantomData<fn() -> (D, R)>,
}

impl<D: DecodeBody<R>, R> Future for Call<D, R> {
    type Output = Result<R, RpcError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if *this.done {
            panic!("a call's future polled after it completed");
        }
        let out = poll_call::<D, R>(&mut this, cx);
        if out.is_ready() {
            *this.done = true;
            if std::mem::take(this.credit) {
                this.inner.state.credits.release();
            }
        }
        out
    }
}

/// The whole of a call's poll but the returning of its credit when it ends ([`Call::poll`]).
fn poll_call<D: DecodeBody<R>, R>(
    this: &mut CallProj<'_, D, R>,
    cx: &mut Context<'_>,
) -> Poll<Result<R, RpcError>> {
    let _entered = (!this.span.is_none()).then(|| this.span.enter());
    let state = &*this.inner.state;
    // whether to look for the answer (and perhaps spin) in this poll: always but in the
    // first, where only a lone call (which wrote its own frame) may find it at once
    let mut look = true;
    // a lone call's caller that posted its request directly still holds the sink
    let mut sink_held = false;
    if this.unsent.is_some() {
        if !*this.credit && this.credit_wait.is_none() {
            // the first poll: a request that could not be encoded, is too large or carries
            // too many payloads fails here
            let (size, count) = match this.unsent.as_ref() {
                Some(Ok(msg)) => (msg.payload_len(), msg.attachments.len()),
                _ => {
                    let Some(Err(e)) = this.unsent.take() else {
                        unreachable!("matched above")
                    };
                    return Poll::Ready(Err(e));
                }
            };
            let limit = this.inner.config.max_message_size;
            if size > limit {
                *this.unsent = None;
                return Poll::Ready(Err(RpcError::TooLarge { size, limit }));
            }
            let most = this.inner.config.max_attachments;
            if count > usize::from(most) {
                *this.unsent = None;
                return Poll::Ready(Err(RpcError::TooManyAttachments { count, limit: most }));
            }
            // one of the connection's credits, held until the answer came
            match state.credits.try_acquire() {
                Ok(p) => {
                    p.forget();
                    *this.credit = true;
                }
                Err(TryAcquireError::Closed) => {
                    *this.unsent = None;
                    return Poll::Ready(Err(RpcError::ConnectionClosed));
                }
                Err(TryAcquireError::NoPermits) => {
                    let inner = Arc::clone(this.inner);
                    let deadline = *this.deadline;
                    *this.credit_wait = Some(Box::pin(async move {
                        wait_for_credit(&inner.state.credits, deadline)
                            .await
                            .map(Permit::forget)
                    }));
                }
            }
        }
        if let Some(wait) = this.credit_wait.as_mut() {
            let got = std::task::ready!(wait.as_mut().poll(cx));
            *this.credit_wait = None;
            if let Err(e) = got {
                *this.unsent = None;
                return Poll::Ready(Err(e));
            }
            *this.credit = true;
        }
        // (sent by reference where it goes directly: the transport encodes it as it posts)
        let Some(Ok(msg)) = this.unsent.as_mut() else {
            unreachable!("checked in the first poll")
        };
        if let Some(d) = *this.deadline {
            let left = d.saturating_duration_since(Instant::now()).as_micros();
            // 0 means "no deadline" on the wire; an already-expired call still says 1 µs.
            msg.header.aux = left.clamp(1, u32::MAX as u128) as u32;
            this.sleep.set(Some(tokio::time::sleep_until(d)));
        }
        let writer = {
            let mut t = state.lock();
            let going_away = state.going_away.load(Ordering::Acquire);
            if t.closed || going_away {
                // nothing registered: nothing to cancel
                *this.unsent = None;
                return Poll::Ready(Err(if t.closed {
                    RpcError::ConnectionClosed
                } else {
                    RpcError::Unavailable("the server is shutting down (it sent go-away)".into())
                }));
            }
            let id = t.register(cx.waker().clone());
            msg.header.id = id;
            *this.id = id;
            if t.claim_sink() {
                drop(t);
                if write_direct(state, msg) {
                    // the sink is given back with the first look for the answer, under the
                    // same lock
                    *this.unsent = None;
                    sink_held = true;
                    None
                } else {
                    write_own(state, cx, take_request(this.unsent))
                }
            } else {
                look = false;
                t.queue(take_request(this.unsent))
            }
        };
        if let Some(w) = writer {
            w.wake();
        }
        look &= state.direct.is_some();
    }
    // waiting for the answer
    let mut turn = false;
    if look {
        let id = *this.id;
        loop {
            let mut t = state.lock();
            let writer = if std::mem::take(&mut sink_held) {
                t.release_sink(false)
            } else {
                None
            };
            let slot = t.slot(id).expect("a call owns its slot until it ends");
            match &mut slot.state {
                SlotState::Waiting(w) => match w {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => *w = Some(cx.waker().clone()),
                },
                SlotState::Done(_) => {
                    let outcome = std::mem::replace(&mut slot.state, SlotState::Free);
                    t.release(id);
                    drop(t);
                    if let Some(w) = writer {
                        w.wake();
                    }
                    let SlotState::Done(outcome) = outcome else {
                        unreachable!("matched above")
                    };
                    return Poll::Ready(outcome.and_then(decode_reply::<D, R>));
                }
                SlotState::Free => unreachable!("a call owns its slot until it ends"),
            }
            let lone = t.waiting == 1;
            drop(t);
            if let Some(w) = writer {
                w.wake();
            }
            if let (true, Some(direct)) = (lone, &state.direct) {
                // A caller whose answers all come within a burst would complete call after
                // call without handing its thread back (nothing on this path spends tokio's
                // cooperative budget), starving the thread's other tasks. Each burst that
                // finds something spends one unit; once the task's budget is spent, the
                // caller waits for one turn of the others (tokio wakes it after them).
                let Poll::Ready(coop) = tokio::task::coop::poll_proceed(cx) else {
                    break;
                };
                // a small answer found in the burst is decoded where it was received
                let mut taken = None;
                let mut take = |lent: &mut dyn LentFrame| {
                    if !lent.accept() {
                        return false;
                    }
                    let f = lent.frame();
                    let header = f.header;
                    taken = Some(if f.attachment_bytes() == 0 {
                        // no bytes to keep (empty payloads need none): decoded in place
                        decode_answer::<D, R>(&header, f.body, f.to_attachments())
                    } else {
                        // payloads the caller keeps: copied out of the receive buffer
                        let (body, attachments) = lent.own();
                        decode_answer::<D, R>(&header, &body, attachments)
                    });
                    true
                };
                match this.spin.burst(&**direct, id, &mut take) {
                    Spin::Found => {
                        coop.made_progress();
                        if let Some(answer) = taken {
                            state.lock().taken(id);
                            state.shortcut_answers.fetch_add(1, Ordering::Relaxed);
                            return Poll::Ready(answer);
                        }
                        continue;
                    }
                    Spin::Turn => turn = true,
                    Spin::Off => {}
                }
            }
            break;
        }
    }
    match this.sleep.as_mut().as_pin_mut().map(|d| d.poll(cx)) {
        Some(Poll::Ready(())) => {
            cancel(state, *this.id);
            Poll::Ready(Err(RpcError::DeadlineExceeded))
        }
        _ => {
            if turn {
                // the spin goes on after the runtime's other ready tasks had a turn
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        }
    }
}

/// The request of a call whose first poll found it encoded (see [`Call::unsent`]), taken to be
/// sent.
fn take_request(unsent: &mut Option<Result<Message, RpcError>>) -> Message {
    let Some(Ok(msg)) = unsent.take() else {
        unreachable!("checked in the first poll")
    };
    msg
}

/// How long a lone call's caller receives for itself before it lets the runtime's other tasks
/// run once (then it goes on, within the transport's spin window), unless the transport asks
/// for longer bursts ([`DirectSend::spin_burst`]).
const SPIN_BURST: Duration = Duration::from_micros(10);

/// What one burst of [`SpinState::burst`] came to.
enum Spin {
    /// the transport received something: perhaps the answer
    Found,
    /// nothing within the burst: the caller lets other tasks run, then spins again
    Turn,
    /// no spinning (the transport does not offer it, its window is over, or another lone call
    /// waits on this thread): the caller waits to be woken by the transport's receiving task
    Off,
}

/// A lone call's caller receiving for itself while it waits for its answer, within the
/// transport's spin window ([`DirectSend::spin_window`]) from its first burst: the answer is
/// then handled where it is found, with no hand-off from the transport's receiving task (a
/// wake-up and a task switch: about 1 µs of a ~14 µs client side on RDMA under emulation, see
/// docs/latency.md).
///
/// A spinning caller keeps its thread from running other tasks, whose answers it does not
/// receive, so it spins only when nothing else is likely to need that thread: on a
/// current-thread runtime, where its task stays on its thread; with its call the only one
/// waiting on its connection (the caller checks); and with no other such call counted on its
/// thread (counted here, per thread, so that two runtimes do not hold each other back). Eight
/// connections with a call each on one runtime therefore leave receiving to their
/// transports, as before.
#[derive(Default)]
struct SpinState {
    /// when the window ends: the transport's window as it was at the first burst, from then
    until: Option<std::time::Instant>,
    /// the count of the thread it was counted on (a current-thread runtime's: the task stays
    /// there), until the call ends or its window is over
    counted: Option<Arc<AtomicUsize>>,
    /// the window is over: no more spinning for this call
    over: bool,
}

/// Whether the calling task runs on a current-thread runtime, where a spinning caller holds
/// back only the tasks of its own thread, which it can count. On a multi-thread runtime tasks
/// move between workers, so no per-thread count tells whether a caller would hold others back
/// (a version that spun there too gave 8 connections with a call each on 2 workers a 10%
/// higher p50 in 2 of 3 rounds of a guest A/B, 2026-12-02); callers there leave receiving to
/// the transport.
fn on_current_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
}

thread_local! {
    /// Lone calls whose callers may spin on this thread (see [`SpinState`]).
    static SPINNERS: Arc<AtomicUsize> = Arc::new(AtomicUsize::new(0));
}

impl SpinState {
    /// One burst of receiving for the answer to call `id` (see
    /// [`DirectSend::progress_with`]), after counting the caller in on this thread.
    #[inline(always)]
    fn burst(
        &mut self,
        direct: &dyn DirectSend,
        id: u64,
        take: &mut dyn FnMut(&mut dyn LentFrame) -> bool,
    ) -> Spin {
        if self.over {
            return Spin::Off;
        }
        // counted on this thread (current-thread runtime: it stays on it)
        let alone = match &self.counted {
            Some(c) => c.load(Ordering::Relaxed) == 1,
            None => {
                if !on_current_thread_runtime() {
                    self.over = true;
                    return Spin::Off;
                }
                let here = SPINNERS.with(Arc::clone);
                let alone = here.fetch_add(1, Ordering::Relaxed) == 0;
                self.counted = Some(here);
                alone
            }
        };
        if !alone {
            return Spin::Off;
        }
        let now = std::time::Instant::now();
        let until = match self.until {
            Some(until) => until,
            // (a window too long to add is as good as endless)
            None => *self.until.insert(
                now.checked_add(direct.spin_window())
                    .unwrap_or(now + Duration::from_secs(3600)),
            ),
        };
        if now >= until {
            self.over = true;
            self.uncount();
            return Spin::Off;
        }
        // a burst ends with the window at the latest
        let end = now
            .checked_add(direct.spin_burst().max(SPIN_BURST))
            .map_or(until, |end| end.min(until));
        loop {
            // a clock read costs as much as a few polls: look at it every few
            for _ in 0..8 {
                if direct.progress_with(id, take) {
                    return Spin::Found;
                }
            }
            if std::time::Instant::now() >= end {
                return Spin::Turn;
            }
        }
    }

    fn uncount(&mut self) {
        if let Some(c) = self.counted.take() {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for SpinState {
    fn drop(&mut self) {
        self.uncount();
    }
}

#[pin_project::pinned_drop]
impl<D, R> PinnedDrop for Call<D, R> {
    fn drop(self: Pin<&mut Self>) {
        let this = self.project();
        let _entered = (!this.span.is_none()).then(|| this.span.enter());
        let state = &*this.inner.state;
        if !*this.done && this.unsent.is_none() {
            cancel(state, *this.id);
        }
        if *this.credit {
            state.credits.release();
        }
    }
}

/// Gives up on call `id`: frees its slot and, if it was not answered yet, tells the server.
fn cancel(state: &State, id: u64) {
    let writer = {
        let mut t = state.lock();
        let Some(slot) = t.slot(id) else {
            return;
        };
        let was_waiting = matches!(slot.state, SlotState::Waiting(_));
        t.release(id);
        if !was_waiting || t.closed {
            return;
        }
        t.waiting -= 1;
        tracing::debug!(id, "call dropped; cancelling it on the server");
        t.queue(Message::control(Kind::Cancel, id))
    };
    if let Some(w) = writer {
        w.wake();
    }
}

fn decode_reply<D: DecodeBody<R>, R>(reply: Message) -> Result<R, RpcError> {
    decode_answer::<D, R>(&reply.header, &reply.body, reply.attachments)
}

/// Decodes an answer of header `header`, body `body` and `attachments`: the result, or the
/// server's error.
fn decode_answer<D: DecodeBody<R>, R>(
    header: &Header,
    body: &[u8],
    attachments: Attachments,
) -> Result<R, RpcError> {
    match header.aux {
        0 => D::decode(body, attachments).map_err(RpcError::Codec),
        code => {
            let kind = ServerErrorKind::from_code(code);
            if kind == ServerErrorKind::DeadlineExceeded {
                return Err(RpcError::DeadlineExceeded);
            }
            Err(RpcError::Server(ServerError::new(
                kind,
                String::from_utf8_lossy(body).into_owned(),
            )))
        }
    }
}

/// A lone call's caller posts its own frame `msg` through the transport's direct sender (it
/// holds the sink, see [`Table::claim_sink`]), if there is one and the link is idle: whether
/// it went. The caller still holds the sink either way.
fn write_direct(state: &State, msg: &Message) -> bool {
    // The writer is ours and holds nothing, so a frame that goes directly overtakes nothing.
    // (No `ready` first: `try_send` looks at the link itself, and says so if the frame cannot
    // go at once.)
    state.direct.as_ref().is_some_and(|d| d.try_send(msg))
}

/// A lone call's caller writes its own frame `msg` through the sink (it holds it, see
/// [`Table::claim_sink`]) and gives the sink back; what the sink cannot take or flush at once
/// is left to the writer task. Returns the writer's waker if it must be woken.
fn write_own(state: &State, cx: &mut Context<'_>, msg: Message) -> Option<Waker> {
    let (unsent, flushed) = match state.sink.feed(cx, msg) {
        Ok(None) => (None, state.sink.poll_flush(cx)),
        Ok(Some(msg)) => (Some(msg), Poll::Pending),
        Err(e) => (None, Poll::Ready(Err(e))),
    };
    let mut t = state.lock();
    if let Some(msg) = unsent {
        t.outgoing.push_front(msg);
    }
    let writer = t.release_sink(flushed.is_pending());
    drop(t);
    if let Poll::Ready(Err(e)) = flushed {
        if !state.is_shut() {
            tracing::debug!(error = %e, "write failed; closing the connection");
        }
        // fails this call too, with ConnectionClosed
        state.close();
    }
    writer
}

/// The transport's writer behind a lock, so that the writer task and a lone call's caller can
/// both write (never at once: [`Table::writing`] says who may). The writer task drops it when
/// the connection ends ([`FrameSink::release`]), so that a dead connection's transport is freed
/// while handles of its client live on; a write after that fails as on a closed connection.
trait FrameSink: Send + Sync {
    /// Drops the transport's writer.
    fn release(&self);
    /// Feeds `msg`; gives it back if the sink is not ready (then `cx` is woken when it is).
    fn feed(&self, cx: &mut Context<'_>, msg: Message) -> io::Result<Option<Message>>;
    /// Feeds the frames of `batch`, oldest first, while the sink is ready.
    fn poll_feed_all(
        &self,
        cx: &mut Context<'_>,
        batch: &mut VecDeque<Message>,
    ) -> Poll<io::Result<()>>;
    fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    fn poll_close(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

fn released() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the connection is closed")
}

/// Polls `f` on the writer, unless it was released.
fn with_writer<W, T>(
    sink: &Mutex<Option<W>>,
    f: impl FnOnce(Pin<&mut W>) -> Poll<io::Result<T>>,
) -> Poll<io::Result<T>>
where
    W: Unpin,
{
    match sink.lock().as_mut() {
        Some(w) => f(Pin::new(w)),
        None => Poll::Ready(Err(released())),
    }
}

impl<W> FrameSink for Mutex<Option<W>>
where
    W: Sink<Message, Error = io::Error> + Send + Unpin,
{
    fn release(&self) {
        let writer = self.lock().take();
        drop(writer);
    }

    fn feed(&self, cx: &mut Context<'_>, msg: Message) -> io::Result<Option<Message>> {
        let mut msg = Some(msg);
        let fed = with_writer(self, |mut w| {
            futures::ready!(w.as_mut().poll_ready(cx))?;
            let msg = msg.take().expect("fed once");
            Poll::Ready(w.start_send(msg))
        });
        match fed {
            Poll::Ready(r) => r.map(|()| None),
            Poll::Pending => Ok(msg),
        }
    }

    fn poll_feed_all(
        &self,
        cx: &mut Context<'_>,
        batch: &mut VecDeque<Message>,
    ) -> Poll<io::Result<()>> {
        with_writer(self, |mut w| {
            while let Some(msg) = batch.pop_front() {
                match w.as_mut().poll_ready(cx) {
                    Poll::Ready(Ok(())) => w.as_mut().start_send(msg)?,
                    other => {
                        batch.push_front(msg);
                        return other;
                    }
                }
            }
            Poll::Ready(Ok(()))
        })
    }

    fn poll_flush(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_writer(self, |w| w.poll_flush(cx))
    }

    fn poll_close(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with_writer(self, |w| w.poll_close(cx))
    }
}

/// Drives the transport's writer: waits for queued frames, takes every frame queued so far
/// and flushes once, so that many calls share one system call (or one doorbell).
///
/// With `coalesce` and other calls in flight (whose callers were woken together and are
/// about to queue theirs), it yields once first, so that their frames join the same write;
/// with nothing else in flight it writes at once.
///
/// Once the connection is closed it writes what is still queued, closes the writer and ends;
/// a failed write closes the connection.
async fn write_loop(state: Arc<State>, coalesce: bool, window: usize) {
    let mut batch: VecDeque<Message> = VecDeque::new();
    let sink = &*state.sink;
    let result: io::Result<()> = async {
        loop {
            let open = poll_fn(|cx| take_outgoing(&state, &mut batch, Some(cx))).await;
            if open && coalesce && state.credits.available() + 1 < window {
                tokio::task::yield_now().await;
                let _ = take_outgoing(&state, &mut batch, None);
            }
            poll_fn(|cx| sink.poll_feed_all(cx, &mut batch)).await?;
            poll_fn(|cx| sink.poll_flush(cx)).await?;
            state.lock().writing = false;
            if !open {
                return poll_fn(|cx| sink.poll_close(cx)).await;
            }
        }
    }
    .await;
    if let Err(e) = result {
        if !state.is_shut() {
            tracing::debug!(error = %e, "write failed; closing the connection");
        }
    }
    state.close();
    // the connection is over: free the transport's writer now, not when the last handle of
    // the client goes (a caller still writing holds the lock; it then finds it released)
    state.sink.release();
}

/// Moves the queued frames into `batch` (swapping buffers, so neither is reallocated).
///
/// With `cx` (the writer task waiting for work): ready once there are frames, a flush left by a
/// caller, or the connection is closed, and the sink is free; it then claims the sink and says
/// whether the connection is still open. Otherwise pending, with the writer's waker kept.
/// Without `cx` (the writer holds the sink already): takes what was queued since.
fn take_outgoing(
    state: &State,
    batch: &mut VecDeque<Message>,
    cx: Option<&mut Context<'_>>,
) -> Poll<bool> {
    let mut t = state.lock();
    if let Some(cx) = cx {
        let idle = t.outgoing.is_empty() && !t.flush_pending && !t.closed;
        if t.writing || idle {
            t.writer = Some(cx.waker().clone());
            return Poll::Pending;
        }
        t.writing = true;
        t.flush_pending = false;
    }
    if batch.is_empty() {
        std::mem::swap(batch, &mut t.outgoing);
    } else {
        batch.append(&mut t.outgoing);
    }
    Poll::Ready(!t.closed)
}

/// Reads the server's frames: completes calls, answers pings, notes go-away; pings a silent
/// server and gives up on one silent for the keep-alive timeout. The keep-alive timer is
/// looked at only when the socket has nothing more to read, not per frame.
async fn read_loop<R>(mut reader: R, state: Arc<State>, config: Config)
where
    R: Stream<Item = io::Result<Message>> + Unpin,
{
    let mut keepalive = KeepAlive::new(config.keepalive_interval, config.keepalive_timeout);
    keepalive.count_also(Arc::clone(&state.shortcut_answers));
    // Callers whose answers came in this turn, woken once the table is unlocked. Answers read
    // in one turn (one read of the socket, one batch of packets) are recorded under one lock.
    let mut answered: Vec<Waker> = Vec::new();
    poll_fn(|cx| {
        let mut table: Option<MutexGuard<'_, Table>> = None;
        let outcome = 'read: loop {
            if state.is_shut() {
                break Poll::Ready(());
            }
            match reader.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(msg))) => {
                    keepalive.saw_frame();
                    if msg.header.kind == Kind::Response {
                        let t = table.get_or_insert_with(|| state.lock());
                        // None: the call was cancelled or timed out meanwhile.
                        answered.extend(t.complete(msg.header.id, Ok(msg)));
                        continue;
                    }
                    drop(table.take());
                    if !on_frame(&state, msg) {
                        break Poll::Ready(());
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    if e.kind() == io::ErrorKind::InvalidData {
                        tracing::warn!(error = %e, "bad frame from server; closing the connection");
                    } else {
                        tracing::info!(error = %e, "connection failed; closing it");
                    }
                    break Poll::Ready(());
                }
                Poll::Ready(None) => {
                    tracing::debug!("server closed the connection");
                    break Poll::Ready(());
                }
                Poll::Pending => {
                    drop(table.take());
                    state.reader.register(cx.waker());
                    if state.is_shut() {
                        break Poll::Ready(());
                    }
                    while let Poll::Ready(tick) = keepalive.poll_tick(cx) {
                        match tick {
                            Tick::Alive => {}
                            Tick::Ping => state.send(Message::control(Kind::Ping, 0)),
                            Tick::Dead(silent) => {
                                tracing::warn!(
                                    ?silent,
                                    "server stopped answering keep-alives; closing"
                                );
                                break 'read Poll::Ready(());
                            }
                        }
                    }
                    break Poll::Pending;
                }
            }
        };
        drop(table);
        answered.drain(..).for_each(Waker::wake);
        outcome
    })
    .await;
    state.close();
}

/// The client's taker for a transport's [`ResponseShortcut`]: completes the call a response
/// answers and wakes its caller, from the transport's receiving task. It holds the table
/// weakly (the transport must not keep the client alive), so no client state is dropped in
/// the transport's receive path except, at worst, a table whose connection is gone.
fn take_response(
    table: Weak<Mutex<Table>>,
    answers: Arc<AtomicU64>,
) -> impl Fn(Message) -> Option<Message> + Send + Sync + 'static {
    move |msg: Message| {
        if msg.header.kind != Kind::Response {
            return Some(msg);
        }
        let Some(table) = table.upgrade() else {
            return Some(msg);
        };
        answers.fetch_add(1, Ordering::Relaxed);
        answer(&table, msg);
        None
    }
}

/// Completes the call a response answers and wakes its caller. An answer to a call no longer
/// waiting (cancelled, timed out, the connection closed) is dropped.
fn answer(table: &Mutex<Table>, msg: Message) {
    let caller = table.lock().complete(msg.header.id, Ok(msg));
    if let Some(w) = caller {
        w.wake();
    }
}

/// Handles one frame from the server; false if the connection must close.
fn on_frame(state: &State, msg: Message) -> bool {
    match msg.header.kind {
        Kind::Response => answer(&state.table, msg),
        Kind::Ping => state.send(Message::control(Kind::Pong, msg.header.id)),
        Kind::Pong | Kind::Hello => {}
        Kind::GoAway => {
            tracing::info!("server is draining; no new calls on this connection");
            state.going_away.store(true, Ordering::Release);
        }
        Kind::Request | Kind::Cancel => {
            tracing::warn!(kind = %msg.header.kind, "server sent a client-only frame; closing");
            return false;
        }
    }
    true
}
