//!
//! TLS (rustls, with the *ring* provider) protects `tcp://` connections; the `tls` cargo
//! feature, on by default, builds it in. Endpoint options turn it on, so a configuration file
//! switches it with no code change:
//!
//! | side | options | meaning |
//! | --- | --- | --- |
//! | server | `tls_cert=PATH&tls_key=PATH` | serve TLS with this PEM certificate chain (leaf first) and private key |
//! | server | `tls_client_ca=PATH` | also require a client certificate issued by these CAs (mutual TLS) |
//! | client | `tls=1&tls_ca=PATH` | connect with TLS, trusting only the CAs in this PEM file (there are no system roots) |
//! | client | `tls_name=NAME` | the name the server's certificate must carry (default: the endpoint's host) |
//! | client | `tls_cert=PATH&tls_key=PATH` | present this client certificate |
//!
//! ```no_run
//! # async fn f() -> Result<(), rdma_rpc::RpcError> {
//! use rdma_rpc::{Client, Endpoint, Server};
//! let listen: Endpoint = "tcp://0.0.0.0:7000?tls_cert=/etc/svc/cert.pem&tls_key=/etc/svc/key.pem"
//!     .parse()
//!     .unwrap();
//! let _server = Server::bind(&listen).await?;
//! let peer: Endpoint = "tcp://svc.example:7000?tls=1&tls_ca=/etc/svc/ca.pem".parse().unwrap();
//! let _client = Client::connect(&peer).await?;
//! # Ok(()) }
//! ```
//!
//! Bad options fail when binding or connecting, never later and never with a panic: an
//! unreadable file, a file without a certificate or key, `tls=1` without `tls_ca`, and also
//! anything ambiguous (a client's `tls_*` option without `tls=1`, an option of the other side,
//! a misspelt `tls_*` option) rather than falling back to plain text. Such errors, like a
//! failed handshake, come back as [`RpcError::Io`] whose message says which option or which
//! TLS check failed. A client reads its files again at each reconnection, picking up renewed
//! certificates.
//!
//! On the server the handshake runs in each connection's own task, bounded by
//! [`Config::connect_timeout`]: a peer that fails it (plain text, an untrusted certificate, no
//! client certificate under mutual TLS) is dropped before any frame is read or any handler
//! runs, and the server goes on serving the others.
//!
//! To configure rustls in code instead, bind with [`Server::bind_tls`] and a
//! [`ServerTls`](crate::tls::ServerTls).
//! (Clients take TLS from their endpoint only, so that it also applies when they reconnect.)

use std::fmt;
use std::path::Path;
use std::sync::Arc;

pub use transport_tcp::tls::{provider, rustls};

use crate::{invalid_config, AnyListener, Config, Endpoint, RpcError, Scheme, Server};
use rpc_core::ShutdownHandle;
use transport_tcp::TcpListener;

/// A server's TLS settings for [`Server::bind_tls`]: a shared [`rustls::ServerConfig`].
#[derive(Clone)]
pub struct ServerTls(Arc<rustls::ServerConfig>);

impl ServerTls {
    /// Settings you built with rustls (use [`provider`] for its crypto provider).
    pub fn new(config: Arc<rustls::ServerConfig>) -> ServerTls {
        ServerTls(config)
    }

    /// Settings from PEM files: the certificate chain (leaf first), its private key and, to
    /// require client certificates, the CAs that issue them. The same as the endpoint options
    /// `tls_cert`, `tls_key` and `tls_client_ca`.
    pub fn from_pem_files(
        cert: impl AsRef<Path>,
        key: impl AsRef<Path>,
        client_ca: Option<&Path>,
    ) -> Result<ServerTls, RpcError> {
        Ok(ServerTls(transport_tcp::tls::server_config(
            cert.as_ref(),
            key.as_ref(),
            client_ca,
        )?))
    }

    /// The rustls configuration.
    pub fn config(&self) -> &Arc<rustls::ServerConfig> {
        &self.0
    }
}

impl From<Arc<rustls::ServerConfig>> for ServerTls {
    fn from(config: Arc<rustls::ServerConfig>) -> ServerTls {
        ServerTls(config)
    }
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls").finish_non_exhaustive()
    }
}

impl Server {
    /// Binds a TLS server to the `tcp://` `endpoint` with `config` (the endpoint's protocol
    /// options apply on top), its TLS settings coming from `tls` rather than endpoint options;
    /// an endpoint that has `tls*` options too is refused, as ambiguous.
    pub async fn bind_tls(
        endpoint: &Endpoint,
        config: Config,
        tls: ServerTls,
    ) -> Result<Server, RpcError> {
        if endpoint.scheme() != Scheme::Tcp {
            return Err(RpcError::Unavailable(format!(
                "{endpoint}: TLS is for tcp:// endpoints"
            )));
        }
        if let Some((k, _)) = endpoint.options().find(|(k, _)| k.starts_with("tls")) {
            return Err(RpcError::Unavailable(format!(
                "{endpoint}: option {k} given to Server::bind_tls, which takes its TLS settings \
                 from its ServerTls"
            )));
        }
        let config = config
            .with_endpoint_options(endpoint)
            .map_err(invalid_config)?;
        let l = TcpListener::bind_tls(endpoint.authority(), config.clone(), tls.0).await?;
        let local = endpoint.with_port(l.local_addr()?.port());
        tracing::info!(endpoint = %local, "bound (TLS)");
        Ok(Server {
            listener: AnyListener::Tcp(l),
            local,
            config,
            shutdown: ShutdownHandle::new(),
            stats: Arc::default(),
        })
    }
}
