//! RDMA verbs transport of rdma-rpc.
//!
//! Connections are reliable-connected queue pairs set up with rdma_cm, which negotiates how many
//! RDMA READs each side may have in flight ([`RdmaOptions::read_depth`]); the bytes of READs and
//! WRITEs in flight are bounded apart from that ([`RdmaOptions::inflight_bytes`]). Small
//! messages go by SEND into receive slots the peer posted in advance (inline, copied into the
//! work request as it is posted, up to [`RdmaOptions::max_inline`]); large data by one-sided
//! RDMA WRITE / READ of registered buffers. Completions reach tokio through the completion channel's fd (`AsyncFd`),
//! after a busy-poll whose window follows the connection's round trip
//! ([`RdmaOptions::busy_poll`], [`RdmaOptions::busy_poll_max`]): a connection whose calls follow
//! each other keeps polling across its round trip, an idle one sleeps. A task waiting for an
//! RDMA READ or WRITE polls for it only if the connection's recent transfers took less than
//! that window for their size; a longer one it leaves to the completion driver, so a large
//! transfer's wait does not take a CPU (on a soft device, the device's own). A server may let its
//! drivers poll in bursts without handing back to the runtime ([`RdmaOptions::poll_burst`],
//! off by default).
//!
//! rdma-core is loaded at run time: where it is missing, or there is no RDMA device, every entry
//! point returns [`RdmaError::Unavailable`] (never a panic), so one binary serves TCP anywhere.
//!
//! All `unsafe` code is in the private `verbs` module.
//!
//! # Buffer pools
//!
//! Each connection registers two regions once, each carved into buffers by an
//! [`rpc_core::pool::Pool`] (size classes, bounded total; nothing is registered per message):
//! the receive slots when it is set up, the rendezvous pool on its first rendezvous (so that a
//! connection that only ever carries small messages costs its receive slots alone):
//! - the *slot pool* (local access only: no key ever leaves the host): the posted receive slots,
//!   twice as many buffers as [`RdmaOptions::recv_slots`]. A message of more than 256 bytes is
//!   handed up as a view of the slot it arrived in (an eager [`rpc_core::Payload`] is a slice
//!   of it, no copy) and a fresh slot is posted in its place; the slot returns to the pool when
//!   the last view is dropped. If handlers hold every spare slot, the message is copied and its
//!   slot reposted, so credits never stall on a handler. A message of at most 256 bytes is
//!   copied out at once into heap memory shared by many such copies, and its own slot is
//!   posted again: for so few bytes the copy costs less than a view (a fresh slot leased, an
//!   owner allocated, the slot's return), and a small message held long pins no slot. Before
//!   that copy, a small message is read where it lies: a lone call's caller that polls for
//!   its own answer decodes it in the slot (`rpc_core::DirectSend::progress_with`), and a
//!   server takes a request it can run at once, copying out only its body and attachments
//!   (`rpc_core::ResponseShortcut::offer_frame`).
//! - the *rendezvous pool* ([`RdmaOptions::pool_classes`], 15 MiB by default): sources of
//!   our pull transfers (an attachment is copied into a pool buffer, unless it already is a
//!   view of this connection's pool, e.g. a payload received on it and echoed back, which is
//!   exposed as it is) and sinks of the peer's (the RDMA READ lands in a pool buffer, and the
//!   received [`rpc_core::Payload`] is a view of it, returned to the pool when dropped); for
//!   push transfers, the sources we RDMA-WRITE from and the buffers we grant the peer to
//!   write into (delivered as views in the same way). An attachment larger than the pool's
//!   largest class gets a region of its own (its size rounded up to a power of two;
//!   read-exposed for a pull source or READ sink, write-exposed for a push grant), kept for
//!   the next such attachment, up to [`RdmaOptions::large_buffer_bytes`] per connection (free
//!   ones are dropped to make room).
//!   When the pool cannot lend (exhausted, or a large attachment finds no kept region and no
//!   room for one) a buffer is registered for that transfer alone rather than waiting (two
//!   peers waiting for each other's `Fin` could deadlock);
//!   [`PoolCounts::fallback_registrations`] counts those. The
//!   ones registered for the peer's transfers into us (pull sinks, push grants, until the
//!   payloads received in them are dropped) are bounded per connection by
//!   [`RdmaOptions::max_fallback_bytes`]: a transfer beyond it waits, in a task of its own,
//!   until earlier payloads are dropped, so no peer can make a connection register more
//!   ([`PoolCounts::fallback_bytes`], `fallback_bytes_peak`).
//!
//! **Cancel safety.** A posted work request owns its buffer (moved into the QP's in-flight
//! table) until its completion is polled or the QP is destroyed; a dropped call, a dropped
//! future or a failed connection never returns to the pool a buffer the device may still
//! write. Our rendezvous sources stay out of the pool until the peer's `Fin`, or until the
//! connection is closed and its QP is in the error state (no more READs are served).
//!
//! **Remote access, and its trade-off.** Per-transfer narrowing of one pre-registered region
//! needs memory windows, which siw does not have; re-registering per transfer is what the pools
//! exist to avoid. So the pools are per connection, on the connection's own protection domain
//! (one PD per connection): a key is only ever sent to that connection's peer and is only
//! valid on that connection's QP (a key used on another connection fails: see the
//! `forged_keys_hurt_only_their_own_connection` guest test). Within a connection a key covers
//! a whole region for the connection's life, so the rendezvous pool is split by what the peer
//! may do with it, each part registered on its first use:
//! - a *read-exposed* region (`REMOTE_READ` only): our outbound sources, and the sinks of our
//!   RDMA READs. No key a peer holds lets it write into what we send it, nor into a payload we
//!   received by pull once delivered to a handler. InfiniBand/RoCE need no remote access on a
//!   READ's sink; iWARP places READ responses through the sink's STag, so there the one sink
//!   buffer is registered `REMOTE_WRITE` for that READ alone and deregistered before the
//!   payload is handed on: on iWARP each pooled pull costs one `ibv_reg_mr`, the price of that
//!   guarantee.
//! - a *write-exposed* region (`REMOTE_WRITE` only, never exposed for reading): the buffers we
//!   grant to the peer's pushes. What remains wider than "one buffer, one transfer": a buffer
//!   granted to a push stays writable by that peer after its `PushDone`, while a handler holds
//!   the payload in it, so a misbehaving peer can change data it pushed after a handler checked
//!   it, on its own connection only. A service that must not trust its peers past the check
//!   receives by pull (the default: `push_up_to = 0`) or copies pushed payloads.
//!
//! Memory is never freed or reused while an MR covers it: regions are deregistered before they
//! are freed, and only once every buffer of them is back. [`PoolMonitor`] (from
//! [`RdmaTransport::pool_monitor`], [`RdmaRpcListener::pool_monitor`],
//! [`RdmaConnection::pool_monitor`]) counts leases, returns and live regions, so tests can
//! prove every buffer came back.
//!
//! Sending without a copy: a payload that is not in the connection's registered memory is
//! copied into a pool buffer before it goes ([`PoolCounts::copied_bytes`] counts those bytes).
//! A client fills its payload in a buffer the connection lends instead
//! (`rpc_core::Client::payload_mut`, the same on the facade's `Client`): a pool buffer for
//! sources, in the read-exposed region, which the peer READs from where it is (or which we
//! WRITE from where it is, under sender-push). A payload received by pull is such a buffer too,
//! and so is one received by push into a pool buffer, so echoing or forwarding it on the same
//! connection copies nothing either: a push source is WRITten from any of the connection's
//! rendezvous regions (a WRITE's source needs no remote access), while only the read-exposed
//! one is ever offered to the peer for reading.
//!
//! # Credits and windows
//!
//! A sender never SENDs into a receive queue that has no buffer posted for it (on iWARP that
//! would end the connection; on InfiniBand/RoCE it would stall in RNR retries): each side
//! grants the other a window of receive slots, and credits come back as slots are reposted
//! ([`rpc_core::rendezvous::Credits`]). Windows are granted, not assumed: each side may send 2
//! packets at first, and its first packet grants the peer the rest of its window. The
//! connecting side speaks first; the accepting side sends nothing until it has heard from it,
//! as iWARP requires (siw fails the connecting side's set-up with `EINVAL` when a packet
//! arrives before it has read the MPA reply: seen under load before this rule, 1–3 failed
//! connections in each run of the suites on siw; none in 3 runs after).
//!
//! # Shared receive queue
//!
//! With [`RdmaOptions::srq_slots`] set, a listener's connections on one device receive from a
//! single shared receive queue of that many slots, registered once, instead of posting
//! `recv_slots` each: the server's receive memory does not grow with its connections (the
//! `shared_receive_queue_many_connections` guest test holds 256 connections on rxe with the same
//! registered memory as one). Slots are posted back to the queue as soon as a message is
//! taken out (a fresh one, or the same one after a copy if handlers hold every spare), whoever
//! reads the message, so the queue always holds every slot.
//!
//! The windows of all its connections together never exceed the queue
//! ([`rpc_core::rendezvous::RecvBudget`]), so no SEND ever finds it empty, on iWARP too: a
//! connection is admitted with a window of 2 (refused when 2 slots are not free), and a sender
//! blocked on credits says so in its next packet, on which the server lends it half its window
//! again (up to `recv_slots`) while more than an eighth of the queue stays free. When less
//! is free, every connection gives back the slots it is owed back (never below 2) as it
//! consumes packets. An idle connection holds 2 slots; a connection that was busy and fell
//! silent keeps what it borrowed until it next sends.
//!
//! **What it costs.** A shared receive queue belongs to one protection domain, so its
//! connections share one PD: the keys of their rendezvous regions are valid on any of those
//! connections' QPs, and a peer that learns or guesses a key another connection was lent can
//! use it, which the per-connection PD (the default) rules out (memory windows bound to one QP
//! would restore it; siw has none). Use it where the peers are trusted to that degree, or where
//! the number of connections matters more.
#![deny(unsafe_code)]

