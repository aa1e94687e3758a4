//! Async RPC for storage microservices, over RDMA verbs or TCP with one API.
//!
//! Annotate a trait with [`rdma_service`]; it generates a typed client (`FooClient`) and a
//! server dispatcher (`FooServer`). An [`Endpoint`] — `tcp://host:port` or
//! `rdma://host:port?device=…` — picks the transport at run time, so the same binary runs on an
//! RDMA fabric and where there is only TCP.
//!
//! Small messages go inline; bulk data travels as [`Payload`]s beside the encoded message,
//! never through the codec byte by byte: on TCP it is written straight from your buffer, on
//! RDMA it moves by rendezvous (RDMA Read or Write) into registered buffers.
//!
//! # Example
//! ```
//! use rdma_rpc::{rdma_service, Endpoint, Payload, RpcError, Server};
//!
//! #[rdma_service]
//! pub trait Store {
//!     async fn put(&self, key: String, value: Payload) -> u64;
//!     async fn get(&self, key: String) -> Option<Payload>;
//! }
//!
//! #[derive(Default)]
//! struct Memory(std::sync::Mutex<std::collections::HashMap<String, Payload>>);
//!
//! impl Store for Memory {
//!     async fn put(&self, key: String, value: Payload) -> u64 {
//!         let len = value.len() as u64;
//!         self.0.lock().unwrap().insert(key, value);
//!         len
//!     }
//!     async fn get(&self, key: String) -> Option<Payload> {
//!         self.0.lock().unwrap().get(&key).cloned()
//!     }
//! }
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), RpcError> {
//! let endpoint: Endpoint = "tcp://127.0.0.1:0".parse().unwrap();
//! let server = Server::bind(&endpoint).await?;
//! let endpoint = server.local_endpoint();
//! let shutdown = server.shutdown_handle();
//! let serving = tokio::spawn(server.serve(StoreServer::new(Memory::default())));
//!
//! let client = StoreClient::connect(&endpoint).await?;
//! client.put("k".into(), Payload::from(vec![7u8; 1 << 20])).await?;
//! assert_eq!(client.get("k".into()).await?.unwrap().len(), 1 << 20);
//!
//! shutdown.shutdown();
//! serving.await.unwrap()?;
//! # Ok(())
//! # }
//! ```
//!
//! # Transports
//! - `tcp://HOST:PORT`: always available.
//! - `rdma://HOST:PORT[?device=NAME]`: needs the `rdma` cargo feature, rdma-core at run time
//!   and an RDMA device; otherwise connecting or binding returns [`RpcError::Unavailable`]
//!   saying why (never a panic), so one binary runs everywhere.
//!
//! Endpoint options also tune the protocol (see [`Config::from_endpoint`]).
#![forbid(unsafe_code)]

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use rpc_core::server::payload_mut;
pub use rpc_core::{
    Codec, CodecError, Config, ConfigError, Endpoint, EndpointParseError, Payload, PayloadMut,
    RpcError, Scheme, Secret, ServerError, ServerErrorKind, ShutdownHandle,
};
pub use rpc_macros::rdma_service;
/// Counters of registered RDMA buffer pools ([`Server::rdma_pools`], [`Client::rdma_pools`]).
#[cfg(feature = "rdma")]
pub use transport_rdma::{PoolCounts, PoolMonitor};

use rpc_core::codec::direct::{DecodeBody, EncodeBody, Serde};
use rpc_core::server::ServerStats;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tracing::Instrument;
use transport_tcp::{TcpListener, TcpTransport};

/// Codecs for message bodies: [`Bincode`](codec::Bincode) by default, or your own
/// [`Codec`] named in `#[rdma_service(codec = …)]`.
pub mod codec {
    pub use rpc_core::codec::{Bincode, Codec, CodecError};
}

/// Lower layers, for writing transports or services by hand.
pub mod core {
    pub use rpc_core::*;
}

/// TLS for `tcp://` endpoints: the endpoint options that turn it on, and [`tls::ServerTls`].
#[cfg(feature = "tls")]
pub mod tls;

/// Used by the code `#[rdma_service]` generates; not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use rpc_core::codec::direct::{Probe, ViaDirect, ViaSerde};
    pub use rpc_core::{method_id, Reply, Request, ServerError, Service};
}

