//! The protocol of [rdma-rpc](https://docs.rs/rdma-rpc), free of I/O: wire format, codec,
//! request/response multiplexing, credits, deadlines and cancellation, and the traits that
//! transports implement.
//!
//! Most users depend on the `rdma-rpc` crate, which re-exports what they need from here and
//! picks a transport from an [`Endpoint`]. This crate is what a transport is written against:
//! a [`Transport`] moves [`wire::Message`]s; [`Client`] and [`server::serve`] run the protocol
//! over any of them.
//!
//! # Example
//! A call over the in-process transport ([`mem`]), with a hand-written [`Service`] (generated
//! services from `#[rdma_service]` look like this underneath):
//! ```
//! use rpc_core::codec::Bincode;
//! use rpc_core::server::{self, Reply, Request, Service, ShutdownHandle};
//! use rpc_core::{mem, Client, Config, ServerError};
//!
//! struct Doubler;
//! impl Service for Doubler {
//!     const NAME: &'static str = "Doubler";
//!     fn method_name(&self, m: u32) -> Option<&'static str> {
//!         (m == 1).then_some("Doubler.double")
//!     }
//!     async fn dispatch(&self, _m: u32, req: Request) -> Result<Reply, ServerError> {
//!         let (x,): (u64,) = req.decode::<Bincode, _>("Doubler.double")?;
//!         Reply::encode::<Bincode, _>(&(2 * x))
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let (listener, connector) = mem::listener();
//! let shutdown = ShutdownHandle::new();
//! tokio::spawn(server::serve(listener, Doubler, Config::default(), shutdown.clone(), Default::default()));
//! let client = Client::new(connector.connect().await.unwrap(), Config::default());
//! let y: u64 = client.call::<Bincode, _, _>(1, "Doubler.double", &(21u64,)).await.unwrap();
//! assert_eq!(y, 42);
//! shutdown.shutdown();
//! # }
//! ```
#![forbid(unsafe_code)]

pub mod client;
pub mod codec;
mod config;
mod conn;
mod endpoint;
mod error;
pub mod ids;
pub mod mem;
pub mod payload;
pub mod permits;
pub mod pool;
pub mod rendezvous;
pub mod server;
pub mod transport;
pub mod wire;

pub use crate::client::Client;
pub use crate::codec::{Bincode, Codec, CodecError};
pub use crate::config::{Config, ConfigError, Secret};
pub use crate::endpoint::{Endpoint, EndpointParseError, Scheme};
pub use crate::error::{RpcError, ServerError, ServerErrorKind};
pub use crate::payload::{Payload, PayloadMut};
pub use crate::server::{Reply, Request, Service, ShutdownHandle};
pub use crate::transport::{DirectSend, LentFrame, Listener, ResponseShortcut, Transport};

/// The id of method `"Service.method"` on the wire: FNV-1a (32 bit) of the full name.
/// `#[rdma_service]` checks at compile time that one service's ids are distinct.
pub const fn method_id(full_name: &str) -> u32 {
    let bytes = full_name.as_bytes();
    let mut hash: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u32;
        hash = hash.wrapping_mul(0x0100_0193);
        i += 1;
    }
    hash
}
