//! ruapc 0.2.0-alpha.7 on TCP: MessagePack (its default), payloads as `serde_bytes` byte
//! strings, request and reply types deriving `schemars::JsonSchema` as it requires, and a
//! client timeout of 60 s instead of its 1 s default (large transfers on a loaded machine).
//!
//! With the `ruapc-rdma` feature it can also run over its RDMA transport ([`RuapcNet::rdma`]):
//! the server listens on TCP as usual (its RDMA bootstrap RPCs travel there; ruapc does not use
//! rdma_cm) with RDMA resources enabled (`SocketPoolConfig::rdma`), limited to one device
//! (`rdma.path.device_filter`) on both sides, and clients reach it through a `tcp+rdma://`
//! endpoint (`Endpoint::rdma(Transport::TCP, …)`): the first call exchanges QP numbers over
//! TCP, then every call goes over the queue pair. Messages above `max_msg_size` (256 KiB) go
//! as "large messages" pulled with RDMA READ (up to 64 MiB); the bulk variant's remote reads
//! and writes become RDMA READ / WRITE.
//!
//! Two variants:
//! - **inline** ([`Ruapc::start`] with `bulk = false`): the payload travels in the message,
//!   like the other systems. ruapc caps a message at 64 MiB (`MAX_MSG_SIZE`, header
//!   included), so a 64 MiB payload cannot go this way.
//! - **bulk** (`bulk = true`): its remote-memory API. `put` attaches a read buffer
//!   (`Client::with_read_buffers`) that the handler pulls with `Context::remote_read`; `get`
//!   attaches write buffers (`Client::with_write_buffers`) that the handler fills with
//!   `Context::remote_write`. On TCP both are reverse RPCs carrying the bytes inline, so one
//!   reverse call is limited by the same 64 MiB cap: the handler moves at most 16 MiB per
//!   operation. Buffers come from ruapc's pool and are prepared once per size and reused,
//!   as a real user of the API would do.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ruapc::{
    Buffer, Client, Context, CopyOp, Endpoint, ResultWithBuffers, Router, Server, SocketPoolConfig,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{err, Blob, Conn, Error, System, MAX_PAYLOAD};

/// ruapc's message limit (`ruapc::msg::frame::MAX_MSG_SIZE`, private): 64 MiB with its 8-byte
/// header; the envelope of a `put` takes a few bytes more.
pub const MAX_INLINE: usize = (64 << 20) - 4096;

/// Bytes moved by one remote-memory operation in the bulk variant (below [`MAX_INLINE`]).
pub const BULK_CHUNK: u64 = 16 << 20;

/// Client response timeout (ruapc's default is 1 s).
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// Arguments of `put`.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct PutReq {
    #[schemars(with = "Vec<u8>")]
    pub data: Blob,
}

/// Result of `get`.
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
pub struct GetRsp {
    #[schemars(with = "Vec<u8>")]
    pub data: Blob,
}

/// The benchmark service.
#[ruapc::service]
pub trait RuaBench {
    /// `x + 1`.
    async fn small(&self, ctx: &Context, x: &u64) -> ruapc::Result<u64>;
    /// Length of what came.
    async fn put(&self, ctx: &Context, req: &PutReq) -> ruapc::Result<u64>;
    /// `len` bytes cut from one prepared buffer.
    async fn get(&self, ctx: &Context, len: &u64) -> ruapc::Result<GetRsp>;
    /// Pulls the caller's read space (`len` bytes) with remote reads; answers its length.
    async fn put_bulk(&self, ctx: &Context, len: &u64) -> ruapc::Result<u64>;
    /// Pushes `len` bytes into the caller's write space with remote writes.
    async fn get_bulk(&self, ctx: &Context, len: &u64) -> ResultWithBuffers<u64>;
}

struct BenchImpl {
    data: Bytes,
    /// Pool buffers kept between calls: receive buffers of `put_bulk`, and the filled source
    /// of `get_bulk`.
    put_bufs: Mutex<Vec<Buffer>>,
    get_bufs: Mutex<Vec<Buffer>>,
}