/// A connection to a server, shared by cheap clones. Generated clients wrap one; use it
/// directly to choose a [`Config`] ([`Client::connect_with`]) and hand it to
/// `FooClient::from_client`.
///
/// When the connection is lost, calls in flight on it fail with
/// [`RpcError::ConnectionClosed`] (they may or may not have run). The next call connects again
/// (with a backoff between failed attempts) and, as [`Config::wait_for_reconnect`] says, waits
/// for the new connection or fails at once with [`RpcError::Unavailable`] while it is down.
#[derive(Clone)]
pub struct Client {
    conn: Arc<Conn>,
    timeout: Option<Duration>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.conn.endpoint)
            .field("timeout", &self.timeout)
            .field("connected", &self.conn.live().is_some())
            .finish()
    }
}

/// The current connection of a client and how to make a new one.
struct Conn {
    /// `None` for a client over a transport it was handed, which cannot reconnect.
    endpoint: Option<Endpoint>,
    config: Config,
    /// Read on every call (a shared lock: calls on many threads do not wait for each other),
    /// written on a reconnection.
    current: std::sync::RwLock<rpc_core::Client>,
    /// Counts the registered buffer pools of every RDMA connection this client makes.
    pools: rdma::Pools,
    /// Held while connecting, so that concurrent calls make one attempt, not many.
    reconnecting: tokio::sync::Mutex<Backoff>,
}

struct Backoff {
    next: Duration,
}

impl Conn {
    /// The current connection, unless it is gone or its server is going away (then calls
    /// wait for, or fail fast until, a new connection, as configured, instead of failing on
    /// the old one until the server closes it).
    fn live(&self) -> Option<rpc_core::Client> {
        let c = self.current.read().expect("connection lock");
        (!c.is_closed() && !c.is_going_away()).then(|| c.clone())
    }

    /// The connection to send on, reconnecting if it is gone (as configured).
    async fn get(self: &Arc<Self>) -> Result<rpc_core::Client, RpcError> {
        if let Some(c) = self.live() {
            return Ok(c);
        }
        let Some(endpoint) = self.endpoint.clone().filter(|_| self.config.reconnect) else {
            return Err(RpcError::ConnectionClosed);
        };
        if self.config.wait_for_reconnect {
            return self.reconnect(&endpoint).await;
        }
        let why = if self
            .current
            .read()
            .expect("connection lock")
            .is_going_away()
        {
            "the server is shutting down (it sent go-away)"
        } else {
            "not connected"
        };
        // Fail fast, with one reconnection attempt under way in the background.
        if self.reconnecting.try_lock().is_ok() {
            let me = self.clone();
            let ep = endpoint.clone();
            tokio::spawn(async move {
                let _ = me.reconnect(&ep).await;
            });
        }
        Err(RpcError::Unavailable(format!(
            "{endpoint}: {why} (reconnecting in the background)"
        )))
    }