mod cm;
mod conn;
mod error;
mod inbox;
mod pool;
mod probe;
mod rpc;
#[allow(unsafe_code)]
mod verbs;

use std::time::Duration;

pub use conn::{
    FrozenBuffer, PendingConnection, RdmaBuffer, RdmaConnection, RdmaListener, RemoteAccess,
    RemoteExposure, RemoteToken, SendCompletion, SharedReceiveMonitor, SharedReceiveStats,
};
pub use error::RdmaError;
pub use pool::{PoolCounts, PoolMonitor};
pub use rpc::{resolve, RdmaReader, RdmaRpcListener, RdmaTransport, RdmaWriter};
pub use rpc_core::pool::SizeClass;

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

/// The default of [`RdmaOptions::push_up_to`]: 0, receiver-pull at every size. Measured in the
/// guest (README, "RDMA"): pull was as fast or faster from 16 KiB to 256 KiB on rxe and siw
/// (one round trip fewer before the data moves), and at 1 MiB faster on rxe and ~15% slower
/// on siw.
pub const DEFAULT_PUSH_UP_TO: u64 = 0;

/// The default of [`RdmaOptions::large_buffer_bytes`]: 64 MiB (two 16 MiB transfers each way,
/// or one 64 MiB).
pub const DEFAULT_LARGE_BUFFER_BYTES: u64 = 64 << 20;

