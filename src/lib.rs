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
use std::sync::Arc;
use std::time::Duration;

pub use rpc_core::{
    Codec, CodecError, Config, ConfigError, Endpoint, EndpointParseError, Payload, RpcError,
    Scheme, Secret, ServerError, ServerErrorKind, ShutdownHandle,
};
pub use rpc_macros::rdma_service;

use rpc_core::server::ServerStats;
use serde::de::DeserializeOwned;
use serde::Serialize;
use transport_tcp::{TcpListener, TcpTransport};

/// Codecs for message bodies: [`Bincode`](codec::Bincode) by default, or your own
/// [`Codec`](codec::Codec) named in `#[rdma_service(codec = …)]`.
pub mod codec {
    pub use rpc_core::codec::{Bincode, Codec, CodecError};
}

/// Lower layers, for writing transports or services by hand.
pub mod core {
    pub use rpc_core::*;
}

/// Used by the code `#[rdma_service]` generates; not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use rpc_core::{method_id, Reply, Request, ServerError, Service};
}

/// A connection to a server, shared by cheap clones. Generated clients wrap one; use it
/// directly to choose a [`Config`] ([`Client::connect_with`]) and hand it to
/// `FooClient::from_client`.
#[derive(Clone)]
pub struct Client {
    inner: rpc_core::Client,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl Client {
    /// Connects to `endpoint` with the default [`Config`] and the endpoint's options.
    pub async fn connect(endpoint: &Endpoint) -> Result<Client, RpcError> {
        let config = Config::from_endpoint(endpoint).map_err(invalid_config)?;
        Client::connect_with(endpoint, config).await
    }

    /// Connects to `endpoint` with `config` (the endpoint's options still apply on top).
    pub async fn connect_with(endpoint: &Endpoint, config: Config) -> Result<Client, RpcError> {
        let config = config
            .with_endpoint_options(endpoint)
            .map_err(invalid_config)?;
        let span = tracing::info_span!("connect", %endpoint);
        let _enter = span.enter();
        let timeout = config.connect_timeout;
        let connecting = async {
            match endpoint.scheme() {
                Scheme::Tcp => {
                    let t = TcpTransport::connect(endpoint.authority(), config.clone())
                        .await
                        .map_err(|e| connect_error(endpoint, e))?;
                    rpc_core::Client::handshake(t, config.clone()).await
                }
                Scheme::Rdma => rdma::connect(endpoint, config.clone()).await,
                _ => Err(RpcError::Unavailable(format!(
                    "{endpoint}: transport not built in"
                ))),
            }
        };
        drop(_enter);
        let inner = tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| {
                RpcError::Unavailable(format!("{endpoint}: no connection within {timeout:?}"))
            })??;
        Ok(Client { inner })
    }

    /// Starts the protocol over a connection you made yourself (any [`core::Transport`]).
    pub fn from_transport<T: rpc_core::Transport>(transport: T, config: Config) -> Client {
        Client {
            inner: rpc_core::Client::new(transport, config),
        }
    }

    /// A handle on the same connection whose calls fail with
    /// [`RpcError::DeadlineExceeded`] after `timeout`; the server drops the work then too.
    pub fn with_timeout(&self, timeout: Duration) -> Client {
        Client {
            inner: self.inner.with_timeout(timeout),
        }
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Resolves when the connection is gone.
    pub fn closed(&self) -> impl Future<Output = ()> + Send + 'static {
        self.inner.closed()
    }

    /// Calls waiting for an answer on this connection.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    /// The protocol-level client.
    pub fn as_core(&self) -> &rpc_core::Client {
        &self.inner
    }

    /// Calls a method by id; what generated clients do. See [`rpc_core::Client::call`].
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
        self.inner.call::<C, A, R>(method, name, args)
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
    #[cfg(feature = "rdma")]
    #[allow(dead_code)]
    Rdma(rdma::Listener),
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
                let l = TcpListener::bind(endpoint.authority(), config.clone()).await?;
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
                rpc_core::server::serve(l, service, self.config, self.shutdown, self.stats).await
            }
        }
        Ok(())
    }
}

/// Where `rdma://` goes.
mod rdma {
    use super::*;

    #[cfg(feature = "rdma")]
    pub(crate) use rpc_core::mem::MemListener as Listener;

    #[cfg(not(feature = "rdma"))]
    const WHY: &str = "this build has no RDMA transport (built without the `rdma` feature)";
    #[cfg(feature = "rdma")]
    const WHY: &str = "the RDMA transport is not wired up in this build yet";

    pub(crate) async fn connect(
        endpoint: &Endpoint,
        _config: Config,
    ) -> Result<rpc_core::Client, RpcError> {
        Err(RpcError::Unavailable(format!("{endpoint}: {WHY}")))
    }

    pub(crate) async fn bind(
        endpoint: &Endpoint,
        _config: &Config,
    ) -> Result<(AnyListener, Endpoint), RpcError> {
        Err(RpcError::Unavailable(format!("{endpoint}: {WHY}")))
    }
}