    async fn reconnect(&self, endpoint: &Endpoint) -> Result<rpc_core::Client, RpcError> {
        let mut backoff = self.reconnecting.lock().await;
        if let Some(c) = self.live() {
            return Ok(c); // Someone else reconnected meanwhile.
        }
        let give_up = tokio::time::Instant::now() + self.config.connect_timeout;
        loop {
            match connect_once(endpoint, &self.config, &self.pools).await {
                Ok(c) => {
                    tracing::info!(%endpoint, "reconnected");
                    *self.current.write().expect("connection lock") = c.clone();
                    backoff.next = self.config.reconnect_backoff;
                    return Ok(c);
                }
                Err(e) => {
                    let pause = backoff.next;
                    backoff.next = (pause * 2).min(self.config.reconnect_backoff_max);
                    if tokio::time::Instant::now() + pause >= give_up {
                        tracing::debug!(%endpoint, error = %e, "reconnection failed");
                        return Err(e);
                    }
                    tracing::debug!(%endpoint, error = %e, ?pause, "reconnection failed; retrying");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}

/// One connection attempt, with the greeting, bounded by `connect_timeout`. Timed out, its
/// error says which part did not finish: the transport's connection (TCP and TLS, or RDMA's
/// connection manager) or the greeting over it.
async fn connect_once(
    endpoint: &Endpoint,
    config: &Config,
    pools: &rdma::Pools,
) -> Result<rpc_core::Client, RpcError> {
    let timeout = config.connect_timeout;
    // set once the transport's connection is up, before the greeting
    let connected = AtomicBool::new(false);
    let connecting = async {
        match endpoint.scheme() {
            Scheme::Tcp => {
                // Plain text or TLS, as the endpoint's options say.
                let t = TcpTransport::connect_endpoint(endpoint, config.clone())
                    .await
                    .map_err(|e| connect_error(endpoint, e))?;
                connected.store(true, Ordering::Relaxed);
                rpc_core::Client::handshake(t, config.clone()).await
            }
            Scheme::Rdma => rdma::connect(endpoint, config.clone(), pools, &connected).await,
            _ => Err(RpcError::Unavailable(format!(
                "{endpoint}: transport not built in"
            ))),
        }
    };
    tokio::time::timeout(
        timeout,
        connecting.instrument(tracing::info_span!("connect", %endpoint)),
    )
    .await
    .map_err(|_| {
        let stalled = if connected.load(Ordering::Relaxed) {
            "connected, but the server did not answer the greeting"
        } else {
            "the transport's connection was not set up"
        };
        RpcError::Unavailable(format!(
            "{endpoint}: no connection within {timeout:?} ({stalled})"
        ))
    })?
}

impl Client {
    /// Connects to `endpoint` with the default [`Config`] and the endpoint's options.
    pub async fn connect(endpoint: &Endpoint) -> Result<Client, RpcError> {
        Client::connect_with(endpoint, Config::default()).await
    }

    /// Connects to `endpoint` with `config` (the endpoint's options apply on top).
    pub async fn connect_with(endpoint: &Endpoint, config: Config) -> Result<Client, RpcError> {
        let config = config
            .with_endpoint_options(endpoint)
            .map_err(invalid_config)?;
        let pools: rdma::Pools = Default::default();
        let first = connect_once(endpoint, &config, &pools).await?;
        Ok(Client::with_conn(
            Some(endpoint.clone()),
            config,
            first,
            pools,
        ))
    }

    /// Starts the protocol over a connection you made yourself (any [`core::Transport`]). Such
    /// a client cannot reconnect.
    pub fn from_transport<T: rpc_core::Transport>(transport: T, config: Config) -> Client {
        let first = rpc_core::Client::new(transport, config.clone());
        Client::with_conn(None, config, first, Default::default())
    }

    fn with_conn(
        endpoint: Option<Endpoint>,
        config: Config,
        first: rpc_core::Client,
        pools: rdma::Pools,
    ) -> Client {
        Client {
            conn: Arc::new(Conn {
                endpoint,
                reconnecting: tokio::sync::Mutex::new(Backoff {
                    next: config.reconnect_backoff,
                }),
                config,
                current: std::sync::RwLock::new(first),
                pools,
            }),
            timeout: None,
        }
    }

    /// A handle on the same connection whose calls fail with
    /// [`RpcError::DeadlineExceeded`] after `timeout`; the server drops the work then too.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        Client {
            conn: self.conn.clone(),
            timeout: Some(timeout),
        }
    }

    /// Whether the current connection is gone (the next call reconnects, if configured).
    pub fn is_closed(&self) -> bool {
        self.conn.live().is_none()
    }

    /// Waits until connected, reconnecting if needed (bounded by `connect_timeout`).
    pub async fn ensure_connected(&self) -> Result<(), RpcError> {
        match (self.conn.live(), &self.conn.endpoint) {
            (Some(_), _) => Ok(()),
            (None, Some(ep)) => self.conn.reconnect(ep).await.map(|_| ()),
            (None, None) => Err(RpcError::ConnectionClosed),
        }
    }

    /// Resolves when the current connection is gone.
    pub fn closed(&self) -> impl Future<Output = ()> + Send + 'static {
        let current = self.conn.current.read().expect("connection lock").clone();
        current.closed()
    }

    /// Calls waiting for an answer on the current connection.
    pub fn in_flight(&self) -> usize {
        self.conn
            .current
            .read()
            .expect("connection lock")
            .in_flight()
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.conn.config
    }

    /// A buffer of `len` bytes to fill in place and send as a [`Payload`]
    /// ([`PayloadMut::freeze`]) without a copy: over RDMA it is a buffer of the current
    /// connection's registered pool, which the server then reads straight from (each copy
    /// counts in `PoolCounts::copied_bytes`); over TCP, or when that pool has no buffer free
    /// or the client is not connected, it is zeroed heap memory, sent as any payload is. A
    /// lent buffer's bytes are not zeroed: write all of them. Sent on a later connection (after
    /// a reconnection) it is copied like heap memory. It goes back to the pool when the last
    /// clone of its payload is dropped. The server can read the region it comes from (that is
    /// how it takes the payload): fill it only with what you send on this connection.
    ///
    /// ```no_run
    /// # async fn f(client: rdma_rpc::Client) {
    /// let mut block = client.payload_mut(4096);
    /// block.fill(0xab); // or read a file into it
    /// let block = block.freeze(); // a `Payload`, to pass to a generated client's method
    /// # drop(block);
    /// # }
    /// ```
    pub fn payload_mut(&self, len: usize) -> PayloadMut {
        match self.conn.live() {
            Some(c) => c.payload_mut(len),
            None => PayloadMut::zeroed(len),
        }
    }

    /// The counters of the registered buffer pools of every RDMA connection this client made,
    /// reconnections included (`None` for a client over TCP or over a transport it was handed).
    /// It stays readable after the client is dropped, so that once its connections are gone
    /// one can check that every buffer came back and every region was freed:
    /// `outstanding() == 0 && live_regions == 0`.
    #[cfg(feature = "rdma")]
    pub fn rdma_pools(&self) -> Option<PoolMonitor> {
        self.conn.pools.monitor()
    }

    /// Calls a method by id. See [`rpc_core::Client::call`].
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
        self.call_via(Serde::<C>::new(), Serde::<C>::new(), method, name, args)
    }