/// The default of [`RdmaOptions::max_fallback_bytes`]: 256 MiB (raised to the config's
/// `max_message_size`, 1 GiB by default).
pub const DEFAULT_MAX_FALLBACK_BYTES: u64 = 256 << 20;

/// The default of [`RdmaOptions::read_depth`]: 8 RDMA READs in flight each way, as many as a
/// connection keeps one-sided operations in flight (several large payloads pulled at once each
/// have their READ on the wire; with one, they queue behind each other).
pub const DEFAULT_READ_DEPTH: u8 = 8;

/// RDMA READs in flight on a connection, each way: what rdma_cm negotiated for it
/// ([`RdmaConnection::read_depth`], bounded by [`RdmaOptions::read_depth`] and the device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadDepth {
    /// READs a side serves for its peer at once (responder resources)
    pub responder: u8,
    /// READs a side has outstanding to its peer at once (initiator depth)
    pub initiator: u8,
}

impl ReadDepth {
    /// One READ in flight each way: what a peer that says nothing of its depths gets.
    pub const ONE: ReadDepth = ReadDepth {
        responder: 1,
        initiator: 1,
    };

    /// What an accepting side answers to a request that offered `offer`, with at most `limit`
    /// each way: it serves no more READs than the peer will issue, and issues no more than the
    /// peer serves (librdmacm's rules for `rdma_accept`); at least one each way, as every
    /// connection of this crate both pulls and is pulled from.
    pub(crate) fn accepting(limit: u8, offer: ReadDepth) -> ReadDepth {
        ReadDepth {
            responder: limit.min(offer.initiator).max(1),
            initiator: limit.min(offer.responder).max(1),
        }
    }