fn invalid(e: impl std::fmt::Display) -> ruapc::Error {
    ruapc::Error::new(ruapc::ErrorKind::InvalidArgument, e.to_string())
}

/// A pool buffer of at least `len` bytes from `cache`, or a new one from `ctx`'s pool.
fn take_buffer(
    cache: &Mutex<Vec<Buffer>>,
    ctx: &Context,
    len: usize,
    fill: Option<&[u8]>,
) -> ruapc::Result<Buffer> {
    let mut cache = cache.lock().unwrap();
    let found = cache.iter().position(|b| b.capacity() >= len);
    let mut buf = match found {
        Some(i) => cache.swap_remove(i),
        None => {
            drop(cache);
            let mut b = ctx
                .state
                .buffer_pool
                .allocate(len.max(1))
                .map_err(invalid)?;
            if let Some(src) = fill {
                let n = b.capacity().min(src.len());
                b.set_len(n);
                b[..n].copy_from_slice(&src[..n]);
            }
            b
        }
    };
    buf.set_len(len);
    Ok(buf)
}

impl RuaBench for BenchImpl {
    async fn small(&self, _ctx: &Context, x: &u64) -> ruapc::Result<u64> {
        Ok(x.wrapping_add(1))
    }

    async fn put(&self, _ctx: &Context, req: &PutReq) -> ruapc::Result<u64> {
        Ok(req.data.0.len() as u64)
    }

    async fn get(&self, _ctx: &Context, len: &u64) -> ruapc::Result<GetRsp> {
        let len = (*len as usize).min(self.data.len());
        Ok(GetRsp {
            data: Blob(self.data.slice(..len)),
        })
    }

    async fn put_bulk(&self, ctx: &Context, len: &u64) -> ruapc::Result<u64> {
        let total = ctx.remote_read_space()?.total_len();
        if total != *len {
            return Err(invalid(format!("read space of {total} bytes, not {len}")));
        }
        let mut local = vec![take_buffer(&self.put_bufs, ctx, total as usize, None)?];
        let mut off = 0;
        while off < total {
            let n = BULK_CHUNK.min(total - off);
            local = ctx.remote_read(&[CopyOp::new(off, off, n)], local).await?;
            off += n;
        }
        self.put_bufs.lock().unwrap().extend(local);
        Ok(total)
    }

    async fn get_bulk(&self, ctx: &Context, len: &u64) -> ResultWithBuffers<u64> {
        let total = *len;
        let src = take_buffer(&self.get_bufs, ctx, total as usize, Some(&self.data))?;
        let mut local = vec![src];
        let mut witness = ctx.sent_nothing();
        let mut off = 0;
        while off < total {
            let n = BULK_CHUNK.min(total - off);
            let mut sent = ctx.remote_write(&[CopyOp::new(off, off, n)], local).await?;
            local = sent.take_buffers();
            witness.merge(sent);
            off += n;
        }
        self.get_bufs.lock().unwrap().extend(local);
        Ok(witness.reply(total))
    }
}

/// Where and how a ruapc server listens and its clients connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuapcNet {
    /// Address the server listens on (TCP; with RDMA, the bootstrap listener).
    pub ip: IpAddr,
    /// `Some(device)`: RDMA on that device (`tcp+rdma://`; needs the `ruapc-rdma` feature);
    /// `None`: TCP.
    pub rdma_device: Option<String>,
    /// RDMA only: `rdma.polling.poll_spin_us`, how long its poll thread spins after the last
    /// completion before it sleeps on the completion channel (`None`: ruapc's 50 µs).
    pub poll_spin_us: Option<u64>,
}

impl Default for RuapcNet {
    /// TCP on loopback.
    fn default() -> RuapcNet {
        RuapcNet {
            ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            rdma_device: None,
            poll_spin_us: None,
        }
    }
}

impl RuapcNet {
    /// RDMA on `device`, bootstrapped over TCP at `ip` (an address of that device's netdev).
    pub fn rdma(ip: IpAddr, device: &str, poll_spin_us: Option<u64>) -> RuapcNet {
        RuapcNet {
            ip,
            rdma_device: Some(device.to_owned()),
            poll_spin_us,
        }
    }

