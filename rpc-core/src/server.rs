//! The server's side: [`Service`] (implemented by generated `FooServer`s), per-connection
//! dispatch with cancellation, deadlines, panic isolation and flow control, and graceful
//! shutdown.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::codec::Codec;
use crate::conn::{encode_body, write_loop, KeepAlive, Outbox, Tick};
use crate::payload::with_attachments;
use crate::transport::{Listener, Transport};
use crate::wire::{FrameError, Header, Kind, Message};
use crate::{Config, Payload, ServerError, ServerErrorKind};

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
    attachments: Vec<Payload>,
}

impl Request {
    /// A request from an encoded body and its attachments.
    pub fn new(body: Bytes, attachments: Vec<Payload>) -> Request {
        Request { body, attachments }
    }

    /// Decodes the arguments of method `name`; failure is a `BadRequest` for the caller.
    pub fn decode<C: Codec, T: DeserializeOwned>(
        self,
        name: &'static str,
    ) -> Result<T, ServerError> {
        let body = self.body;
        with_attachments(self.attachments, || C::decode::<T>(&body)).map_err(|e| {
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
    attachments: Vec<Payload>,
}

impl Reply {
    /// Encodes a method's result.
    pub fn encode<C: Codec, T: Serialize + ?Sized>(value: &T) -> Result<Reply, ServerError> {
        let (body, attachments) = encode_body::<C, T>(value).map_err(|e| {
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
}

impl ShutdownHandle {
    /// A handle not yet triggered.
    pub fn new() -> ShutdownHandle {
        ShutdownHandle::default()
    }

    /// Starts a graceful shutdown (idempotent).
    pub fn shutdown(&self) {
        self.token.cancel();
    }

    /// Whether shutdown has started.
    pub fn is_shutting_down(&self) -> bool {
        self.token.is_cancelled()
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
    handler_slots: Arc<Semaphore>,
    shutdown: CancellationToken,
    stats: Arc<ServerStats>,
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
        handler_slots: Arc::new(Semaphore::new(
            config.max_concurrent_handlers.min(Semaphore::MAX_PERMITS),
        )),
        config,
        shutdown: shutdown.token.clone(),
        stats,
    };
    let connections = TaskTracker::new();
    loop {
        tokio::select! {
            biased;
            _ = ctx.shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(transport) => {
                    let span = tracing::info_span!("rpc_conn", service = S::NAME, peer = %transport.peer());
                    connections.spawn(serve_connection(transport, service.clone(), ctx.clone()).instrument(span));
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

type Calls = Arc<Mutex<HashMap<u64, AbortHandle>>>;

/// Serves one connection until the peer goes away or the server has drained.
async fn serve_connection<T: Transport, S: Service>(transport: T, service: Arc<S>, ctx: Ctx) {
    use std::sync::atomic::Ordering::Relaxed;
    ctx.stats.connections.fetch_add(1, Relaxed);
    tracing::debug!("connection open");
    let (mut reader, writer) = transport.split();
    let (outbox, rx) = mpsc::unbounded_channel();
    let closed = CancellationToken::new();
    let writer_task = tokio::spawn(write_loop(writer, rx, closed.clone()).in_current_span());
    let calls: Calls = Arc::new(Mutex::new(HashMap::new()));
    let handlers = TaskTracker::new();
    let mut keepalive = KeepAlive::new(ctx.config.keepalive_interval, ctx.config.keepalive_timeout);
    let mut draining = false;
    loop {
        tokio::select! {
            biased;
            _ = closed.cancelled() => break,
            _ = ctx.shutdown.cancelled(), if !draining => {
                draining = true;
                handlers.close();
                let _ = outbox.send(Message::control(Kind::GoAway, 0));
            }
            _ = handlers.wait(), if draining => {
                tracing::debug!("drained");
                break;
            }
            next = reader.next() => match next {
                Some(Ok(msg)) => {
                    keepalive.saw_frame();
                    match msg.header.kind {
                        Kind::Request => {
                            if draining {
                                refuse(&outbox, msg.header.id, ServerErrorKind::ShuttingDown, "the server is shutting down");
                                continue;
                            }
                            let Some(slot) = take_slot(&ctx, &closed).await else { break };
                            start_call(msg, slot, &service, &calls, &handlers, &outbox, &ctx);
                        }
                        Kind::Cancel => {
                            if let Some(h) = calls.lock().expect("calls lock").remove(&msg.header.id) {
                                tracing::debug!(id = msg.header.id, "call cancelled by the client");
                                h.abort();
                            }
                        }
                        Kind::Ping => {
                            let _ = outbox.send(Message::control(Kind::Pong, msg.header.id));
                        }
                        Kind::Pong => {}
                        Kind::Response | Kind::GoAway => {
                            tracing::warn!(kind = %msg.header.kind, "client sent a server-only frame; closing");
                            break;
                        }
                    }
                }
                Some(Err(e)) => {
                    if let Some(FrameError::TooLarge { kind: Kind::Request, id, len, limit }) = FrameError::from_io(&e) {
                        refuse(&outbox, *id, ServerErrorKind::TooLarge,
                            &format!("request of {len} bytes exceeds the server's limit of {limit} bytes"));
                    }
                    tracing::warn!(error = %e, "unreadable frame; closing the connection");
                    break;
                }
                None => break,
            },
            tick = keepalive.tick() => match tick {
                Tick::Alive => {}
                Tick::Ping => {
                    let _ = outbox.send(Message::control(Kind::Ping, 0));
                }
                Tick::Dead(silent) => {
                    tracing::warn!(?silent, "client stopped answering keep-alives; closing");
                    break;
                }
            },
        }
    }
    // The peer is gone or we are done: stop whatever still runs for it.
    let left: Vec<AbortHandle> = calls
        .lock()
        .expect("calls lock")
        .drain()
        .map(|(_, h)| h)
        .collect();
    if !left.is_empty() {
        tracing::debug!(calls = left.len(), "aborting calls of a closed connection");
    }
    for h in left {
        h.abort();
    }
    handlers.close();
    handlers.wait().await;
    drop(outbox);
    let _ = writer_task.await;
    ctx.stats.connections.fetch_sub(1, Relaxed);
    tracing::debug!("connection closed");
}

async fn take_slot(ctx: &Ctx, closed: &CancellationToken) -> Option<OwnedSemaphorePermit> {
    if let Ok(p) = ctx.handler_slots.clone().try_acquire_owned() {
        return Some(p);
    }
    // Over the concurrency limit: stop reading this connection until a handler finishes.
    tokio::select! {
        p = ctx.handler_slots.clone().acquire_owned() => p.ok(),
        _ = closed.cancelled() => None,
    }
}

fn refuse(outbox: &Outbox, id: u64, kind: ServerErrorKind, message: &str) {
    let _ = outbox.send(error_message(id, kind, message));
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
        attachments: Vec::new(),
    }
}

fn start_call<S: Service>(
    msg: Message,
    slot: OwnedSemaphorePermit,
    service: &Arc<S>,
    calls: &Calls,
    handlers: &TaskTracker,
    outbox: &Outbox,
    ctx: &Ctx,
) {
    let id = msg.header.id;
    let method = msg.header.method;
    let Some(name) = service.method_name(method) else {
        tracing::warn!(
            id,
            method = format_args!("{method:#010x}"),
            "unknown method"
        );
        refuse(
            outbox,
            id,
            ServerErrorKind::UnknownMethod,
            &format!("{} serves no method with id {method:#010x}", S::NAME),
        );
        return;
    };
    let deadline = match msg.header.aux {
        0 => None,
        us => Some(Instant::now() + Duration::from_micros(us as u64)),
    };
    let request = Request::new(msg.body, msg.attachments);
    let mut table = calls.lock().expect("calls lock");
    if table.contains_key(&id) {
        drop(table);
        tracing::warn!(id, "duplicate request id from client");
        refuse(
            outbox,
            id,
            ServerErrorKind::BadRequest,
            "a call with this request id is already running",
        );
        return;
    }
    let work = run_call(
        service.clone(),
        method,
        name,
        request,
        deadline,
        id,
        calls.clone(),
        outbox.clone(),
        slot,
        ctx.stats.clone(),
    );
    // The task removes itself from `calls` under this lock, so it cannot finish before its
    // abort handle is in the table.
    let handle =
        handlers.spawn(work.instrument(tracing::debug_span!("handler", method = name, id)));
    table.insert(id, handle.abort_handle());
}

#[allow(clippy::too_many_arguments)]
async fn run_call<S: Service>(
    service: Arc<S>,
    method: u32,
    name: &'static str,
    request: Request,
    deadline: Option<Instant>,
    id: u64,
    calls: Calls,
    outbox: Outbox,
    _slot: OwnedSemaphorePermit,
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
    let work = AssertUnwindSafe(service.dispatch(method, request)).catch_unwind();
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
    let reply = match outcome {
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
                tracing::warn!(error = %e.message, "bad request");
            }
            error_message(id, e.kind, &e.message)
        }
        Err(panic) => {
            let what = panic_message(&*panic);
            tracing::error!(panic = %what, "handler panicked");
            error_message(
                id,
                ServerErrorKind::Panicked,
                &format!("{name} panicked: {what}"),
            )
        }
    };
    // Still in the table means nobody cancelled the call: answer it.
    if calls.lock().expect("calls lock").remove(&id).is_some() {
        let _ = outbox.send(reply);
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