    /// What a connecting side that offered `limit` each way uses once the peer's answer is
    /// `answer`: it serves what it offered, and issues no more than the peer serves.
    pub(crate) fn connecting(limit: u8, answer: ReadDepth) -> ReadDepth {
        ReadDepth {
            responder: limit,
            initiator: limit.min(answer.responder).max(1),
        }
    }
}

/// The default of [`RdmaOptions::inflight_bytes`]: 16 MiB of RDMA READs and WRITEs in flight
/// per connection (one 16 MiB transfer, four of 4 MiB, eight of 1 MiB).
pub const DEFAULT_INFLIGHT_BYTES: u64 = 16 << 20;

/// The default [`RdmaOptions::max_inline`]: 64 bytes, a small call's request or answer (a
/// short eager packet: 22 bytes of headers, the attachment table and a body of up to ~40
/// bytes). Asking for more makes every
/// work request of the send queue larger: with 256 the busy-poll small call was no faster
/// than without inline data on rxe, with 64 it was ~6% faster (one guest boot, 6 rounds,
/// 2026-12-05; docs/latency.md, "Small SENDs inline").
pub const DEFAULT_MAX_INLINE: u32 = 64;

/// The default of [`RdmaOptions::ack_timeout`]: 4.096 µs × 2^14 ≈ 67 ms, what perftest and
/// brpc's RDMA transport give their queue pairs (`DEF_QP_TIME` in perftest's
/// `src/perftest_parameters.h`, `TIMEOUT` in brpc's `src/brpc/rdma/rdma_endpoint.cpp`), rather
/// than rdma_cm's 2^19 × 4.096 µs ≈ 2.1 s for RoCE under Debian's 6.1 kernel: over a lossy
/// link every lost READ response packet cost a whole timeout on Soft-RoCE, and with rdma_cm's
/// a 3 MiB call did not finish in 20 s (docs/rdma-history.md, "A lossy RoCE link").
pub const DEFAULT_ACK_TIMEOUT: Duration = ack_timeout_of_exponent(14);

/// The local ACK timeout a queue pair's exponent stands for: 4.096 µs × 2^n (n ≤ 31).
pub(crate) const fn ack_timeout_of_exponent(n: u8) -> Duration {
    let n = if n > 31 { 31 } else { n };
    Duration::from_nanos(4096u64 << n)
}