    /// The socket pool configuration of servers and clients.
    fn config(&self) -> Result<SocketPoolConfig, Error> {
        let config = SocketPoolConfig {
            // Room for the bulk variant's buffers of every size (they are kept for reuse).
            buffer_pool_memory: 1 << 30,
            ..Default::default()
        };
        #[cfg(feature = "ruapc-rdma")]
        let config = {
            let mut config = config;
            // With ruapc's `rdma` feature the default enables RDMA discovery and memory
            // registration on every device; the TCP variant keeps it off, as without the
            // feature.
            config.rdma = self.rdma_device.as_ref().map(|device| {
                let mut rdma = ruapc::rdma::RdmaSocketPoolConfig::default();
                rdma.path.device_filter = vec![device.clone()];
                if let Some(us) = self.poll_spin_us {
                    rdma.polling.poll_spin_us = us;
                }
                rdma
            });
            config
        };
        #[cfg(not(feature = "ruapc-rdma"))]
        if let Some(device) = &self.rdma_device {
            return Err(format!(
                "RDMA on {device}: built without the `ruapc-rdma` feature \
                 (cargo build -p rdma-rpc-benches --features ruapc-rdma)"
            ));
        }
        Ok(config)
    }

    /// The endpoint clients use to reach a server listening on `addr`.
    fn endpoint(&self, addr: SocketAddr) -> Result<Endpoint, Error> {
        if self.rdma_device.is_some() {
            Endpoint::rdma(ruapc::Transport::TCP, [addr]).map_err(err)
        } else {
            Endpoint::tcp([addr]).map_err(err)
        }
    }
}

/// A running ruapc server.
pub struct Ruapc {
    server: Arc<Server>,
    endpoint: Endpoint,
    config: SocketPoolConfig,
    bulk: bool,
}

impl Ruapc {
    /// Listens on loopback (TCP) and serves [`RuaBench`] answering `get` from `src`; `bulk`
    /// picks the remote-memory variant for `put`/`get`.
    pub async fn start(src: Bytes, bulk: bool) -> Result<Ruapc, Error> {
        Ruapc::start_on(&RuapcNet::default(), src, bulk).await
    }

    /// [`Ruapc::start`] on `net`: TCP or RDMA, on the address it names.
    pub async fn start_on(net: &RuapcNet, src: Bytes, bulk: bool) -> Result<Ruapc, Error> {
        let config = net.config()?;
        let mut router = Router::default();
        Arc::new(BenchImpl {
            data: src,
            put_bufs: Mutex::default(),
            get_bufs: Mutex::default(),
        })
        .ruapc_export(&mut router);
        let server = Arc::new(Server::create(router, &config).map_err(err)?);
        #[cfg(feature = "ruapc-rdma")]
        if let Some(device) = &net.rdma_device {
            // Device discovery fails quietly (no device: TCP only); say so now rather than at
            // the first call.
            let found: Vec<String> = server
                .state()
                .devices
                .devices()
                .iter()
                .map(|d| d.info().name.clone())
                .collect();
            if !found.iter().any(|n| n == device) {
                server.stop();
                return Err(format!(
                    "RDMA device {device} not found or not usable by ruapc (found: {found:?})"
                ));
            }
        }
        let addr = server
            .listen(SocketAddr::new(net.ip, 0))
            .await
            .map_err(err)?;
        Ok(Ruapc {
            server,
            endpoint: net.endpoint(addr)?,
            config,
            bulk,
        })
    }
}

/// One ruapc connection: its own client state (`Context::create` makes a new socket pool, so
/// each `RuapcConn` has its own TCP connection, or its own RDMA device context, queue pair and
/// poll thread).
#[derive(Clone)]
pub struct RuapcConn {
    ctx: Context,
    client: Arc<Client>,
    bulk: bool,
    read_bufs: Arc<Mutex<Vec<(usize, Buffer)>>>,
    write_bufs: Arc<Mutex<Vec<Buffer>>>,
}

impl System for Ruapc {
    type Conn = RuapcConn;

