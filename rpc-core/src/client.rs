//! The caller's side of a connection: request ids, the table of calls in flight, credits,
//! deadlines and cancellation, over any [`Transport`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::codec::Codec;
use crate::conn::{encode_body, write_loop, KeepAlive, Outbox, Tick};
use crate::payload::with_attachments;
use crate::transport::Transport;
use crate::wire::{Header, Kind, Message};
use crate::{Config, RpcError, ServerError, ServerErrorKind};

type Waiter = oneshot::Sender<Result<Message, RpcError>>;

/// State shared by the call futures and the connection's reader task.
struct State {
    calls: Mutex<Calls>,
    credits: Semaphore,
    closed: CancellationToken,
}

#[derive(Default)]
struct Calls {
    waiting: HashMap<u64, Waiter>,
    /// Set once the connection is gone; no call is registered after that.
    closed: bool,
    /// The server said it is draining.
    going_away: bool,
}

impl State {
    /// Fails every call in flight and refuses new ones.
    fn close(&self) {
        let waiting = {
            let mut calls = self.calls.lock().expect("calls lock");
            calls.closed = true;
            std::mem::take(&mut calls.waiting)
        };
        // Closed before any caller hears of it, so a failed call sees a closed client.
        self.closed.cancel();
        self.credits.close();
        for (_, w) in waiting {
            let _ = w.send(Err(RpcError::ConnectionClosed));
        }
    }
}

/// Held by every client handle and call future; when the last one goes, the connection closes.
struct Inner {
    state: Arc<State>,
    outbox: Outbox,
    next_id: AtomicU64,
    config: Config,
    peer: String,
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

impl Client {
    /// Starts the protocol over an established connection: spawns its reader and writer
    /// tasks on the current tokio runtime.
    ///
    /// This skips the greeting ([`Client::handshake`] does it), so it suits servers without
    /// an [`auth_token`](Config::auth_token), in-process transports and tests.
    pub fn new<T: Transport>(transport: T, config: Config) -> Client {
        let peer = transport.peer();
        let coalesce = transport.coalesce_writes();
        let (reader, writer) = transport.split();
        Client::start(reader, writer, peer, config, coalesce)
    }