    /// As [`call`](Self::call), encoding the arguments through the body path `_encode` and
    /// decoding the result through `_decode` (values of zero-sized types); what generated
    /// clients do, with the paths that [`rpc_core::codec::direct::Probe`] picked for each
    /// method's argument and result types.
    pub fn call_via<E, D, A, R>(
        &self,
        _encode: E,
        _decode: D,
        method: u32,
        name: &'static str,
        args: &A,
    ) -> impl Future<Output = Result<R, RpcError>> + Send + 'static
    where
        E: EncodeBody<A>,
        D: DecodeBody<R> + 'static,
        A: ?Sized,
        R: Send + 'static,
    {
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        let prepared = rpc_core::client::Prepared::encode::<E, A>(method, name, args);
        // Fast path: connected, no extra await (and no handle cloned: the call's future
        // holds the connection itself).
        {
            let c = self.conn.current.read().expect("connection lock");
            if !c.is_closed() && !c.is_going_away() {
                return futures::future::Either::Left(c.send_via::<D, R>(prepared, deadline));
            }
        }
        let conn = self.conn.clone();
        // Boxed: the reconnecting path's future is large, and inline it would make every
        // call's future as large (moved twice per call).
        futures::future::Either::Right(Box::pin(async move {
            let c = match deadline {
                Some(d) => tokio::time::timeout_at(d, conn.get())
                    .await
                    .map_err(|_| RpcError::DeadlineExceeded)??,
                None => conn.get().await?,
            };
            c.send_via::<D, R>(prepared, deadline).await
        }))
    }
}

