//! tarpc 0.38: bincode (`tokio_serde::formats::Bincode`) over its serde TCP transport
//! (length-delimited frames), payloads as `serde_bytes` byte strings.
//!
//! Its fast path: `TCP_NODELAY` on both ends (tarpc's `serde_transport::tcp` helpers leave
//! Nagle on, so the streams are made here and wrapped with `serde_transport::new`), the frame
//! limit raised from 8 MiB to fit 64 MiB payloads, every accepted request handled on its own
//! task, and payloads that are cheap to clone before a call ([`Blob`]).

use std::net::SocketAddr;

use bytes::Bytes;
use futures::{future, StreamExt};
use tarpc::server::{self, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tarpc::tokio_util::codec::{Framed, LengthDelimitedCodec};
use tarpc::{client, context};
use tokio::net::{TcpListener, TcpStream};

use crate::{err, Blob, Conn, Error, System, MAX_PAYLOAD};

/// Frame limit: the largest payload plus room for the envelope.
pub const MAX_FRAME: usize = MAX_PAYLOAD + (1 << 20);

/// The benchmark service.
#[tarpc::service]
pub trait Bench {
    /// `x + 1`.
    async fn small(x: u64) -> u64;
    /// Length of what came.
    async fn put(data: Blob) -> u64;
    /// `len` bytes cut from one prepared buffer.
    async fn get(len: u64) -> Blob;
}

#[derive(Clone)]
struct BenchImpl {
    data: Bytes,
}

impl Bench for BenchImpl {
    async fn small(self, _: context::Context, x: u64) -> u64 {
        x.wrapping_add(1)
    }

    async fn put(self, _: context::Context, data: Blob) -> u64 {
        data.0.len() as u64
    }

    async fn get(self, _: context::Context, len: u64) -> Blob {
        Blob(self.data.slice(..(len as usize).min(self.data.len())))
    }
}

fn framed(stream: TcpStream) -> Framed<TcpStream, LengthDelimitedCodec> {
    LengthDelimitedCodec::builder()
        .max_frame_length(MAX_FRAME)
        .new_framed(stream)
}

/// A running tarpc server.
pub struct Tarpc {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Tarpc {
    /// Listens on loopback and serves [`Bench`] answering `get` from `src`.
    pub async fn start(src: Bytes) -> Result<Tarpc, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(err)?;
        let addr = listener.local_addr().map_err(err)?;
        let service = BenchImpl { data: src };
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let transport = tarpc::serde_transport::new(framed(stream), Bincode::default());
                let channel = server::BaseChannel::with_defaults(transport);
                let service = service.clone();
                tokio::spawn(channel.execute(service.serve()).for_each(|response| {
                    tokio::spawn(response);
                    future::ready(())
                }));
            }
        });
        Ok(Tarpc { addr, accept })
    }
}

impl System for Tarpc {
    type Conn = BenchClient;

    fn name(&self) -> String {
        "tarpc".into()
    }

    async fn connect(&self) -> Result<BenchClient, Error> {
        let stream = TcpStream::connect(self.addr).await.map_err(err)?;
        stream.set_nodelay(true).map_err(err)?;
        let transport = tarpc::serde_transport::new(framed(stream), Bincode::default());
        Ok(BenchClient::new(client::Config::default(), transport).spawn())
    }

    async fn stop(self) {
        self.accept.abort();
    }
}

impl Conn for BenchClient {
    async fn small(&self) -> Result<(), Error> {
        let y = BenchClient::small(self, context::current(), 41)
            .await
            .map_err(err)?;
        debug_assert_eq!(y, 42);
        Ok(())
    }

    async fn put(&self, data: Bytes) -> Result<(), Error> {
        let len = data.len() as u64;
        let got = BenchClient::put(self, context::current(), Blob(data))
            .await
            .map_err(err)?;
        if got != len {
            return Err(format!("put {len} bytes, server got {got}"));
        }
        Ok(())
    }

    async fn get(&self, len: usize) -> Result<(), Error> {
        let b = BenchClient::get(self, context::current(), len as u64)
            .await
            .map_err(err)?;
        if b.0.len() != len {
            return Err(format!("get {len} bytes, got {}", b.0.len()));
        }
        Ok(())
    }
}