    /// Greets the server (presenting [`Config::auth_token`] if set), waits for its answer
    /// within [`Config::connect_timeout`], then starts the protocol as [`Client::new`] does.
    /// A server that refuses the credentials makes this fail with an `Unauthenticated`
    /// [`RpcError::Server`].
    pub async fn handshake<T: Transport>(transport: T, config: Config) -> Result<Client, RpcError> {
        use futures::{SinkExt, StreamExt};
        let peer = transport.peer();
        let coalesce = transport.coalesce_writes();
        let (mut reader, mut writer) = transport.split();
        let token = config
            .auth_token
            .as_ref()
            .map(|t| bytes::Bytes::copy_from_slice(t.expose()))
            .unwrap_or_default();
        let hello = Message {
            header: Header::new(Kind::Hello, 0),
            body: token,
            attachments: Vec::new(),
        };
        let greeting = async {
            writer.send(hello).await?;
            reader.next().await.transpose()
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
            Some(m) if m.header.kind == Kind::Hello => {
                Ok(Client::start(reader, writer, peer, config, coalesce))
            }
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

    fn start<R, W>(reader: R, writer: W, peer: String, config: Config, coalesce: bool) -> Client
    where
        R: futures::Stream<Item = std::io::Result<Message>> + Send + Unpin + 'static,
        W: futures::Sink<Message, Error = std::io::Error> + Send + Unpin + 'static,
    {
        let (outbox, rx) = mpsc::unbounded_channel();
        let state = Arc::new(State {
            calls: Mutex::new(Calls::default()),
            credits: Semaphore::new(config.max_in_flight.min(Semaphore::MAX_PERMITS)),
            closed: CancellationToken::new(),
        });
        let span = tracing::info_span!("rpc_client", peer = %peer);
        let window = config.max_in_flight.min(Semaphore::MAX_PERMITS);
        let busy = state.clone();
        let others_waiting = move || coalesce && busy.credits.available_permits() + 1 < window;
        tokio::spawn(
            write_loop(writer, rx, state.closed.clone(), others_waiting).instrument(span.clone()),
        );
        tokio::spawn(
            read_loop(reader, state.clone(), outbox.clone(), config.clone()).instrument(span),
        );
        Client {
            inner: Arc::new(Inner {
                state,
                outbox,
                next_id: AtomicU64::new(1),
                config,
                peer,
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
        self.inner.state.closed.is_cancelled()
    }

    /// Resolves when the connection is gone.
    pub fn closed(&self) -> impl Future<Output = ()> + Send + 'static {
        let token = self.inner.state.closed.clone();
        async move { token.cancelled().await }
    }

    /// Number of calls waiting for an answer.
    pub fn in_flight(&self) -> usize {
        self.inner
            .state
            .calls
            .lock()
            .expect("calls lock")
            .waiting
            .len()
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
        let inner = self.inner.clone();
        // A span per call costs ~7% of a small call's instructions even when nothing listens:
        // make one only when debug tracing is on.
        let span = if tracing::enabled!(tracing::Level::DEBUG) {
            let name = prepared.as_ref().map_or("?", |p| p.name);
            tracing::debug_span!("call", method = name)
        } else {
            tracing::Span::none()
        };
        async move {
            let msg = prepared?.msg;
            let size = msg.payload_len();
            if size > inner.config.max_message_size {
                return Err(RpcError::TooLarge {
                    size,
                    limit: inner.config.max_message_size,
                });
            }
            let reply = match deadline {
                Some(d) => {
                    match tokio::time::timeout_at(d, exchange(&inner, msg, deadline)).await {
                        Ok(r) => r?,
                        Err(_) => return Err(RpcError::DeadlineExceeded),
                    }
                }
                None => exchange(&inner, msg, None).await?,
            };
            decode_reply::<C, R>(reply)
        }
        .instrument(span)
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
        let (body, attachments) = encode_body::<C, A>(args).map_err(RpcError::Codec)?;
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

/// Removes a call from the table if its future is dropped before the answer came, and tells
/// the server to stop its handler.
struct CallGuard<'a> {
    inner: &'a Inner,
    id: u64,
    armed: bool,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let was_waiting = self
            .inner
            .state
            .calls
            .lock()
            .expect("calls lock")
            .waiting
            .remove(&self.id)
            .is_some();
        if was_waiting {
            tracing::debug!(id = self.id, "call dropped; cancelling it on the server");
            let _ = self
                .inner
                .outbox
                .send(Message::control(Kind::Cancel, self.id));
        }
    }
}

async fn exchange(
    inner: &Inner,
    mut msg: Message,
    deadline: Option<Instant>,
) -> Result<Message, RpcError> {
    let permit = inner
        .state
        .credits
        .acquire()
        .await
        .map_err(|_| RpcError::ConnectionClosed)?;
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = oneshot::channel();
    {
        let mut calls = inner.state.calls.lock().expect("calls lock");
        if calls.closed {
            return Err(RpcError::ConnectionClosed);
        }
        if calls.going_away {
            return Err(RpcError::Unavailable(
                "the server is shutting down (it sent go-away)".into(),
            ));
        }
        calls.waiting.insert(id, tx);
    }
    let mut guard = CallGuard {
        inner,
        id,
        armed: true,
    };
    msg.header.id = id;
    if let Some(d) = deadline {
        let left = d.saturating_duration_since(Instant::now()).as_micros();
        // 0 means "no deadline" on the wire; an already-expired call still says 1 µs.
        msg.header.aux = left.clamp(1, u32::MAX as u128) as u32;
    }
    if inner.outbox.send(msg).is_err() {
        return Err(RpcError::ConnectionClosed);
    }
    let answer = rx.await;
    guard.armed = false;
    drop(permit);
    answer.unwrap_or(Err(RpcError::ConnectionClosed))
}

fn decode_reply<C: Codec, R: DeserializeOwned>(reply: Message) -> Result<R, RpcError> {
    match reply.header.aux {
        0 => with_attachments(reply.attachments, || C::decode::<R>(&reply.body))
            .map_err(RpcError::Codec),
        code => {
            let kind = ServerErrorKind::from_code(code);
            if kind == ServerErrorKind::DeadlineExceeded {
                return Err(RpcError::DeadlineExceeded);
            }
            Err(RpcError::Server(ServerError::new(
                kind,
                String::from_utf8_lossy(&reply.body).into_owned(),
            )))
        }
    }
}

async fn read_loop<R>(mut reader: R, state: Arc<State>, outbox: Outbox, config: Config)
where
    R: futures::Stream<Item = std::io::Result<Message>> + Unpin,
{
    use futures::StreamExt;
    let mut keepalive = KeepAlive::new(config.keepalive_interval, config.keepalive_timeout);
    loop {
        tokio::select! {
            biased;
            _ = state.closed.cancelled() => break,
            next = reader.next() => match next {
                Some(Ok(msg)) => {
                    keepalive.saw_frame();
                    match msg.header.kind {
                        Kind::Response => {
                            let waiter = state
                                .calls
                                .lock()
                                .expect("calls lock")
                                .waiting
                                .remove(&msg.header.id);
                            // None: the call was cancelled or timed out meanwhile.
                            if let Some(w) = waiter {
                                let _ = w.send(Ok(msg));
                            }
                        }
                        Kind::Ping => {
                            let _ = outbox.send(Message::control(Kind::Pong, msg.header.id));
                        }
                        Kind::Pong | Kind::Hello => {}
                        Kind::GoAway => {
                            tracing::info!("server is draining; no new calls on this connection");
                            state.calls.lock().expect("calls lock").going_away = true;
                        }
                        Kind::Request | Kind::Cancel => {
                            tracing::warn!(kind = %msg.header.kind, "server sent a client-only frame; closing");
                            break;
                        }
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "bad frame from server; closing the connection");
                    break;
                }
                None => {
                    tracing::debug!("server closed the connection");
                    break;
                }
            },
            tick = keepalive.tick() => match tick {
                Tick::Alive => {}
                Tick::Ping => {
                    let _ = outbox.send(Message::control(Kind::Ping, 0));
                }
                Tick::Dead(silent) => {
                    tracing::warn!(?silent, "server stopped answering keep-alives; closing");
                    break;
                }
            },
        }
    }
    state.close();
}