fn invalid_config(e: ConfigError) -> RpcError {
    RpcError::Unavailable(e.to_string())
}

fn connect_error(endpoint: &Endpoint, e: std::io::Error) -> RpcError {
    match e.kind() {
        std::io::ErrorKind::ConnectionRefused => RpcError::Unavailable(format!(
            "{endpoint}: connection refused (nothing listening?)"
        )),
        _ => RpcError::Io(e),
    }
}

enum AnyListener {
    Tcp(TcpListener),
    // boxed: the RDMA listener is twice the TCP one's size
    #[cfg(feature = "rdma")]
    Rdma(Box<rdma::Listener>),
}

/// A bound server socket, ready to [`serve`](Server::serve) a service.
pub struct Server {
    listener: AnyListener,
    local: Endpoint,
    config: Config,
    shutdown: ShutdownHandle,
    stats: Arc<ServerStats>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("local", &self.local)
            .finish()
    }
}

impl Server {
    /// Binds to `endpoint` (port 0 picks a free one) with the default [`Config`] and the
    /// endpoint's options.
    pub async fn bind(endpoint: &Endpoint) -> Result<Server, RpcError> {
        Server::bind_with(endpoint, Config::default()).await
    }

    /// Binds to `endpoint` with `config` (the endpoint's options apply on top).
    pub async fn bind_with(endpoint: &Endpoint, config: Config) -> Result<Server, RpcError> {
        let config = config
            .with_endpoint_options(endpoint)
            .map_err(invalid_config)?;
        let (listener, local) = match endpoint.scheme() {
            Scheme::Tcp => {
                // Plain text or TLS, as the endpoint's options say.
                let l = TcpListener::bind_endpoint(endpoint, config.clone()).await?;
                let port = l.local_addr()?.port();
                (AnyListener::Tcp(l), endpoint.with_port(port))
            }
            Scheme::Rdma => rdma::bind(endpoint, &config).await?,
            _ => {
                return Err(RpcError::Unavailable(format!(
                    "{endpoint}: transport not built in"
                )))
            }
        };
        tracing::info!(endpoint = %local, "bound");
        Ok(Server {
            listener,
            local,
            config,
            shutdown: ShutdownHandle::new(),
            stats: Arc::default(),
        })
    }

    /// The bound endpoint, with the port actually chosen.
    pub fn local_endpoint(&self) -> Endpoint {
        self.local.clone()
    }

    /// A handle that stops [`serve`](Server::serve) gracefully: no new connections or
    /// calls, calls in flight finish and answer, then it returns.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Live counters (connections, running handlers).
    pub fn stats(&self) -> Arc<ServerStats> {
        self.stats.clone()
    }

    /// The counters of the registered buffer pools of every connection this server accepts
    /// over RDMA (`None` over TCP, which registers no memory). The monitor stays readable
    /// after [`serve`](Server::serve) took the server, so that once the server stopped (or
    /// its runtime was dropped) one can check that every buffer came back and every region was
    /// freed: `outstanding() == 0 && live_regions == 0`.
    #[cfg(feature = "rdma")]
    pub fn rdma_pools(&self) -> Option<PoolMonitor> {
        match &self.listener {
            AnyListener::Tcp(_) => None,
            AnyListener::Rdma(l) => Some(l.pool_monitor()),
        }
    }

