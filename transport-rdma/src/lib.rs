//! RDMA verbs transport of rdma-rpc.
//!
//! Connections are reliable-connected queue pairs set up with rdma_cm. Small messages go by SEND
//! into receive slots the peer posted in advance; large data by one-sided RDMA WRITE / READ of
//! registered buffers. Completions reach tokio through the completion channel's fd (`AsyncFd`),
//! after a short busy-poll.
//!
//! rdma-core is loaded at run time: where it is missing, or there is no RDMA device, every entry
//! point returns [`RdmaError::Unavailable`] (never a panic), so one binary serves TCP anywhere.
//!
//! All `unsafe` code is in the private `verbs` module.
#![deny(unsafe_code)]

mod cm;
mod conn;
mod error;
mod rpc;
#[allow(unsafe_code)]
mod verbs;

use std::time::Duration;

pub use conn::{
    FrozenBuffer, PendingConnection, RdmaBuffer, RdmaConnection, RdmaListener, RemoteAccess,
    RemoteExposure, RemoteToken, SendCompletion,
};
pub use error::RdmaError;
pub use rpc::{resolve, RdmaReader, RdmaRpcListener, RdmaTransport, RdmaWriter};

/// The transport family of an RDMA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// InfiniBand or RoCE (e.g. Soft-RoCE `rxe`)
    InfiniBand,
    /// iWARP (e.g. soft-iWARP `siw`): no RDMA WRITE with immediate, no atomics
    IWarp,
    /// anything else
    Other,
}

/// An RDMA device of this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// its name, e.g. `rxe0`
    pub name: String,
    /// its transport family
    pub transport: TransportKind,
}

/// Lists the RDMA devices; [`RdmaError::Unavailable`] when rdma-core is missing or there is none.
pub fn devices() -> Result<Vec<DeviceInfo>, RdmaError> {
    let list = verbs::list_devices()?;
    if list.is_empty() {
        return Err(RdmaError::Unavailable(
            "no RDMA device on this machine".into(),
        ));
    }
    Ok(list
        .into_iter()
        .map(|(name, t)| DeviceInfo {
            name,
            transport: match t {
                verbs::Transport::InfiniBand => TransportKind::InfiniBand,
                verbs::Transport::IWarp => TransportKind::IWarp,
                verbs::Transport::Other => TransportKind::Other,
            },
        })
        .collect())
}

/// Whether RDMA can be used here (rdma-core loads and at least one device exists).
pub fn is_available() -> bool {
    devices().is_ok()
}

/// Tuning of a connection.
#[derive(Debug, Clone)]
pub struct RdmaOptions {
    /// receive slots posted per connection (how many messages the peer may send ahead)
    pub recv_slots: usize,
    /// SEND buffers per connection (messages in flight)
    pub send_slots: usize,
    /// size of a slot: the largest message
    pub slot_size: usize,
    /// how long the completion driver keeps polling after activity before it sleeps on the
    /// completion channel (0: never spin)
    pub busy_poll: Duration,
    /// limit for address/route resolution and connection establishment
    pub connect_timeout: Duration,
    /// if set, connections must run on this RDMA device (e.g. `rxe0`), else they fail
    pub device: Option<String>,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            recv_slots: 32,
            send_slots: 32,
            // 8 KiB eager messages (rpc-core's default threshold) plus packet headers
            slot_size: 16 * 1024,
            busy_poll: Duration::from_micros(50),
            connect_timeout: Duration::from_secs(10),
            device: None,
        }
    }
}