    fn name(&self) -> String {
        let name = if self.bulk { "ruapc-bulk" } else { "ruapc" };
        if self.endpoint.transport() == ruapc::Transport::RDMA {
            format!("{name}/rdma")
        } else {
            name.to_owned()
        }
    }

    fn does_small_calls(&self) -> bool {
        !self.bulk
    }

    fn max_payload(&self) -> usize {
        if self.bulk {
            MAX_PAYLOAD
        } else {
            MAX_INLINE
        }
    }

    async fn connect(&self) -> Result<RuapcConn, Error> {
        let ctx = Context::create(&self.config)
            .map_err(err)?
            .with_endpoint(self.endpoint.clone());
        let conn = RuapcConn {
            ctx,
            client: Arc::new(Client {
                timeout: TIMEOUT,
                ..Default::default()
            }),
            bulk: self.bulk,
            read_bufs: Arc::default(),
            write_bufs: Arc::default(),
        };
        // Connect now, not in the first measured call.
        Conn::small(&conn).await?;
        Ok(conn)
    }

    async fn stop(self) {
        self.server.stop();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.server.join()).await;
    }
}

impl RuapcConn {
    /// A read buffer holding `data` (prepared once per length, then reused).
    fn read_buffer(&self, data: &Bytes) -> Result<Buffer, Error> {
        let mut cache = self.read_bufs.lock().unwrap();
        // The workloads always put a prefix of the same source, so the length is the key.
        if let Some(i) = cache.iter().position(|(len, _)| *len == data.len()) {
            return Ok(cache.swap_remove(i).1);
        }
        drop(cache);
        let mut b = self
            .ctx
            .state
            .buffer_pool
            .allocate(data.len().max(1))
            .map_err(err)?;
        b.set_len(data.len());
        b.copy_from_slice(data);
        Ok(b)
    }
}

impl Conn for RuapcConn {
    async fn small(&self) -> Result<(), Error> {
        let y = RuaBench::small(&*self.client, &self.ctx, &41)
            .await
            .map_err(err)?;
        debug_assert_eq!(y, 42);
        Ok(())
    }

    async fn put(&self, data: Bytes) -> Result<(), Error> {
        let len = data.len();
        let got = if self.bulk {
            let buf = self.read_buffer(&data)?;
            let mut with = self.client.with_read_buffers(vec![buf]);
            let got = RuaBench::put_bulk(&with, &self.ctx, &(len as u64))
                .await
                .map_err(err)?;
            if let Some(bufs) = with.take_read_buffers() {
                self.read_bufs
                    .lock()
                    .unwrap()
                    .extend(bufs.into_iter().map(|b| (len, b)));
            }
            got
        } else {
            let req = PutReq { data: Blob(data) };
            RuaBench::put(&*self.client, &self.ctx, &req)
                .await
                .map_err(err)?
        };
        if got != len as u64 {
            return Err(format!("put {len} bytes, server got {got}"));
        }
        Ok(())
    }

    async fn get(&self, len: usize) -> Result<(), Error> {
        let got = if self.bulk {
            let buf = {
                let mut cache = self.write_bufs.lock().unwrap();
                cache
                    .iter()
                    .position(|b| b.capacity() >= len)
                    .map(|i| cache.swap_remove(i))
            };
            let mut buf = match buf {
                Some(b) => b,
                None => self
                    .ctx
                    .state
                    .buffer_pool
                    .allocate(len.max(1))
                    .map_err(err)?,
            };
            buf.set_len(len);
            let with = self.client.with_write_buffers(vec![buf]);
            let (got, bufs) = RuaBench::get_bulk(&with, &self.ctx, &(len as u64))
                .await
                .map_err(err)?
                .into_parts();
            self.write_bufs.lock().unwrap().extend(bufs);
            got as usize
        } else {
            RuaBench::get(&*self.client, &self.ctx, &(len as u64))
                .await
                .map_err(err)?
                .data
                .0
                .len()
        };
        if got != len {
            return Err(format!("get {len} bytes, got {got}"));
        }
        Ok(())
    }
}