    /// Serves `service` on every connection until shut down.
    pub async fn serve<S: rpc_core::Service>(self, service: S) -> Result<(), RpcError> {
        let span = tracing::info_span!("serve", service = S::NAME, endpoint = %self.local);
        let _enter = span.enter();
        drop(_enter);
        match self.listener {
            AnyListener::Tcp(l) => {
                rpc_core::server::serve(l, service, self.config, self.shutdown, self.stats).await
            }
            #[cfg(feature = "rdma")]
            AnyListener::Rdma(l) => {
                rpc_core::server::serve(*l, service, self.config, self.shutdown, self.stats).await
            }
        }
        Ok(())
    }
}

/// Where `rdma://` goes.
mod rdma {
    use super::*;

    #[cfg(feature = "rdma")]
    pub(crate) use transport_rdma::RdmaRpcListener as Listener;

    #[cfg(feature = "rdma")]
    fn rdma_error(endpoint: &Endpoint, e: transport_rdma::RdmaError) -> RpcError {
        if e.is_unavailable() {
            RpcError::Unavailable(format!("{endpoint}: {e}"))
        } else {
            RpcError::Io(std::io::Error::other(format!("{endpoint}: {e}")))
        }
    }

    /// A client's pool counters: created with its first RDMA connection.
    #[cfg(feature = "rdma")]
    #[derive(Default)]
    pub(crate) struct Pools(std::sync::OnceLock<transport_rdma::PoolMonitor>);

    #[cfg(feature = "rdma")]
    impl Pools {
        pub(crate) fn monitor(&self) -> Option<transport_rdma::PoolMonitor> {
            self.0.get().cloned()
        }
    }

    #[cfg(feature = "rdma")]
    pub(crate) async fn connect(
        endpoint: &Endpoint,
        config: Config,
        pools: &Pools,
        connected: &std::sync::atomic::AtomicBool,
    ) -> Result<rpc_core::Client, RpcError> {
        let monitor = pools.0.get_or_init(Default::default).clone();
        let t = transport_rdma::RdmaTransport::connect_endpoint_tracked(
            endpoint,
            config.clone(),
            monitor,
        )
        .await
        .map_err(|e| rdma_error(endpoint, e))?;
        connected.store(true, std::sync::atomic::Ordering::Relaxed);
        rpc_core::Client::handshake(t, config).await
    }

    #[cfg(feature = "rdma")]
    pub(crate) async fn bind(
        endpoint: &Endpoint,
        config: &Config,
    ) -> Result<(AnyListener, Endpoint), RpcError> {
        let l = transport_rdma::RdmaRpcListener::bind_endpoint(endpoint, config.clone())
            .await
            .map_err(|e| rdma_error(endpoint, e))?;
        let port = l.local_addr().port();
        Ok((AnyListener::Rdma(Box::new(l)), endpoint.with_port(port)))
    }

    #[cfg(not(feature = "rdma"))]
    const WHY: &str = "this build has no RDMA transport (built without the `rdma` feature)";

    /// A build without RDMA counts no pools.
    #[cfg(not(feature = "rdma"))]
    #[derive(Default)]
    pub(crate) struct Pools;

    #[cfg(not(feature = "rdma"))]
    pub(crate) async fn connect(
        endpoint: &Endpoint,
        _config: Config,
        _pools: &Pools,
        _connected: &std::sync::atomic::AtomicBool,
    ) -> Result<rpc_core::Client, RpcError> {
        Err(RpcError::Unavailable(format!("{endpoint}: {WHY}")))
    }

    #[cfg(not(feature = "rdma"))]
    pub(crate) async fn bind(
        endpoint: &Endpoint,
        _config: &Config,
    ) -> Result<(AnyListener, Endpoint), RpcError> {
        Err(RpcError::Unavailable(format!("{endpoint}: {WHY}")))
    }
}