/// The local ACK timeout exponent a queue pair gets for [`RdmaOptions::ack_timeout`]: the
/// smallest `n` in 1..=31 with 4.096 µs × 2^n at least `timeout` (31 for anything longer; 0
/// would mean no timeout at all, which a connection never asks for).
pub fn ack_timeout_exponent(timeout: Duration) -> u8 {
    let ns = timeout.as_nanos();
    (1..=31u8).find(|&n| 4096u128 << n >= ns).unwrap_or(31)
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
    /// how long the completion driver keeps polling after the last completion before it sleeps
    /// on the completion channel, at least (0: never spin); see `busy_poll_max`
    pub busy_poll: Duration,
    /// the longest it keeps polling: between `busy_poll` and this, the window is twice the
    /// longest recent gap between the connection's completions (in a call-and-answer rhythm,
    /// its round trip), so a connection keeps polling across its own round trip on any fabric
    /// and an idle one sleeps after at most this long. At or below `busy_poll`: a fixed window
    /// of `busy_poll`
    pub busy_poll_max: Duration,
    /// The polling burst: how long one task keeps polling the CQ before it lets the runtime's
    /// other tasks run. On a connection that a listener accepted (a server's) that task is the
    /// completion driver (0, the default: it lets them run after every poll); while a
    /// connection is busy, its driver handles each request where it finds it and polls on. On
    /// a connection that connected (a client's) it is the caller of a lone call, which polls
    /// for its own answer (0, the default: bursts of 10 µs, the RPC client's own). Every
    /// hand-back to the runtime runs the scheduler's code between two posts, which under
    /// emulation makes the next post slower (docs/latency.md). The other tasks of that
    /// runtime thread wait up to this long each time, so it suits a thread that serves one busy
    /// connection, with handlers that answer without waiting; it applies only within the spin
    /// window (`busy_poll`).
    pub poll_burst: Duration,
    /// limit for address/route resolution and connection establishment
    pub connect_timeout: Duration,
    /// The queue pair's local ACK timeout on InfiniBand and RoCE: how long a request without
    /// an acknowledgement (or a READ without its response) waits before the device sends it
    /// again. The device takes a power of two, 4.096 µs × 2^n; a connection gets the smallest
    /// that is at least this (from 8.2 µs to about 2.4 hours; [`ack_timeout_exponent`]).
    /// The default is [`DEFAULT_ACK_TIMEOUT`] (about 67 ms); `None` takes rdma_cm's value for
    /// the path (on RoCE under Debian's 6.1 kernel, 2^19 × 4.096 µs ≈ 2.1 s). On a link that
    /// loses or reorders packets a shorter one recovers sooner: Soft-RoCE drops every packet of
    /// a READ response after a missing one and asks again only when this runs out, so each
    /// loss costs a whole timeout. Too short a one sends again what is only late, on a
    /// congested fabric; after 7 timeouts in a row without progress the connection fails.
    /// iWARP ignores it (TCP retransmits).
    pub ack_timeout: Option<Duration>,
    /// if set, connections must run on this RDMA device (e.g. `rxe0`), else they fail
    pub device: Option<String>,
    /// rendezvous direction by size: a message with at most this many bulk (attachment)
    /// bytes goes by sender-push (the receiver grants pool buffers, the sender RDMA-WRITEs
    /// into them), a larger one by receiver-pull (the receiver RDMA-READs the sender's pool
    /// buffers). 0: always pull; `u64::MAX`: always push. Each side chooses for what it sends.
    pub push_up_to: u64,
    /// size classes of each connection's registered rendezvous pool (strictly increasing
    /// sizes; the total is registered once per connection, at set-up)
    pub pool_classes: Vec<SizeClass>,
    /// The most bytes of buffers registered outside the pool (because the pool could not lend
    /// one, or an attachment is larger than its largest class) that one connection holds at
    /// once for the peer's transfers into it: the sinks of its pulls and the buffers granted
    /// to its pushes, until the payloads received in them are dropped. A transfer that would
    /// go over waits until earlier ones are dropped, so a peer (hostile or just busy) cannot
    /// make a connection register more than this (plus its pools). Raised to the config's
    /// `max_message_size` if below it, so that every message the config admits can be
    /// received.
    pub max_fallback_bytes: u64,
    /// A listener's shared receive queue: if not 0, every connection the listener accepts on a
    /// device receives from one queue of this many slots (per device), instead of posting
    /// `recv_slots` of its own, so receive memory stays the same however many connections
    /// there are. Each connection is guaranteed a window of 2 slots and borrows up to
    /// `recv_slots` while it is busy; the listener refuses a connection when 2 slots are no
    /// longer free. The connections then share one protection domain (see the crate docs,
    /// "Shared receive queue", for what that costs). Ignored by `connect`.
    pub srq_slots: usize,
    /// Registered memory, per connection, kept for attachments larger than the rendezvous
    /// pool's largest class (pull sources, READ sinks, push grants): such an attachment gets a
    /// buffer of its size rounded up to a power of two, registered on first need (read-exposed,
    /// or write-exposed for a push grant) and reused by the next ones, so steady large
    /// transfers register nothing. Beyond this many bytes (all in use),
    /// a transfer registers a buffer for itself (`PoolCounts::fallback_registrations`). 0: never
    /// keep one.
    pub large_buffer_bytes: u64,
    /// RDMA READs in flight each way that a connection asks for (its initiator depth and
    /// responder resources); rdma_cm settles on the smallest of both sides' values and the
    /// devices' limits (at least 1). A receiver pulls several large payloads at once only
    /// with a depth above 1.
    pub read_depth: u8,
    /// The most bytes of RDMA READs and WRITEs (rendezvous transfers) a connection has in
    /// flight at once, besides at most 8 of them: a transfer waits until its share fits (one
    /// larger than this goes alone). Several 16 MiB READs in flight at once moved half as many
    /// bytes per second as one at a time on siw, and bytes in flight beyond what fills the link
    /// only hold registered memory longer.
    pub inflight_bytes: u64,
    /// SENDs of at most this many bytes go inline: the post copies them into the work
    /// request, so the device reads no registered memory for them, and a small message posted
    /// directly needs no send slot. A connection asks its provider for this much and takes
    /// less where it refuses the size (`EINVAL`: the next power of two down, to 0; any other
    /// failure to make the queue pair is reported as it is); 0 never sends inline.
    /// [`RdmaConnection::max_inline`] says what a connection got. The default,
    /// [`DEFAULT_MAX_INLINE`], takes a small call's request or answer.
    pub max_inline: u32,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        RdmaOptions {
            recv_slots: 32,
            send_slots: 32,
            // 8 KiB eager messages (rpc-core's default threshold) plus packet headers
            slot_size: 16 * 1024,
            busy_poll: Duration::from_micros(50),
            busy_poll_max: Duration::from_millis(1),
            poll_burst: Duration::ZERO,
            connect_timeout: Duration::from_secs(10),
            ack_timeout: Some(DEFAULT_ACK_TIMEOUT),
            device: None,
            push_up_to: DEFAULT_PUSH_UP_TO,
            max_fallback_bytes: DEFAULT_MAX_FALLBACK_BYTES,
            srq_slots: 0,
            large_buffer_bytes: DEFAULT_LARGE_BUFFER_BYTES,
            read_depth: DEFAULT_READ_DEPTH,
            inflight_bytes: DEFAULT_INFLIGHT_BYTES,
            max_inline: DEFAULT_MAX_INLINE,
            // 15 MiB per connection
            pool_classes: vec![
                SizeClass {
                    size: 64 * 1024,
                    count: 16,
                },
                SizeClass {
                    size: 1 << 20,
                    count: 6,
                },
                SizeClass {
                    size: 4 << 20,
                    count: 2,
                },
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReadDepth;

    fn depth(responder: u8, initiator: u8) -> ReadDepth {
        ReadDepth {
            responder,
            initiator,
        }
    }

    #[test]
    fn an_accepting_side_serves_what_the_peer_issues_and_issues_what_it_serves() {
        // the peer offers 16 each way, we allow 8: 8 each way
        assert_eq!(ReadDepth::accepting(8, depth(16, 16)), depth(8, 8));
        // the peer allows fewer: we serve its initiator depth, issue its responder resources
        assert_eq!(ReadDepth::accepting(8, depth(2, 4)), depth(4, 2));
        // a peer that offers none still gets one each way: every connection pulls
        assert_eq!(ReadDepth::accepting(8, depth(0, 0)), depth(1, 1));
    }

    #[test]
    fn ack_timeouts_round_up_to_the_devices_powers_of_two() {
        use super::ack_timeout_exponent as exp;
        use std::time::Duration;
        assert_eq!(exp(super::DEFAULT_ACK_TIMEOUT), 14);
        assert_eq!(exp(Duration::ZERO), 1);
        assert_eq!(exp(Duration::from_nanos(8192)), 1);
        assert_eq!(exp(Duration::from_nanos(8193)), 2);
        // 4.096 µs × 2^14 = 67.1 ms
        assert_eq!(exp(Duration::from_millis(67)), 14);
        assert_eq!(exp(Duration::from_millis(68)), 15);
        assert_eq!(exp(Duration::from_millis(536)), 17);
        assert_eq!(exp(Duration::from_secs(3600)), 30);
        assert_eq!(exp(Duration::from_secs(1 << 20)), 31);
        // and back: every exponent's timeout gives that exponent
        for n in 1..=31 {
            assert_eq!(exp(super::ack_timeout_of_exponent(n)), n);
        }
    }

    #[test]
    fn a_connecting_side_issues_no_more_than_the_peer_serves() {
        assert_eq!(ReadDepth::connecting(8, depth(8, 8)), depth(8, 8));
        assert_eq!(ReadDepth::connecting(8, depth(3, 8)), depth(8, 3));
        assert_eq!(ReadDepth::connecting(8, depth(0, 8)), depth(8, 1));
    }
}
