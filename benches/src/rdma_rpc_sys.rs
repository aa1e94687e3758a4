//! rdma-rpc, through its public API (`#[rdma_service]`, `Server`, generated client), on any
//! endpoint it can bind: `tcp://127.0.0.1:0` here, `rdma://…` in the guest (feature `rdma`).

use bytes::Bytes;
use rdma_rpc::{rdma_service, Endpoint, Payload, RpcError, Server, ShutdownHandle};

use crate::{err, Conn, Error, System};

/// The benchmark service: the same three methods every system serves.
#[rdma_service]
pub trait Bench {
    /// `x + 1`.
    async fn small(&self, x: u64) -> u64;
    /// Length of what came.
    async fn put(&self, data: Payload) -> u64;
    /// `len` bytes, cut from one prepared buffer (no copy on the server).
    async fn get(&self, len: u64) -> Payload;
}

/// The server side of [`Bench`].
pub struct BenchImpl {
    data: Payload,
}

impl Bench for BenchImpl {
    async fn small(&self, x: u64) -> u64 {
        x.wrapping_add(1)
    }

    async fn put(&self, data: Payload) -> u64 {
        data.len() as u64
    }

    async fn get(&self, len: u64) -> Payload {
        self.data.slice(..(len as usize).min(self.data.len()))
    }
}

/// A running rdma-rpc server.
pub struct RdmaRpc {
    name: String,
    endpoint: Endpoint,
    shutdown: ShutdownHandle,
    serving: tokio::task::JoinHandle<Result<(), RpcError>>,
}

impl RdmaRpc {
    /// Binds `bind` (port 0 picks one) and serves [`Bench`] answering `get` from `src`.
    pub async fn start(bind: &str, src: Bytes) -> Result<RdmaRpc, Error> {
        let bind: Endpoint = bind.parse().map_err(err)?;
        let server = Server::bind(&bind).await.map_err(err)?;
        let endpoint = server.local_endpoint();
        let shutdown = server.shutdown_handle();
        let name = match endpoint.scheme() {
            rdma_rpc::Scheme::Tcp => "rdma-rpc".to_owned(),
            other => format!("rdma-rpc/{other:?}").to_lowercase(),
        };
        let serving = tokio::spawn(server.serve(BenchServer::new(BenchImpl {
            data: Payload::from(src),
        })));
        Ok(RdmaRpc {
            name,
            endpoint,
            shutdown,
            serving,
        })
    }

    /// Where it listens.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }
}

impl System for RdmaRpc {
    type Conn = BenchClient;

    fn name(&self) -> String {
        self.name.clone()
    }

    async fn connect(&self) -> Result<BenchClient, Error> {
        BenchClient::connect(&self.endpoint).await.map_err(err)
    }

    async fn stop(self) {
        self.shutdown.shutdown();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), self.serving).await;
    }
}

impl Conn for BenchClient {
    async fn small(&self) -> Result<(), Error> {
        let y = BenchClient::small(self, 41).await.map_err(err)?;
        debug_assert_eq!(y, 42);
        Ok(())
    }

    async fn put(&self, data: Bytes) -> Result<(), Error> {
        let len = data.len() as u64;
        let got = BenchClient::put(self, Payload::from(data))
            .await
            .map_err(err)?;
        if got != len {
            return Err(format!("put {len} bytes, server got {got}"));
        }
        Ok(())
    }

    async fn get(&self, len: usize) -> Result<(), Error> {
        let p = BenchClient::get(self, len as u64).await.map_err(err)?;
        if p.len() != len {
            return Err(format!("get {len} bytes, got {}", p.len()));
        }
        Ok(())
    }
}
