//! Connections over rdma_cm: setup (active and passive), the completion driver, SEND/RECV of
//! small messages through registered slots, and one-sided RDMA WRITE/READ of registered buffers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinHandle;

use crate::cm::CmDispatcher;
use crate::error::RdmaError;
use crate::pool::PoolMonitor;
use crate::verbs::{
    self, CmEvent, CmEventKind, CmId, CmQpState, Cq, Mem, Polled, PoolAccess, PoolBuf, PoolRegion,
    Qp, QpCaps, Region, RemoteAddr, Srq, Transport, Wc, WrKind,
};
use crate::{RdmaOptions, ReadDepth, TransportKind};
use rpc_core::ids::IdIndex;
use rpc_core::permits::{OwnedPermit, Permit, Permits};
use rpc_core::pool::{Pool, SizeClass};
use rpc_core::rendezvous::{RecvBudget, START_WINDOW};

/// What a waiter of a work request gets: the result, and the pool buffer the request used
/// (`None` if it used none, or if the connection failed before the completion arrived: the
/// buffer then stays with the QP until it is destroyed).
struct Done {
    res: Result<(), RdmaError>,
    buf: Option<PoolBuf>,
}

fn kind_of(t: Transport) -> TransportKind {
    match t {
        Transport::InfiniBand => TransportKind::InfiniBand,
        Transport::IWarp => TransportKind::IWarp,
        Transport::Other => TransportKind::Other,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// Waits for the next event on an id's route, with a deadline.
async fn next_cm_event(
    rx: &mut mpsc::UnboundedReceiver<CmEvent>,
    deadline: Instant,
    what: &str,
) -> Result<CmEvent, RdmaError> {
    match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
        Ok(Some(ev)) => Ok(ev),
        Ok(None) => Err(RdmaError::Connect(format!(
            "rdma_cm event channel closed while waiting for {what}"
        ))),
        Err(_) => Err(RdmaError::Timeout(format!("waiting for {what}"))),
    }
}

fn unexpected(ev: &CmEvent, what: &str) -> RdmaError {
    let errno = std::io::Error::from_raw_os_error(ev.status.abs());
    match ev.kind {
        CmEventKind::AddrError
            if ev.status.abs() == libc::ENODEV || ev.status.abs() == libc::EADDRNOTAVAIL =>
        {
            RdmaError::Unavailable(format!("no RDMA device serves this address ({errno})"))
        }
        _ => RdmaError::Connect(format!(
            "{:?} (status {}: {errno}) while waiting for {what}",
            ev.kind, ev.status
        )),
    }
}

/// Everything one connection's verbs objects need, plus the completion bookkeeping.
struct Shared {
    qp: Arc<Qp>,
    cq: Arc<Cq>,
    /// held while polling the CQ and dispatching, so completions are delivered in order
    poll_lock: Mutex<Poller>,
    recv_tx: mpsc::UnboundedSender<RecvEvent>,
    /// where received messages go once a receiver is installed (see
    /// [`RdmaConnection::deliver_to`]): straight from the task that polled the CQ, instead of
    /// through `recv_tx` to a task waiting in `recv_bytes`
    receiver: OnceLock<Receiver>,
    /// what small received messages are offered to, borrowed, before they go to `receiver`
    /// (see [`RdmaConnection::offer_to`])
    standing: OnceLock<Box<dyn Offered>>,
    /// called once the slot of a message that a caller's offer consumed is posted again (see
    /// [`RdmaConnection::on_lent_reposted`])
    lent_reposted: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// how long to keep polling after the last completion before sleeping on the channel
    spin: SpinWindow,
    state: Mutex<State>,
    send_pool: Mutex<Vec<Arc<Region>>>,
    send_permits: Arc<Permits>,
    /// SENDs posted with no task waiting (inline, or from a send slot) and not yet completed
    /// (nor given back by a failure, see `release_sends_out`), each holding a send permit taken
    /// with no guard (the QP keeps a send slot's region, and nothing for an inline SEND)
    sends_out: AtomicUsize,
    /// one-sided operations (RDMA READ/WRITE) in flight: the send queue has room for
    /// `ONE_SIDED` of them beside the SEND slots
    one_sided_permits: Semaphore,
    /// the bytes of one-sided operations in flight, at most (see `one_sided_places`)
    inflight_bytes: u64,
    slot_size: usize,
    /// receive slots (local access only)
    slots: Arc<PoolRegion>,
    /// the read-exposed rendezvous region (`REMOTE_READ` only): our pull and push sources and
    /// the sinks of our READs; registered on its first use (see `Shared::rendezvous_pool`
    /// and `PoolRegion` for what each region exposes)
    read_bufs: Mutex<Option<Arc<PoolRegion>>>,
    /// the write-exposed rendezvous region (`REMOTE_WRITE` only): buffers granted to the
    /// peer's pushes; registered on its first use
    write_bufs: Mutex<Option<Arc<PoolRegion>>>,
    /// the layout of each rendezvous region
    pool_classes: Vec<SizeClass>,
    /// regions of one buffer each, for attachments larger than the rendezvous pool's largest
    /// class: read-exposed for sources and READ sinks, write-exposed for push grants;
    /// registered on first need and kept for reuse, at most `large_cap` bytes together (see
    /// `Shared::lease_large`)
    large: Mutex<Vec<Arc<PoolRegion>>>,
    large_cap: u64,
    monitor: PoolMonitor,
    /// a receive has completed: the peer has been heard from (see [`nudge_until_heard`])
    heard: AtomicBool,
    /// Set (under the state lock) once `State::closed` is: lets the hot path check that the
    /// connection is open without taking that lock.
    closing: AtomicBool,
    /// how often this side nudged a silent peer (see [`nudge_until_heard`])
    nudges: AtomicU32,
    /// the connection's part of its listener's shared receive queue, if it uses one (last:
    /// its window goes back to the budget once the QP is gone)
    srq_share: Option<SrqShare>,
}

/// One device's shared receive queue of a listener: the SRQ, the slots posted to it (a third
/// more in the region, so that messages handed out without a copy do not starve it), and the
/// budget of the windows granted against those slots.
pub(crate) struct SharedRecv {
    srq: Arc<Srq>,
    slots: Arc<PoolRegion>,
    slot_size: usize,
    budget: RecvBudget,
}

impl SharedRecv {
    /// Posts `buf` (a slot of this queue) again; a failure is logged: the queue has one slot
    /// fewer than its budget from then on, which the budget absorbs by keeping it taken.
    fn repost(&self, buf: PoolBuf) {
        if let Err((e, _)) = self.srq.post_recv_pool(buf) {
            tracing::error!("transport-rdma: re-posting to the shared receive queue: {e}");
            // keep the lost slot out of every window (if none is free now, the windows shrink
            // as connections give slots back, and the loss is at least counted in the log)
            let _ = self.budget.try_take(1);
        }
    }
}

/// A listener's shared receive queues, one per device, each made on the first connection to
/// arrive on that device.
#[derive(Default)]
pub(crate) struct SharedRecvs(Mutex<HashMap<String, Arc<SharedRecv>>>);

impl SharedRecvs {
    fn for_device(
        &self,
        id: &CmId,
        opts: &RdmaOptions,
        monitor: &PoolMonitor,
    ) -> Result<Arc<SharedRecv>, RdmaError> {
        let name = id.device_name()?;
        let mut map = lock(&self.0);
        if let Some(recv) = map.get(&name) {
            return Ok(Arc::clone(recv));
        }
        let device = id.device()?;
        let total = opts.srq_slots.max(START_WINDOW as usize);
        let slot_size = opts.slot_size.max(64);
        let srq = Srq::new(&device, total as u32)?;
        let slots = PoolRegion::new(
            &device,
            layout(&[SizeClass {
                size: slot_size,
                count: total + total.div_ceil(3),
            }])?,
            PoolAccess::Local,
        )?;
        monitor.track(&slots);
        for _ in 0..total {
            let buf = PoolRegion::lease(&slots, slot_size)
                .ok_or_else(|| RdmaError::InvalidArgument("receive slot pool too small".into()))?;
            srq.post_recv_pool(buf).map_err(|(e, _)| e)?;
        }
        tracing::debug!(
            "transport-rdma: shared receive queue on {name}: {total} slots of {slot_size} bytes"
        );
        let recv = Arc::new(SharedRecv {
            srq,
            slots,
            slot_size,
            budget: RecvBudget::new(total as u32),
        });
        map.insert(name, Arc::clone(&recv));
        Ok(recv)
    }
}

/// A connection's part of a shared receive queue: the slots of the budget its window holds,
/// given back when the connection ends.
pub(crate) struct SrqShare {
    recv: Arc<SharedRecv>,
    held: AtomicU32,
}

impl SrqShare {
    /// Borrows up to `n` more slots for the connection's window; returns how many.
    pub(crate) fn borrow(&self, n: u32) -> u32 {
        let got = self.recv.budget.take_up_to(n);
        self.held.fetch_add(got, Ordering::AcqRel);
        got
    }

    /// Gives `n` slots of the window back.
    pub(crate) fn give_back(&self, n: u32) {
        if n > 0 {
            self.held.fetch_sub(n, Ordering::AcqRel);
            self.recv.budget.give(n);
        }
    }

    /// Whether the shared budget runs low (windows should shrink).
    pub(crate) fn budget_low(&self) -> bool {
        self.recv.budget.is_low()
    }
}

impl Drop for SrqShare {
    fn drop(&mut self) {
        self.recv.budget.give(*self.held.get_mut());
    }
}

/// Watches a listener's shared receive queues ([`RdmaListener::shared_receive_monitor`]).
#[derive(Clone)]
pub struct SharedReceiveMonitor(Arc<SharedRecvs>);

impl std::fmt::Debug for SharedReceiveMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("SharedReceiveMonitor")
            .field(&self.stats())
            .finish()
    }
}

impl SharedReceiveMonitor {
    /// The state of the shared receive queue of each device that a connection arrived on so
    /// far, by device name; empty if the listener has none.
    pub fn stats(&self) -> Vec<(String, SharedReceiveStats)> {
        let mut out: Vec<_> = lock(&(self.0).0)
            .iter()
            .map(|(name, r)| {
                (
                    name.clone(),
                    SharedReceiveStats {
                        slots: r.budget.total(),
                        free: r.budget.free(),
                        posted: r.srq.posted(),
                        registered_bytes: r.slots.pool().region_len(),
                    },
                )
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// What a listener's shared receive queue looks like now (see [`SharedReceiveMonitor`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedReceiveStats {
    /// slots of the queue
    pub slots: u32,
    /// slots not in any connection's window
    pub free: u32,
    /// receives posted to the queue now (equal to `slots` unless a re-post failed)
    pub posted: usize,
    /// bytes registered for the queue's slots
    pub registered_bytes: usize,
}

/// What a rendezvous buffer is for, which decides the region it comes from (see
/// `PoolRegion`): the peer gets read access to sources and READ sinks, write access only to
/// push grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolUse {
    /// an outbound pull source (the peer READs it) or push source (we WRITE from it)
    Source,
    /// the sink of our RDMA READ of the peer's pull source
    PullSink,
    /// a buffer granted to the peer's push (the peer WRITEs into it)
    PushGrant,
}

#[derive(Default)]
struct State {
    /// tasks waiting for their work requests' completions, by work-request id (an entry goes
    /// before the QP retires its id, see `dispatch`)
    waiters: IdIndex<oneshot::Sender<Done>>,
    /// set once the connection is unusable: why
    closed: Option<String>,
    /// set by the first real failure (an error completion other than a flush, a driver error):
    /// flushed receives are then an error, not the end of the stream
    failed: Option<String>,
    /// the peer disconnected (or we did): flushed receives mean end of stream
    disconnected: bool,
}

/// A connection's registered memory for the payloads it sends: what
/// [`RdmaConnection::payload_memory`] gives, for `rpc_core::Client::payload_mut`. A payload
/// filled in such a buffer is sent by pull from where it is (the peer READs it), with no copy.
pub(crate) struct SourceMemory(std::sync::Weak<Shared>);

impl rpc_core::payload::PayloadMemory for SourceMemory {
    fn lend(&self, len: usize) -> Option<rpc_core::PayloadMut> {
        let shared = self.0.upgrade()?;
        if lock(&shared.state).closed.is_some() {
            return None;
        }
        let buf = shared.lease_buffer(len, PoolUse::Source)?;
        Some(rpc_core::PayloadMut::lent(Box::new(buf)))
    }
}

impl rpc_core::payload::LentBuffer for PoolBuf {
    fn bytes(&self) -> &[u8] {
        PoolBuf::bytes(self)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        PoolBuf::bytes_mut(self)
    }

    fn freeze(self: Box<Self>) -> rpc_core::Payload {
        rpc_core::Payload::from_owner((*self).freeze())
    }
}

impl Shared {
    /// The connection's rendezvous region for `use_`, registered on first use: once per
    /// connection and region, so that a connection that only ever sends small messages
    /// registers only its receive slots, and one that never grants a push never registers a
    /// remotely writable region. `None` if the registration failed (the caller falls back to
    /// a buffer of its own, which reports the error if registering fails again).
    fn rendezvous_pool(&self, use_: PoolUse) -> Option<Arc<PoolRegion>> {
        let (slot, access) = match use_ {
            PoolUse::Source | PoolUse::PullSink => (&self.read_bufs, PoolAccess::RemoteRead),
            PoolUse::PushGrant => (&self.write_bufs, PoolAccess::RemoteWrite),
        };
        let mut bufs = lock(slot);
        if let Some(r) = &*bufs {
            return Some(Arc::clone(r));
        }
        let region = layout(&self.pool_classes)
            .and_then(|pool| PoolRegion::new(self.qp.device(), pool, access));
        match region {
            Ok(r) => {
                self.monitor.track(&r);
                *bufs = Some(Arc::clone(&r));
                Some(r)
            }
            Err(e) => {
                tracing::warn!(
                    "transport-rdma: registering the rendezvous pool ({access:?}) failed: {e}"
                );
                None
            }
        }
    }

    /// Lends a rendezvous buffer of `len` bytes for `use_` from the connection's registered
    /// region for it (see [`PoolUse`]).
    ///
    /// A buffer larger than the pool's largest class comes from a region of its own with the
    /// access of `use_`, kept for the next one (see [`RdmaOptions::large_buffer_bytes`]);
    /// `None` when the pool is exhausted, or those regions are all busy and no more may be
    /// registered.
    fn lease_buffer(&self, len: usize, use_: PoolUse) -> Option<PoolBuf> {
        if let Some(buf) = PoolRegion::lease(&self.rendezvous_pool(use_)?, len) {
            return Some(buf);
        }
        let largest = self.pool_classes.iter().map(|c| c.size).max();
        if largest.is_some_and(|l| len <= l) {
            return None;
        }
        let access = match use_ {
            PoolUse::Source | PoolUse::PullSink => PoolAccess::RemoteRead,
            PoolUse::PushGrant => PoolAccess::RemoteWrite,
        };
        self.lease_large(len, access)
    }

    /// A buffer of `len` bytes from a large region of `access`: a free one that fits, else a
    /// new region of `len` rounded up to a power of two, after dropping free ones (of either
    /// access, smallest first) to stay within `large_cap`.
    fn lease_large(&self, len: usize, access: PoolAccess) -> Option<PoolBuf> {
        let mut large = lock(&self.large);
        if let Some(buf) = large
            .iter()
            .filter(|r| r.access() == access)
            .find_map(|r| PoolRegion::lease(r, len))
        {
            return Some(buf);
        }
        let size = len.checked_next_power_of_two()?;
        let cap = self.large_cap;
        if size as u64 > cap {
            return None;
        }
        let mut total: u64 = large.iter().map(|r| r.len() as u64).sum();
        while total + size as u64 > cap {
            // a region no buffer is leased from (the list holds the only reference): nothing
            // uses it, neither we nor the device, so it may be deregistered
            let free = large
                .iter()
                .enumerate()
                .filter(|(_, r)| Arc::strong_count(r) == 1)
                .min_by_key(|(_, r)| r.len())
                .map(|(i, _)| i)?;
            total -= large.swap_remove(free).len() as u64;
        }
        let class = SizeClass { size, count: 1 };
        let region =
            layout(&[class]).and_then(|pool| PoolRegion::new(self.qp.device(), pool, access));
        match region {
            Ok(r) => {
                self.monitor.track(&r);
                let buf = PoolRegion::lease(&r, len);
                large.push(r);
                buf
            }
            Err(e) => {
                tracing::warn!("transport-rdma: registering a {size}-byte buffer failed: {e}");
                None
            }
        }
    }

    /// Polls the CQ and dispatches what it finds, unless another task is doing it (then 0).
    /// `Err` when polling failed (the connection is then failed).
    fn poll_once(&self, wait: bool) -> Result<usize, RdmaError> {
        let mut polled = if wait {
            lock(&self.poll_lock)
        } else {
            match self.try_poll_lock() {
                Some(g) => g,
                None => return Ok(0),
            }
        };
        self.poll_locked(&mut polled, None, None)
    }

    /// The poll lock, unless another task holds it.
    fn try_poll_lock(&self) -> Option<MutexGuard<'_, Poller>> {
        self.poll_lock.try_lock()
    }

    /// Polls the CQ under the poll lock (`polled`) and dispatches what it finds, received
    /// messages to `lend` or small ones first to `offer`, if given (see `dispatch`); how many
    /// completions it found.
    fn poll_locked(
        &self,
        poller: &mut Poller,
        lend: Option<&mut Lend<'_>>,
        offer: Option<&mut Offer<'_>>,
    ) -> Result<usize, RdmaError> {
        let Poller {
            polled,
            arena,
            held,
        } = poller;
        // what the last poll left (see `Poller::held`): its slot, and telling the spin window
        // of its completions (a caller found them: only a caller's poll holds a slot)
        if let Some(buf) = held.take() {
            self.repost_lent(buf);
            self.spin.on_completions(self.spin.now());
            self.spin.caller_found();
        }
        let n = match self.cq.poll(polled) {
            Ok(n) => n,
            Err(e) => {
                fail_all(self, &format!("{e}"));
                return Err(e);
            }
        };
        if n > 0 {
            dispatch(self, polled.wcs(), arena, held, lend, offer);
            // timed after the dispatch, which a clock read (~70 ns under emulation) would
            // otherwise delay; if a caller took its answer, by the next poll, later by at most
            // that caller's next post (the window follows gaps of microseconds and more, and a
            // later time only keeps it open a little longer)
            if held.is_none() {
                self.spin.on_completions(self.spin.now());
            }
        }
        Ok(n)
    }

    /// Busy-polls the CQ inline (no task switch) until `done` or the spin window elapsed.
    async fn spin_until(&self, mut done: impl FnMut() -> bool) {
        let window = self.spin.window();
        if window.is_zero() {
            return;
        }
        let start = Instant::now();
        while !done() {
            if self.poll_once(false).is_err() || start.elapsed() >= window {
                return;
            }
            // let other tasks of this runtime run (an in-process peer, say)
            spin_yield().await;
        }
    }

    /// A receive completed: to the installed receiver, or to `recv_bytes`. Called under the
    /// poll lock (see `RdmaConnection::deliver_to`).
    fn received(&self, ev: RecvEvent) {
        match self.receiver.get() {
            Some(receiver) => receiver(self.take_received(Some(ev))),
            None => {
                let _ = self.recv_tx.send(ev);
            }
        }
    }

    /// Posts again the slot of a message that a caller's offer consumed (see `Poller::held`),
    /// unless the connection is closing (its QP flushes what is posted: the slot goes back to
    /// the pool instead), and tells [`lent_reposted`](Shared::lent_reposted).
    fn repost_lent(&self, buf: PoolBuf) {
        if repost(self, buf) {
            if let Some(back) = self.lent_reposted.get() {
                back();
            }
        }
    }

    /// A SEND posted with no task waiting completed (or failed to post): its send permit back,
    /// unless a failure of the connection gave back the permits of every such SEND out already
    /// ([`release_sends_out`](Self::release_sends_out)). Each count taken out of `sends_out`
    /// returns one permit, whoever takes it, so none is returned twice.
    fn send_retired(&self) {
        let out = self
            .sends_out
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if out.is_ok() {
            self.send_permits.release();
        }
    }

    /// Gives back the send permits of every SEND out with no task waiting, for a connection that
    /// failed: their completions may never be polled (a send slot's region stays in the QP until
    /// it lets go of it).
    fn release_sends_out(&self) {
        for _ in 0..self.sends_out.swap(0, Ordering::AcqRel) {
            self.send_permits.release();
        }
    }

    fn check_open(&self) -> Result<(), RdmaError> {
        // set after `closed`, under the lock: seen set, the lock then shows why
        if !self.closing.load(Ordering::Acquire) {
            return Ok(());
        }
        match &lock(&self.state).closed {
            Some(why) => Err(RdmaError::Closed(Some(why.clone()))),
            None => Ok(()),
        }
    }

    /// Turns a receive event into the message it carries: a view of the registered slot it
    /// arrived in (no copy; the slot returns to the pool when the last view is dropped, and a
    /// fresh one is posted in its place), or a copy if the slot pool has none free; `Ok(None)`
    /// at the end of the stream (`None`: the event channel closed).
    fn take_received(&self, ev: Option<RecvEvent>) -> Result<Option<bytes::Bytes>, RdmaError> {
        let Some(ev) = ev else { return Ok(None) };
        match ev {
            RecvEvent::Copied(data) => Ok(Some(data)),
            RecvEvent::Data(Mem::Pool(mut buf), len) => {
                if len > buf.len().max(self.slot_size) {
                    return Err(RdmaError::InvalidArgument(
                        "completion longer than its slot".into(),
                    ));
                }
                // a shared-queue slot was replaced when its completion was dispatched
                if self.check_open().is_err() || self.srq_share.is_some() {
                    buf.set_len(len);
                    return Ok(Some(bytes::Bytes::from_owner(buf.freeze())));
                }
                // post a fresh slot in its place and hand this one out as it is; if none is
                // free (handlers hold many), copy the message and give the slot back
                let (data, repost) = match PoolRegion::lease(&self.slots, self.slot_size) {
                    Some(fresh) => {
                        buf.set_len(len);
                        (bytes::Bytes::from_owner(buf.freeze()), fresh)
                    }
                    None => {
                        buf.set_len(len);
                        let data = bytes::Bytes::copy_from_slice(buf.bytes_mut());
                        (data, buf)
                    }
                };
                if let Err((e, _)) = self.qp.post_recv_pool(repost) {
                    self.close(&format!("re-posting a receive failed: {e}"));
                }
                Ok(Some(data))
            }
            RecvEvent::Data(Mem::Region(mut region), len) => {
                let data = Region::bytes(&mut region)
                    .ok_or(RdmaError::BufferBusy)?
                    .get(..len)
                    .ok_or_else(|| {
                        RdmaError::InvalidArgument("completion longer than its slot".into())
                    })?
                    .to_vec();
                Ok(Some(data.into()))
            }
            RecvEvent::Data(Mem::View { .. } | Mem::Empty | Mem::Send { .. }, _) => {
                Err(RdmaError::InvalidArgument(
                    "a receive completed into memory posted for a send".into(),
                ))
            }
            RecvEvent::Eof => Ok(None),
            RecvEvent::Failed { err, flushed } => {
                // A disconnect moves the QP to the error state, which flushes the posted
                // receives (on iWARP even before the DISCONNECTED event arrives): that is the
                // end of the stream, unless a real failure came first.
                let st = lock(&self.state);
                if (flushed || st.disconnected) && st.failed.is_none() {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    fn close(&self, why: &str) {
        let mut st = lock(&self.state);
        if st.closed.is_none() {
            st.closed = Some(why.to_string());
            self.closing.store(true, Ordering::Release);
        }
    }
}

/// What polls the CQ owns, behind the poll lock: the completions' buffer, the arena that
/// small received messages are copied into (see [`COPY_AT_MOST`]), and what a caller's poll
/// leaves to the next one.
struct Poller {
    polled: Polled,
    arena: bytes::BytesMut,
    /// The slot of a message that a caller's offer consumed (its answer, decoded in place:
    /// [`RdmaConnection::poll_completions_offering`]), posted again by the next poll instead
    /// of at once: that caller goes on to its next request, and the next poll is usually its
    /// own, while it waits for that request's answer. Posting a receive is ~150 instructions
    /// of the provider's and ours; this keeps them off the path from an answer found to the
    /// next request posted. One at most (a second is posted at once). While it is held, the
    /// spin window has not been told of the completions of the poll that found it either: the
    /// next poll tells it, with its own time.
    held: Option<PoolBuf>,
}

/// A received message at most this long is copied out of its slot into the poller's arena,
/// and the same slot is posted again at once; a longer one is handed on as a view of its slot
/// (no copy), and a fresh slot is posted in its place. For a small message the copy costs
/// less than what a view takes: leasing the fresh slot, an owner allocated for the view, the
/// slot's return to the pool when the view is dropped. It also keeps a held small message
/// from pinning a whole slot (`RdmaOptions::slot_size`, 16 KiB by default). Payloads of
/// this size are then heap memory, not registered; larger ones stay views of their slot or
/// rendezvous buffer.
const COPY_AT_MOST: usize = 256;

/// The arena's chunks: copies are cut from one chunk until it is used up; then the chunk is
/// reused if every copy cut from it was dropped, or a new one is allocated (the old one is
/// freed with its last copy).
const ARENA_CHUNK: usize = 16 * 1024;

enum RecvEvent {
    Data(Mem, usize),
    /// a message copied out of its slot: a small one (see [`COPY_AT_MOST`]), or one from a
    /// shared-queue slot when no slot was free to post in its place
    Copied(bytes::Bytes),
    /// a receive failed; `flushed`: only because the QP went to the error state
    Failed {
        err: RdmaError,
        flushed: bool,
    },
    /// the connection was disconnected (by either side): end of stream
    Eof,
}

/// Where a connection's received messages go (see [`RdmaConnection::deliver_to`]): called with
/// each message in order, then with the end of the stream (`Ok(None)` or an error; late events
/// may follow, to be ignored): messages from the task that polled the CQ, under the poll lock,
/// so it must not block and must not poll the CQ; the end, mostly, from `forward_end`'s task.
pub(crate) type Receiver = Box<dyn Fn(Result<Option<bytes::Bytes>, RdmaError>) + Send + Sync>;

/// RDMA READs/WRITEs in flight at once per connection (send-queue places beside the SENDs).
const ONE_SIDED: usize = 8;

/// How many of the `ONE_SIDED` places a one-sided transfer of `len` bytes takes when a
/// connection keeps at most `inflight_bytes` of them in flight ([`RdmaOptions::inflight_bytes`]):
/// one place per `inflight_bytes / ONE_SIDED` bytes, at least one, at most all.
fn one_sided_places(len: usize, inflight_bytes: u64) -> u32 {
    let per_place = (inflight_bytes / ONE_SIDED as u64).max(1);
    (len as u64).div_ceil(per_place).clamp(1, ONE_SIDED as u64) as u32
}

/// A connected RDMA reliable connection (RC queue pair set up with rdma_cm).
pub struct RdmaConnection {
    shared: Arc<Shared>,
    recv_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<RecvEvent>>,
    id: CmId,
    driver: JoinHandle<()>,
    device_name: String,
    transport: TransportKind,
    recv_slots: usize,
    send_slots: usize,
    /// accepted (not connected) by us
    passive: bool,
    /// a lone call's caller's polling burst ([`RdmaOptions::poll_burst`] on a connection we
    /// connected; zero on one we accepted, whose driver bursts instead)
    caller_burst: Duration,
    _cm: Arc<CmDispatcher>,
}

impl std::fmt::Debug for RdmaConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaConnection")
            .field("device", &self.device_name)
            .field("transport", &self.transport)
            .field("qp_num", &self.shared.qp.qp_num())
            .finish()
    }
}

/// What both sides do once the id is bound to a device: CQ, QP (INIT), receives posted.
struct Prepared {
    qp: Arc<Qp>,
    cq: Arc<Cq>,
    recv_slots: usize,
    slots: Arc<PoolRegion>,
    monitor: PoolMonitor,
    srq_share: Option<SrqShare>,
}

fn prepare(
    id: &CmId,
    opts: &RdmaOptions,
    monitor: PoolMonitor,
    shared_recv: Option<&SharedRecvs>,
) -> Result<Prepared, RdmaError> {
    let srq_share = match shared_recv {
        Some(recvs) if opts.srq_slots > 0 => {
            let recv = recvs.for_device(id, opts, &monitor)?;
            if !recv.budget.try_take(START_WINDOW) {
                return Err(RdmaError::Connect(format!(
                    "the shared receive queue's {} slots are all in use: connection refused",
                    recv.budget.total()
                )));
            }
            Some(SrqShare {
                recv,
                held: AtomicU32::new(START_WINDOW),
            })
        }
        _ => None,
    };
    let device = match &srq_share {
        Some(share) => Arc::clone(share.recv.srq.device()),
        None => id.device()?,
    };
    let recv_slots = opts.recv_slots.max(1);
    let send_slots = opts.send_slots.max(1);
    // room for the one-sided operations beside the send slots, twice over (see
    // `one_sided_permit`)
    let max_send_wr = (send_slots + 2 * ONE_SIDED) as u32;
    let cq = Cq::new(
        &device,
        (recv_slots + send_slots + 2 * ONE_SIDED) as u32 * 2,
    )?;
    let qp = Qp::new(
        &device,
        &cq,
        QpCaps {
            max_send_wr,
            max_recv_wr: recv_slots as u32,
            max_inline: opts.max_inline,
        },
        srq_share.as_ref().map(|s| &s.recv.srq),
    )?;
    id.modify_qp(&qp, CmQpState::Init)?;
    if let Some(share) = srq_share {
        // the shared queue's receives are posted already
        return Ok(Prepared {
            qp,
            cq,
            recv_slots,
            slots: Arc::clone(&share.recv.slots),
            monitor,
            srq_share: Some(share),
        });
    }
    // receives are posted before connect/accept: on iWARP a SEND that finds no receive kills
    // the connection
    // The receive slots: registered once, here, on this connection's own PD. Twice the receive
    // slots, so that received payloads a handler still holds do not starve the receive queue.
    // (The rendezvous pool is registered on the first rendezvous: idle connections stay cheap.)
    let slots = PoolRegion::new(
        &device,
        layout(&[SizeClass {
            size: opts.slot_size.max(64),
            count: recv_slots * 2,
        }])?,
        PoolAccess::Local,
    )?;
    monitor.track(&slots);
    // a bad layout is an error now, not at the first rendezvous
    layout(&opts.pool_classes)?;
    let mut posted = Vec::with_capacity(recv_slots);
    for _ in 0..recv_slots {
        let buf = PoolRegion::lease(&slots, opts.slot_size)
            .ok_or_else(|| RdmaError::InvalidArgument("receive slot pool too small".into()))?;
        posted.push(qp.post_recv_pool(buf).map_err(|(e, _)| e)?);
    }
    Ok(Prepared {
        qp,
        cq,
        recv_slots: posted.len(),
        slots,
        monitor,
        srq_share: None,
    })
}

fn layout(classes: &[SizeClass]) -> Result<Pool, RdmaError> {
    Pool::new(classes).map_err(|e| RdmaError::InvalidArgument(format!("{e}")))
}

/// The READ depth a connection asks for each way: the options' within the device's limit.
fn read_limit(prepared: &Prepared, opts: &RdmaOptions) -> u8 {
    opts.read_depth
        .min(prepared.qp.device().max_read_depth())
        .max(1)
}

fn check_device(prepared: &Prepared, opts: &RdmaOptions) -> Result<(), RdmaError> {
    match &opts.device {
        Some(want) if want != prepared.qp.device().name() => Err(RdmaError::Connect(format!(
            "the connection runs on device {}, not on the requested {want}",
            prepared.qp.device().name()
        ))),
        _ => Ok(()),
    }
}

impl RdmaConnection {
    /// Connects to an RDMA listener at `addr` (an IP address of the peer's RDMA device).
    pub async fn connect(addr: SocketAddr, opts: RdmaOptions) -> Result<RdmaConnection, RdmaError> {
        RdmaConnection::connect_tracked(addr, opts, PoolMonitor::default()).await
    }

    /// As [`RdmaConnection::connect`], with the connection's registered pools counted by
    /// `monitor` (which may already watch other connections: a client's successive
    /// connections, say).
    pub async fn connect_tracked(
        addr: SocketAddr,
        opts: RdmaOptions,
        monitor: PoolMonitor,
    ) -> Result<RdmaConnection, RdmaError> {
        // "no RDMA here" must be an error before anything else
        crate::devices()?;
        let deadline = Instant::now() + opts.connect_timeout;
        let cm = CmDispatcher::start()?;
        let id = cm.channel().create_id()?;
        let (tx, mut rx) = mpsc::unbounded_channel();
        id.set_route(tx);
        id.resolve_addr(addr, opts.connect_timeout)?;
        let ev = next_cm_event(&mut rx, deadline, "address resolution").await?;
        if ev.kind != CmEventKind::AddrResolved {
            return Err(unexpected(&ev, "address resolution"));
        }
        id.resolve_route(opts.connect_timeout)?;
        let ev = next_cm_event(&mut rx, deadline, "route resolution").await?;
        if ev.kind != CmEventKind::RouteResolved {
            return Err(unexpected(&ev, "route resolution"));
        }
        let prepared = prepare(&id, &opts, monitor, None)?;
        let limit = read_limit(&prepared, &opts);
        id.connect(&prepared.qp, limit)?;
        let ev = next_cm_event(&mut rx, deadline, "the connection to be accepted").await?;
        match ev.kind {
            // InfiniBand/RoCE: we move the QP to RTR/RTS and send the RTU
            CmEventKind::ConnectResponse => {
                let answer = ev.peer.unwrap_or(ReadDepth::ONE);
                let depth = ReadDepth::connecting(limit, answer);
                id.modify_qp(&prepared.qp, CmQpState::ReadyToReceive(depth))?;
                id.modify_qp(
                    &prepared.qp,
                    CmQpState::ReadyToSend(depth, opts.ack_timeout),
                )?;
                id.establish()?;
            }
            // iWARP: the provider's connection manager moved the QP to RTS
            CmEventKind::Established => {}
            _ => return Err(unexpected(&ev, "the connection to be accepted")),
        }
        check_device(&prepared, &opts)?;
        Self::start(id, cm, prepared, rx, &opts, false)
    }

    fn start(
        id: CmId,
        cm: Arc<CmDispatcher>,
        prepared: Prepared,
        cm_rx: mpsc::UnboundedReceiver<CmEvent>,
        opts: &RdmaOptions,
        passive: bool,
    ) -> Result<RdmaConnection, RdmaError> {
        let Prepared {
            qp,
            cq,
            recv_slots,
            slots,
            monitor,
            srq_share,
        } = prepared;
        let device_name = qp.device().name().to_string();
        let transport = kind_of(qp.device().transport());
        let send_slots = opts.send_slots.max(1);
        let (recv_tx, recv_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            qp,
            cq: Arc::clone(&cq),
            poll_lock: Mutex::new(Poller {
                polled: Polled::new(),
                arena: bytes::BytesMut::new(),
                held: None,
            }),
            recv_tx,
            receiver: OnceLock::new(),
            standing: OnceLock::new(),
            lent_reposted: OnceLock::new(),
            spin: SpinWindow::new(opts.busy_poll, opts.busy_poll_max),
            state: Mutex::new(State::default()),
            send_pool: Mutex::new(Vec::with_capacity(send_slots)),
            send_permits: Arc::new(Permits::new(send_slots)),
            sends_out: AtomicUsize::new(0),
            one_sided_permits: Semaphore::new(ONE_SIDED),
            inflight_bytes: opts.inflight_bytes,
            slot_size: opts.slot_size,
            slots,
            read_bufs: Mutex::new(None),
            write_bufs: Mutex::new(None),
            pool_classes: opts.pool_classes.clone(),
            large: Mutex::new(Vec::new()),
            large_cap: opts.large_buffer_bytes,
            monitor,
            heard: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            nudges: AtomicU32::new(0),
            srq_share,
        });
        let afd = verbs::async_fd(cq)?;
        tracing::debug!(
            "transport-rdma: connected on {device_name} ({transport:?}), qp {}, {}",
            shared.qp.qp_num(),
            if shared.srq_share.is_some() {
                "receiving from the listener's shared receive queue".to_string()
            } else {
                format!("{recv_slots} receives posted")
            }
        );
        // a client's lone callers poll for their own answers, in bursts of this length; only a
        // server's driver bursts
        let (burst, caller_burst) = if passive {
            (opts.poll_burst, Duration::ZERO)
        } else {
            (Duration::ZERO, opts.poll_burst)
        };
        let driver = tokio::spawn(drive(Arc::clone(&shared), afd, cm_rx, burst));
        if !passive && transport == TransportKind::IWarp {
            tokio::spawn(nudge_until_heard(Arc::downgrade(&shared)));
        }
        Ok(RdmaConnection {
            shared,
            recv_rx: tokio::sync::Mutex::new(recv_rx),
            id,
            driver,
            device_name,
            transport,
            recv_slots,
            send_slots,
            passive,
            caller_burst,
            _cm: cm,
        })
    }

    /// Whether we accepted the connection (the peer connected).
    pub fn is_accepted(&self) -> bool {
        self.passive
    }

    /// How many times this side nudged a peer it had not heard from since the connection was
    /// set up: an RDMA WRITE of no bytes, which only a connecting side on iWARP sends (siw can
    /// strand the first messages of a new connection in its kernel socket until another
    /// packet arrives; see the README's design notes). A diagnostic: 0 unless the peer was
    /// silent for at least 20 ms after the set-up, and at most 8.
    pub fn nudges(&self) -> u32 {
        self.shared.nudges.load(Ordering::Relaxed)
    }

    /// The connection's part of its listener's shared receive queue, if it has one.
    pub(crate) fn srq_share(&self) -> Option<&SrqShare> {
        self.shared.srq_share.as_ref()
    }

    /// The name of the RDMA device the connection runs on (e.g. `rxe0`, `siw0`).
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The transport family of that device.
    pub fn transport(&self) -> TransportKind {
        self.transport
    }

    /// How many SENDs can be in flight at once (see [`RdmaConnection::start_send`]).
    pub fn send_slots(&self) -> usize {
        self.send_slots
    }

    /// How many SENDs are in flight now: posted, and their completions not yet polled (at most
    /// [`send_slots`](Self::send_slots)).
    pub fn sends_in_flight(&self) -> usize {
        self.send_slots
            .saturating_sub(self.shared.send_permits.available())
    }

    /// How many receive slots this side posted (and keeps posted).
    pub fn recv_slots(&self) -> usize {
        self.recv_slots
    }

    /// Whether the connection was closed (by either side) or failed.
    pub fn is_closed(&self) -> bool {
        self.check_open().is_err()
    }

    /// The largest message [`RdmaConnection::send`] takes (the receive slot size).
    pub fn max_message_size(&self) -> usize {
        self.shared.slot_size
    }

    /// The RDMA READs this connection's queue pair may have in flight each way, as the device
    /// reports them now (what rdma_cm negotiated; see [`RdmaOptions::read_depth`]).
    pub fn read_depth(&self) -> Result<ReadDepth, RdmaError> {
        self.shared.qp.read_depth()
    }

    /// The local ACK timeout of this connection's queue pair, as the device reports it now
    /// (see [`RdmaOptions::ack_timeout`]); `None` on iWARP, where TCP retransmits.
    pub fn ack_timeout(&self) -> Result<Option<std::time::Duration>, RdmaError> {
        if self.shared.qp.device().transport() == Transport::IWarp {
            return Ok(None);
        }
        let n = self.shared.qp.ack_timeout_exponent()?;
        Ok((n > 0).then(|| crate::ack_timeout_of_exponent(n)))
    }

    /// The most bytes a SEND of this connection carries inline: copied into the work request
    /// as it is posted, so the device reads no registered memory for it. What the provider
    /// granted of [`RdmaOptions::max_inline`] when the queue pair was made (rxe grants up to
    /// 256 bytes here, siw 64). With the default, a small call's request and answer go so.
    pub fn max_inline(&self) -> usize {
        self.shared.qp.max_inline() as usize
    }

    fn check_open(&self) -> Result<(), RdmaError> {
        self.shared.check_open()
    }

    /// Posts a signaled work request (under the state lock, so its completion cannot be
    /// dispatched before the waiter is registered) and waits for its completion.
    async fn post_and_wait(
        &self,
        len: usize,
        op: impl FnOnce(&Qp) -> Result<u64, RdmaError>,
    ) -> Result<(), RdmaError> {
        let _permit = self.one_sided_permit(len).await?;
        let rx = post(&self.shared, op)?;
        wait_one_sided(&self.shared, rx, len).await.res
    }

    /// A place in the send queue for one RDMA READ or WRITE of `len` bytes (and its share of
    /// the bytes in flight, see `one_sided_places`), held until its completion. A
    /// waiter dropped early gives its place back while the request may still be queued: the
    /// send queue has `ONE_SIDED` further places for such stragglers.
    async fn one_sided_permit(
        &self,
        len: usize,
    ) -> Result<tokio::sync::SemaphorePermit<'_>, RdmaError> {
        self.shared
            .one_sided_permits
            .acquire_many(one_sided_places(len, self.shared.inflight_bytes))
            .await
            .map_err(|_| RdmaError::Closed(None))
    }

    /// The counters of this connection's registered pools.
    pub fn pool_monitor(&self) -> PoolMonitor {
        self.shared.monitor.clone()
    }

    /// Lends a rendezvous buffer of `len` bytes for `use_` (see [`Shared::lease_buffer`]).
    pub(crate) fn lease_buffer(&self, len: usize, use_: PoolUse) -> Option<PoolBuf> {
        self.shared.lease_buffer(len, use_)
    }

    /// The connection's registered memory for payloads it sends ([`PoolUse::Source`]
    /// buffers), lent to users through `rpc_core::Client::payload_mut`. It holds the
    /// connection weakly: once the connection is gone it lends nothing.
    pub(crate) fn payload_memory(&self) -> SourceMemory {
        SourceMemory(Arc::downgrade(&self.shared))
    }

    /// If `bytes` are a view into this connection's read-exposed rendezvous region (a payload
    /// received on it by pull), the address and key the peer can read them with; that key
    /// lets the peer read, never write. (A payload pushed to us lies in the write-exposed
    /// region, which is never exposed for reading: it is copied to be sent by pull, and
    /// WRITten from where it is to be sent by push, see `pool_region_of`.)
    pub(crate) fn pool_address_of(&self, bytes: &[u8]) -> Option<(u64, u32)> {
        let r = self.pool_region_of(bytes)?;
        r.address_of(bytes).map(|a| (a, r.rkey()))
    }

    /// The rendezvous region of this connection (read-exposed, write-exposed or a kept large
    /// one) that `bytes` lie in, if any: a payload lent by it, or received into it.
    fn pool_region_of(&self, bytes: &[u8]) -> Option<Arc<PoolRegion>> {
        for m in [&self.shared.read_bufs, &self.shared.write_bufs] {
            if let Some(r) = lock(m).as_ref() {
                if r.local_address_of(bytes).is_some() {
                    return Some(Arc::clone(r));
                }
            }
        }
        lock(&self.shared.large)
            .iter()
            .find(|r| r.local_address_of(bytes).is_some())
            .cloned()
    }

    /// Whether `payload` can be written to the peer from where it is (see
    /// [`RdmaConnection::write_from_view`]).
    pub(crate) fn can_write_from(&self, payload: &[u8]) -> bool {
        self.pool_region_of(payload).is_some()
    }

    /// RDMA WRITE of `payload`, a view of one of this connection's rendezvous regions, into
    /// the peer's granted buffer, without a copy. If this future is dropped, the payload stays
    /// with the QP until the WRITE's completion arrives (or the QP is destroyed).
    pub(crate) async fn write_from_view(
        &self,
        payload: rpc_core::Payload,
        dst: &RemoteToken,
    ) -> Result<(), RdmaError> {
        let len = payload.len();
        let remote = Self::remote(dst, 0, len)?;
        let region = self.pool_region_of(&payload).ok_or_else(|| {
            RdmaError::InvalidArgument("payload is not in this connection's pools".into())
        })?;
        let _permit = self.one_sided_permit(len).await?;
        let rx = post(&self.shared, |qp| {
            qp.post_write_view(&region, payload, remote)
        })?;
        wait_one_sided(&self.shared, rx, len).await.res
    }

    /// RDMA READ of `len` bytes of the peer's exposed buffer into pool buffer `buf`, handed back
    /// once the READ completed. If this future is dropped, the buffer stays with the QP until
    /// the completion arrives (or the QP is destroyed), then returns to the pool.
    pub(crate) async fn read_into_pool(
        &self,
        buf: PoolBuf,
        src: &RemoteToken,
        len: usize,
    ) -> Result<PoolBuf, RdmaError> {
        let remote = Self::remote(src, 0, len)?;
        self.pool_op(len, |qp| {
            qp.post_read_pool(buf, len, remote).map_err(|(e, _)| e)
        })
        .await
    }

    /// RDMA WRITE of the first `len` bytes of pool buffer `buf` into the peer's granted buffer;
    /// the buffer is handed back once the WRITE completed (kept like `read_into_pool`'s).
    pub(crate) async fn write_from_pool(
        &self,
        buf: PoolBuf,
        dst: &RemoteToken,
        len: usize,
    ) -> Result<PoolBuf, RdmaError> {
        let remote = Self::remote(dst, 0, len)?;
        self.pool_op(len, |qp| {
            qp.post_write_pool(buf, len, remote).map_err(|(e, _)| e)
        })
        .await
    }

    async fn pool_op(
        &self,
        len: usize,
        op: impl FnOnce(&Qp) -> Result<u64, RdmaError>,
    ) -> Result<PoolBuf, RdmaError> {
        let _permit = self.one_sided_permit(len).await?;
        let rx = post(&self.shared, op)?;
        let done = wait_one_sided(&self.shared, rx, len).await;
        done.res?;
        done.buf.ok_or_else(|| {
            RdmaError::Closed(Some("RDMA operation completed without its buffer".into()))
        })
    }

    /// Sends one message (at most [`RdmaConnection::max_message_size`] bytes) with a SEND into
    /// one of the peer's posted receive slots; returns when the SEND completed locally.
    pub async fn send(&self, msg: &[u8]) -> Result<(), RdmaError> {
        self.start_send(msg).await?.wait().await
    }

    /// Posts a SEND of `msg` (waiting only for a free send slot) and returns at once; await
    /// [`SendCompletion::wait`] for its completion. SENDs posted one after another arrive in
    /// that order, so several can be in flight.
    pub async fn start_send(&self, msg: &[u8]) -> Result<SendCompletion, RdmaError> {
        self.check_open()?;
        let permit = self.send_permit().await?;
        self.post_slot(self.filled_slot(msg)?, permit)
    }

    /// Posts a SEND of `msg` now, from a send slot that is free now, without waiting for
    /// anything: `Ok(false)` (nothing posted) if every slot is in flight. The slot comes back
    /// when its completion is polled, by the completion driver or by
    /// [`poll_completions`](Self::poll_completions). With `poll_completions` and
    /// [`try_recv_bytes`](Self::try_recv_bytes) it makes a loop that never waits (run to
    /// completion, as the connection-layer floor of `examples/verbs-pingpong.rs --lean`).
    pub fn try_send(&self, msg: &[u8]) -> Result<bool, RdmaError> {
        let Some(permit) = self.try_send_permit() else {
            return Ok(false);
        };
        if msg.len() <= self.max_inline() {
            // posted inline straight from `msg`: no slot
            self.post_inline_now(msg, permit)?;
        } else {
            self.post_slot_now(self.filled_slot(msg)?, permit)?;
        }
        Ok(true)
    }

    /// A send slot from the pool holding a copy of `msg`, ready to post.
    fn filled_slot(&self, msg: &[u8]) -> Result<SendSlot<'_>, RdmaError> {
        let mut slot = self.send_slot(msg.len())?;
        slot.bytes()?.copy_from_slice(msg);
        Ok(slot)
    }

    /// Posts `slot` (written in place) as a SEND, in the place `permit` stands for; the
    /// returned completion gives both back.
    pub(crate) fn post_slot(
        &self,
        slot: SendSlot<'_>,
        permit: OwnedPermit,
    ) -> Result<SendCompletion, RdmaError> {
        let len = slot.len;
        let slot = slot.into_region();
        let rx = post(&self.shared, |qp| qp.post_send(&slot, 0, len))?;
        Ok(SendCompletion {
            rx,
            slot,
            shared: Arc::clone(&self.shared),
            _permit: permit,
        })
    }

    /// A send slot from the pool (a new one if the pool is empty) for a message of `len`
    /// bytes, to be written in place and posted with [`post_slot_now`](Self::post_slot_now);
    /// an error if `len` does not fit a slot. Dropped unposted, it goes back to the pool.
    pub(crate) fn send_slot(&self, len: usize) -> Result<SendSlot<'_>, RdmaError> {
        if len > self.shared.slot_size {
            return Err(RdmaError::InvalidArgument(format!(
                "message of {len} bytes exceeds the {}-byte slot",
                self.shared.slot_size
            )));
        }
        let pooled = lock(&self.shared.send_pool).pop();
        let region = match pooled {
            Some(s) => s,
            None => Region::new(self.shared.qp.device(), self.shared.slot_size)?,
        };
        Ok(SendSlot {
            region: Some(region),
            len,
            shared: &self.shared,
        })
    }

    /// Waits for a free SEND slot, for [`post_slot`](Self::post_slot).
    pub(crate) async fn send_permit(&self) -> Result<OwnedPermit, RdmaError> {
        self.shared
            .send_permits
            .acquire_owned()
            .await
            .map_err(|_| RdmaError::Closed(None))
    }

    /// A send permit, if one is free now, for [`post_slot_now`](Self::post_slot_now) or
    /// [`post_inline_now`](Self::post_inline_now) (returned if dropped unposted).
    pub(crate) fn try_send_permit(&self) -> Option<Permit<'_>> {
        self.shared.send_permits.try_acquire().ok()
    }

    /// Counts a SEND about to be posted with no task waiting, in the place `permit` stands for
    /// (see `Shared::sends_out`): its completion, or a failure of the connection, returns the
    /// permit; so does `post` here if it fails (nothing was posted then).
    fn post_counted(
        &self,
        permit: Permit<'_>,
        post: impl FnOnce() -> Result<(), RdmaError>,
    ) -> Result<(), RdmaError> {
        self.shared.sends_out.fetch_add(1, Ordering::AcqRel);
        permit.forget();
        post().inspect_err(|_| self.shared.send_retired())
    }

    /// Posts `slot` (written in place) as a SEND now, in the place `permit` stands for, with
    /// no task waiting for it: the completion driver puts the slot back in the pool (and
    /// releases the permit) when the SEND completes.
    pub(crate) fn post_slot_now(
        &self,
        slot: SendSlot<'_>,
        permit: Permit<'_>,
    ) -> Result<(), RdmaError> {
        let len = slot.len;
        let slot = slot.into_region();
        self.shared.check_open()?;
        // the QP keeps the slot until the SEND is retired: nothing of it in this connection's
        // tables, so neither the post nor the completion takes the state lock
        self.post_counted(permit, || {
            self.shared.qp.post_send_slot(slot, len).map(drop)
        })
    }

    /// Posts `bytes` (at most [`max_inline`](Self::max_inline)) as an inline SEND now, in the
    /// place `permit` stands for, with no task waiting for it: no send slot, since the post
    /// copies the bytes, and nothing kept in the QP's tables; the permit is released when the
    /// SEND completes.
    pub(crate) fn post_inline_now(
        &self,
        bytes: &[u8],
        permit: Permit<'_>,
    ) -> Result<(), RdmaError> {
        self.shared.check_open()?;
        self.post_counted(permit, || self.shared.qp.post_inline_send(bytes))
    }

    /// How long the caller of a lone call may poll the CQ itself while it waits for its
    /// answer ([`poll_completions`](Self::poll_completions)): the spin window (zero: never).
    pub(crate) fn spin_window(&self) -> Duration {
        self.shared.spin.window()
    }

    /// How long each of that caller's polling bursts may last before it lets the runtime's
    /// other tasks run ([`RdmaOptions::poll_burst`] on a connection we connected; zero, the
    /// RPC client's own default, on one we accepted).
    pub(crate) fn caller_burst(&self) -> Duration {
        self.caller_burst
    }

    /// Polls the completion queue once from the calling task and handles what it finds, as the
    /// completion driver does: received messages become ready for
    /// [`try_recv_bytes`](Self::try_recv_bytes) (or [`recv_bytes`](Self::recv_bytes)), completed
    /// SENDs free their slots. Whether it found anything; it returns at once if another task
    /// is polling. For a task that spins on one connection instead of waiting (a lone call's
    /// caller waiting for its answer, or a loop that never waits): what it finds counts as
    /// activity for the connection's spin window, so the driver does not arm the CQ (an event
    /// per completion) while callers receive for themselves.
    pub fn poll_completions(&self) -> bool {
        let found = matches!(self.shared.poll_once(false), Ok(n) if n > 0);
        if found {
            self.shared.spin.caller_found();
        }
        found
    }

    /// As [`poll_completions`](Self::poll_completions), but each small received message (see
    /// [`COPY_AT_MOST`]) is first offered to `offer`, borrowed from the slot it arrived in: if
    /// `offer` returns true it consumed the message, which then never reaches the installed
    /// receiver (no copy is made of it, and the same slot is posted again by the next poll,
    /// whoever makes it, which then calls [`on_lent_reposted`](Self::on_lent_reposted)'s
    /// hook). Messages before and after it reach the receiver as usual, in order. For the RPC
    /// engine's lone callers, who decode their answers in place
    /// (`DirectSend::progress_with`); on a connection with no receiver installed, or of a
    /// shared receive queue, nothing is offered.
    pub(crate) fn poll_completions_offering(&self, offer: &mut Offer<'_>) -> bool {
        let shared = &*self.shared;
        let Some(mut polled) = shared.try_poll_lock() else {
            return false;
        };
        let found = matches!(shared.poll_locked(&mut polled, None, Some(offer)), Ok(n) if n > 0);
        if found {
            shared.spin.caller_found();
        }
        found
    }

    /// Offers every small received message (see [`COPY_AT_MOST`]) to `offered` from now on,
    /// borrowed from the slot it arrived in, before it is copied out for the installed
    /// receiver (after a lone caller's own offer, [`poll_completions_offering`]
    /// (Self::poll_completions_offering)): what it consumes never reaches the receiver. For
    /// a server, which runs requests where they arrive. Messages of a shared receive queue are
    /// not offered. Once only: false if something was installed already.
    pub(crate) fn offer_to(&self, offered: Box<dyn Offered>) -> bool {
        self.shared.standing.set(offered).is_ok()
    }

    /// Calls `back` each time the slot of a message that an offer of
    /// [`poll_completions_offering`](Self::poll_completions_offering) consumed is posted again
    /// (by the poll after the one that found it): the RPC engine returns the slot's credit to
    /// the peer then, not before. Once only: false if a hook was set already.
    pub(crate) fn on_lent_reposted(&self, back: Box<dyn Fn() + Send + Sync>) -> bool {
        self.shared.lent_reposted.set(back).is_ok()
    }

    /// Whether no SEND is in flight (every send slot is free).
    pub(crate) fn sends_idle(&self) -> bool {
        self.sends_in_flight() == 0
    }

    /// Waits until no SEND is in flight (every slot is back), e.g. before closing.
    pub(crate) async fn sends_done(&self) {
        self.shared.send_permits.wait_all_free().await;
    }

    /// Receives the next message (a copy); `Ok(None)` once the peer disconnected.
    pub async fn recv(&self) -> Result<Option<Vec<u8>>, RdmaError> {
        Ok(self.recv_bytes().await?.map(|b| b.to_vec()))
    }

    /// Receives the next message: a view of the registered slot it arrived in (no copy; the
    /// slot returns to the pool when the last view is dropped, and a fresh one is posted in its
    /// place), or a copy if the slot pool has none free; `Ok(None)` once the peer disconnected.
    pub async fn recv_bytes(&self) -> Result<Option<bytes::Bytes>, RdmaError> {
        let mut rx = self.recv_rx.lock().await;
        if rx.is_empty() && lock(&self.shared.state).disconnected {
            return Ok(None);
        }
        let mut early = None;
        self.shared
            .spin_until(|| {
                early = ready(&mut rx);
                early.is_some()
            })
            .await;
        let ev = match early {
            Some(ev) => ev,
            None => rx.recv().await,
        };
        self.shared.take_received(ev)
    }

    /// Takes the next received message if one is ready, without waiting and without polling
    /// the completion queue (see [`poll_completions`](Self::poll_completions)): `None` if none
    /// is ready (or another task is receiving), otherwise what
    /// [`recv_bytes`](Self::recv_bytes) would return. Unlike an `async` receive polled once,
    /// it does not draw on tokio's cooperative budget, so a task may call it in a loop that
    /// never yields.
    pub fn try_recv_bytes(&self) -> Option<Result<Option<bytes::Bytes>, RdmaError>> {
        let mut rx = self.recv_rx.try_lock().ok()?;
        match ready(&mut rx) {
            Some(ev) => Some(self.shared.take_received(ev)),
            None => lock(&self.shared.state).disconnected.then_some(Ok(None)),
        }
    }

    /// Polls the completion queue once from the calling task, as
    /// [`poll_completions`](Self::poll_completions) does, and hands each message it finds to
    /// `on_message` *borrowed* from the registered slot it arrived in: the same slot is posted
    /// again as soon as `on_message` returns, so no fresh slot is leased and no owner is made
    /// for the message (the connection layer's leanest receive, for loops that never wait, as
    /// `examples/verbs-pingpong.rs --lean --borrow` runs). Messages the completion driver
    /// received before come first, in order. It does not wait: it returns at once if another
    /// task is polling or receiving.
    ///
    /// `Ok(Some(n))`: `n` messages were handed on (0: none was there). `Ok(None)`: the stream
    /// ended (the peer disconnected), after every message before the end was handed on, this
    /// call's included. `Err`: the connection failed (messages before the failure were handed
    /// on).
    /// `on_message` runs while this connection's completions are being handled, so it may post
    /// ([`try_send`](Self::try_send)) but a poll from within it finds nothing.
    pub fn poll_recv_with(
        &self,
        mut on_message: impl FnMut(&[u8]),
    ) -> Result<Option<usize>, RdmaError> {
        let Ok(mut rx) = self.recv_rx.try_lock() else {
            return Ok(Some(0));
        };
        let shared = &*self.shared;
        let Some(mut polled) = shared.try_poll_lock() else {
            return Ok(Some(0));
        };
        let mut n = 0;
        let mut lend = |msg: &[u8]| {
            n += 1;
            on_message(msg);
        };
        // what the driver queued, first; then what this poll finds; then what it could not
        // lend (a failure, or the end of the stream)
        if drain(shared, &mut rx, &mut lend)? {
            return Ok(None);
        }
        if shared.poll_locked(&mut polled, Some(&mut lend), None)? > 0 {
            shared.spin.caller_found();
        }
        if drain(shared, &mut rx, &mut lend)? {
            return Ok(None);
        }
        if n == 0 && lock(&shared.state).disconnected {
            return Ok(None);
        }
        Ok(Some(n))
    }

    /// Sends every message received from now on (and those received before, first) to
    /// `receiver`, called by the task that polls the CQ as it finds them, instead of to
    /// [`recv_bytes`](Self::recv_bytes): one task hand-off less per message. What ends the
    /// stream (`Ok(None)` or an error) is not seen there; [`forward_end`](Self::forward_end)
    /// passes it on.
    pub(crate) fn deliver_to(&self, receiver: Receiver) {
        // under the poll lock no completion is being dispatched: what came before is
        // handed on first, in order
        let _polling = lock(&self.shared.poll_lock);
        let mut rx = self
            .recv_rx
            .try_lock()
            .expect("deliver_to: nothing receives from this connection yet");
        let mut ended = false;
        while !ended {
            let ev = match rx.try_recv() {
                Ok(ev) => ev,
                Err(_) => break,
            };
            let item = self.shared.take_received(Some(ev));
            ended = !matches!(item, Ok(Some(_)));
            receiver(item);
        }
        if self.shared.receiver.set(receiver).is_err() {
            unreachable!("deliver_to: a receiver was installed twice");
        }
    }

    /// After [`deliver_to`](Self::deliver_to): waits for the end of the stream (the peer
    /// disconnected, the connection was closed or failed) and passes it to the receiver.
    pub(crate) async fn forward_end(&self) {
        let mut rx = self.recv_rx.lock().await;
        loop {
            let item = self.shared.take_received(rx.recv().await);
            let end = !matches!(item, Ok(Some(_)));
            if let Some(receiver) = self.shared.receiver.get() {
                receiver(item);
            }
            if end {
                return;
            }
        }
    }

    /// Allocates a buffer registered on this connection's device.
    pub fn alloc_buffer(&self, len: usize) -> Result<RdmaBuffer, RdmaError> {
        Ok(RdmaBuffer {
            region: Region::new(self.shared.qp.device(), len)?,
        })
    }

    fn remote(token: &RemoteToken, off: u64, len: usize) -> Result<RemoteAddr, RdmaError> {
        match off.checked_add(len as u64) {
            Some(end) if end <= token.len => Ok(RemoteAddr {
                addr: token.addr + off,
                rkey: token.rkey,
            }),
            _ => Err(RdmaError::InvalidArgument(format!(
                "remote range {off}+{len} outside the peer's {}-byte buffer",
                token.len
            ))),
        }
    }

    /// RDMA WRITE of `src[src_off..src_off+len]` into the peer's exposed buffer at `dst_off`.
    /// The peer sees no completion: tell it with a message (on iWARP there is no write-with-imm).
    pub async fn write(
        &self,
        src: &mut RdmaBuffer,
        src_off: usize,
        dst: &RemoteToken,
        dst_off: u64,
        len: usize,
    ) -> Result<(), RdmaError> {
        let remote = Self::remote(dst, dst_off, len)?;
        let region = &src.region;
        self.post_and_wait(len, |qp| qp.post_write(region, src_off, len, remote))
            .await
    }

    /// RDMA READ of `len` bytes of the peer's exposed buffer at `src_off` into
    /// `dst[dst_off..dst_off+len]`.
    pub async fn read(
        &self,
        dst: &mut RdmaBuffer,
        dst_off: usize,
        src: &RemoteToken,
        src_off: u64,
        len: usize,
    ) -> Result<(), RdmaError> {
        let remote = Self::remote(src, src_off, len)?;
        let region = &dst.region;
        self.post_and_wait(len, |qp| qp.post_read(region, dst_off, len, remote))
            .await
    }

    /// Disconnects (the peer's `recv` returns `None`); pending operations fail.
    pub fn close(&self) {
        {
            let mut st = lock(&self.shared.state);
            st.disconnected = true;
            if st.closed.is_none() {
                st.closed = Some("closed locally".into());
                self.shared.closing.store(true, Ordering::Release);
            }
        }
        let _ = self.shared.recv_tx.send(RecvEvent::Eof);
        if let Err(e) = self.id.disconnect() {
            tracing::debug!("transport-rdma: {e}");
        }
        if let Err(e) = self.shared.qp.set_error() {
            tracing::debug!("transport-rdma: {e}");
        }
    }
}

impl Drop for RdmaConnection {
    fn drop(&mut self) {
        self.close();
        // The driver holds the QP and CQ; aborting it lets them go. Buffers of work requests
        // still posted are released only when the QP is destroyed (see verbs.rs).
        self.driver.abort();
    }
}

/// Posts a signaled work request (under the state lock, so its completion cannot be dispatched
/// before the waiter is registered); returns where its completion will be reported.
fn post(
    shared: &Shared,
    op: impl FnOnce(&Qp) -> Result<u64, RdmaError>,
) -> Result<oneshot::Receiver<Done>, RdmaError> {
    let mut st = lock(&shared.state);
    if let Some(why) = &st.closed {
        return Err(RdmaError::Closed(Some(why.clone())));
    }
    let wr_id = op(&shared.qp)?;
    let (tx, rx) = oneshot::channel();
    let clash = st.waiters.insert(wr_id, tx);
    debug_assert!(clash.is_none(), "a work-request id outlived its request");
    Ok(rx)
}

/// Waits for a posted RDMA READ or WRITE of `len` bytes (see [`wait_completion`]), busy-polling
/// first only if such transfers completed within the spin window of late
/// ([`SpinWindow::worth_spinning_for`]); records how long it took.
async fn wait_one_sided(shared: &Shared, rx: oneshot::Receiver<Done>, len: usize) -> Done {
    let posted = shared.spin.now();
    let done = if shared.spin.worth_spinning_for(len) {
        wait_completion(shared, rx).await
    } else {
        wait_event(rx).await
    };
    if done.res.is_ok() {
        shared
            .spin
            .one_sided_done(len, shared.spin.now().saturating_sub(posted));
    }
    done
}

/// Waits for a posted work request's completion, busy-polling inline first.
async fn wait_completion(shared: &Shared, mut rx: oneshot::Receiver<Done>) -> Done {
    let mut early = None;
    shared
        .spin_until(|| match rx.try_recv() {
            Ok(r) => {
                early = Some(r);
                true
            }
            Err(oneshot::error::TryRecvError::Empty) => false,
            Err(oneshot::error::TryRecvError::Closed) => true,
        })
        .await;
    if let Some(r) = early {
        return r;
    }
    wait_event(rx).await
}

/// Waits for the completion driver (or another task polling) to hand over a completion.
async fn wait_event(rx: oneshot::Receiver<Done>) -> Done {
    rx.await.unwrap_or_else(|_| Done {
        res: Err(RdmaError::Closed(Some("completion driver stopped".into()))),
        buf: None,
    })
}

/// A send slot taken from the pool, written in place before it is posted
/// ([`RdmaConnection::send_slot`]); it goes back to the pool if dropped unposted.
pub(crate) struct SendSlot<'a> {
    /// until posted
    region: Option<Arc<Region>>,
    /// the message's length
    len: usize,
    shared: &'a Shared,
}

impl SendSlot<'_> {
    /// The message's bytes in the slot, to be written.
    pub(crate) fn bytes(&mut self) -> Result<&mut [u8], RdmaError> {
        let region = self
            .region
            .as_mut()
            .expect("a slot has its region until posted");
        let bytes = Region::bytes_mut(region).ok_or(RdmaError::BufferBusy)?;
        Ok(&mut bytes[..self.len])
    }

    fn into_region(mut self) -> Arc<Region> {
        self.region
            .take()
            .expect("a slot has its region until posted")
    }
}

impl Drop for SendSlot<'_> {
    fn drop(&mut self) {
        if let Some(region) = self.region.take() {
            lock(&self.shared.send_pool).push(region);
        }
    }
}

/// A posted SEND (see [`RdmaConnection::start_send`]). Dropping it without waiting is fine: the
/// slot stays reserved until the device is done with it.
pub struct SendCompletion {
    rx: oneshot::Receiver<Done>,
    slot: Arc<Region>,
    shared: Arc<Shared>,
    _permit: OwnedPermit,
}

impl std::fmt::Debug for SendCompletion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendCompletion").finish_non_exhaustive()
    }
}

impl SendCompletion {
    /// Waits until the SEND completed locally (on a reliable connection: the peer has it).
    pub async fn wait(self) -> Result<(), RdmaError> {
        self.finish(true).await
    }

    /// Like [`wait`](Self::wait), without busy-polling for the completion: for a sender that
    /// only needs the slot back (the completion driver polls the CQ anyway), so that it takes
    /// no turns from the tasks that wait for replies.
    pub(crate) async fn settled(self) -> Result<(), RdmaError> {
        self.finish(false).await
    }

    /// Waits for the completion (busy-polling first if `spin`); the slot goes back to the pool
    /// if the SEND succeeded.
    async fn finish(self, spin: bool) -> Result<(), RdmaError> {
        let SendCompletion {
            rx,
            slot,
            shared,
            _permit,
        } = self;
        let res = if spin {
            wait_completion(&shared, rx).await.res
        } else {
            match rx.await {
                Ok(done) => done.res,
                Err(_) => Err(RdmaError::Closed(Some("completion driver stopped".into()))),
            }
        };
        if res.is_ok() {
            lock(&shared.send_pool).push(slot);
        }
        res
    }
}

/// How long a connection keeps polling its CQ after the last completion before it arms the CQ
/// and sleeps ([`RdmaOptions::busy_poll`], [`RdmaOptions::busy_poll_max`]).
///
/// Twice the longest recent gap between two completions (a decaying maximum: it loses an eighth
/// at each completion), within `[floor, ceiling]`; gaps above the ceiling are idle time and
/// change nothing. A connection in a call-and-answer rhythm thus keeps polling across its own
/// round trip, whatever the fabric's, and an idle one sleeps after at most `ceiling`. With
/// `ceiling <= floor` the window is `floor`, fixed.
struct SpinWindow {
    floor: u64,
    ceiling: u64,
    base: Instant,
    /// nanoseconds from `base` to the last completion
    last: AtomicU64,
    /// the decaying maximum of recent gaps, in nanoseconds
    gap: AtomicU64,
    /// nanoseconds from `base` to the last completion a caller found for itself
    /// ([`RdmaConnection::poll_completions`])
    by_caller: AtomicU64,
    /// nanoseconds per KiB that this connection's RDMA READs and WRITEs took recently, from
    /// post to completion (queueing behind others included), a moving average; 0 until one
    /// completed
    per_kib: AtomicU64,
}

impl SpinWindow {
    fn new(floor: Duration, ceiling: Duration) -> SpinWindow {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        SpinWindow {
            floor: ns(floor),
            ceiling: ns(ceiling),
            base: Instant::now(),
            last: AtomicU64::new(0),
            gap: AtomicU64::new(0),
            by_caller: AtomicU64::new(0),
            per_kib: AtomicU64::new(0),
        }
    }

    /// An RDMA READ or WRITE of `len` bytes completed `took` nanoseconds after it was posted:
    /// moves the average an eighth of the way to it. Tasks that finish transfers at the same
    /// moment may overwrite each other's sample (a load, then a store), which an average shrugs
    /// off.
    fn one_sided_done(&self, len: usize, took: u64) {
        let old = self.per_kib.load(Ordering::Relaxed);
        let new = took / kib(len);
        let avg = if old == 0 {
            new
        } else {
            old - old / 8 + new / 8
        };
        self.per_kib.store(avg.max(1), Ordering::Relaxed);
    }

    /// Whether a task waiting for an RDMA READ or WRITE of `len` bytes should busy-poll for it
    /// first: not if such transfers took longer than the spin window of late. A spin that cannot
    /// succeed only takes the CPU from other work (on a soft device, the device's own), while the
    /// completion driver still finds the completion (and spins itself, for whatever comes next).
    fn worth_spinning_for(&self, len: usize) -> bool {
        self.per_kib
            .load(Ordering::Relaxed)
            .saturating_mul(kib(len))
            < self.window_ns()
    }

    /// Nanoseconds since `base`.
    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Completions were found at `now` (nanoseconds since `base`). Called under the poll lock,
    /// so the relaxed loads and stores do not race with each other.
    fn on_completions(&self, now: u64) {
        let gap = now.saturating_sub(self.last.swap(now, Ordering::Relaxed));
        if self.ceiling > self.floor && gap <= self.ceiling {
            let old = self.gap.load(Ordering::Relaxed);
            self.gap.store(gap.max(old - old / 8), Ordering::Relaxed);
        }
    }

    /// A caller polling for its own answer found completions (just now: `last` is their time).
    fn caller_found(&self) {
        self.by_caller
            .store(self.last.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Nanoseconds from `base` to the last completion a caller found for itself.
    fn last_by_caller(&self) -> u64 {
        self.by_caller.load(Ordering::Relaxed)
    }

    /// The current window.
    fn window(&self) -> Duration {
        Duration::from_nanos(self.window_ns())
    }

    /// The current window, in nanoseconds (no conversion on the completion driver's turns).
    fn window_ns(&self) -> u64 {
        if self.ceiling <= self.floor {
            self.floor
        } else {
            self.gap
                .load(Ordering::Relaxed)
                .saturating_mul(2)
                .clamp(self.floor, self.ceiling)
        }
    }
}

/// `len` bytes in whole KiB, at least one (the unit of [`SpinWindow`]'s transfer times).
fn kib(len: usize) -> u64 {
    (len as u64 / 1024).max(1)
}

/// Lets the runtime's other ready tasks run once, then resumes: one turn of a spin loop.
///
/// Unlike [`tokio::task::yield_now`], which defers the wake-up until the worker has polled its
/// I/O driver (an `epoll_wait` system call on every turn), this puts the task back at the end
/// of the run queue at once; the worker still polls its driver every few dozen tasks. A spin
/// that lasts at most the spin window therefore costs no system call per turn.
fn spin_yield() -> impl std::future::Future<Output = ()> {
    let mut yielded = false;
    std::future::poll_fn(move |cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
}

/// The completion driver of one connection: drains the CQ, arms it and sleeps on the
/// completion channel's fd (tasks waiting for a completion busy-poll inline first, see
/// `Shared::spin_until`); also handles the id's rdma_cm events. Within the spin window it
/// lets the runtime's other tasks run after every poll, or after every `burst` of polling
/// ([`RdmaOptions::poll_burst`]).
async fn drive(
    shared: Arc<Shared>,
    afd: AsyncFd<verbs::FdOwner<Cq>>,
    mut cm_rx: mpsc::UnboundedReceiver<CmEvent>,
    burst: Duration,
) {
    let cq = Arc::clone(&afd.get_ref().0);
    let mut cm_open = true;
    let burst = u64::try_from(burst.as_nanos()).unwrap_or(u64::MAX);
    loop {
        // Keep polling while completions keep coming, and for the spin window after the last one,
        // before arming: an armed CQ costs the provider work per completion (rxe schedules a
        // tasklet for every event) and us a wake-up, an event read and a re-arm, each a system
        // call. Busy traffic therefore never arms the CQ; an idle connection arms it after
        // the spin window and sleeps.
        // (nanoseconds from the window's base) from now, or from the last completion that
        // this driver found, or a caller polling for its own answer
        // (`RdmaConnection::poll_completions`)
        let mut last = shared.spin.now();
        // when this burst of polling began
        let mut burst_from = last;
        // when the connection's rdma_cm events were last looked at (see `CM_LOOK`)
        let mut cm_looked = last;
        loop {
            let found = match shared.poll_once(true) {
                Ok(n) => n > 0,
                Err(_) => return,
            };
            let now = shared.spin.now();
            if found {
                last = now;
            }
            if cm_open && now.saturating_sub(cm_looked) >= CM_LOOK {
                cm_looked = now;
                match cm_rx.try_recv() {
                    Ok(ev) => on_cm_event(&shared, ev),
                    Err(mpsc::error::TryRecvError::Empty) => {}
                    Err(mpsc::error::TryRecvError::Disconnected) => cm_open = false,
                }
            }
            let since = now.saturating_sub(last.max(shared.spin.last_by_caller()));
            if since >= shared.spin.window_ns() {
                break;
            }
            if burst == 0 || now.saturating_sub(burst_from) >= burst {
                spin_yield().await;
                if burst != 0 {
                    burst_from = shared.spin.now();
                }
            }
        }
        if let Err(e) = cq.arm() {
            fail_all(&shared, &format!("{e}"));
            return;
        }
        // a completion that arrived before arming raises no event: poll once more
        match shared.poll_once(true) {
            Ok(0) => {}
            Ok(_) => continue,
            Err(_) => return,
        }
        tokio::select! {
            ready = afd.readable() => match ready {
                Ok(mut guard) => {
                    if let Err(e) = cq.drain_events() {
                        tracing::warn!("transport-rdma: {e}");
                    }
                    guard.clear_ready();
                },
                Err(e) => {
                    fail_all(&shared, &format!("completion channel poll failed: {e}"));
                    return;
                },
            },
            ev = cm_rx.recv(), if cm_open => match ev {
                Some(ev) => on_cm_event(&shared, ev),
                None => cm_open = false,
            },
        }
    }
}

/// How often (nanoseconds) a completion driver that keeps polling looks at its connection's
/// rdma_cm events: every millisecond, not on every poll, which would put the event channel's
/// code on every call's path (a driver that sleeps wakes for them at once). A disconnection
/// shows on the CQ first anyway (the QP's error state flushes what is posted).
const CM_LOOK: u64 = 1_000_000;

/// How long a connecting side on iWARP waits to hear from its peer after the set-up before it
/// first nudges it ([`nudge_until_heard`]); each further wait doubles, up to [`NUDGE_MAX`].
const NUDGE_FIRST: Duration = Duration::from_millis(20);
/// The longest wait between two nudges.
const NUDGE_MAX: Duration = Duration::from_secs(1);
/// Nudges at most (about 3.3 s of silence): a stranded packet is freed by the first nudge that
/// arrives after the window described at [`nudge_until_heard`], which lasts for as long as
/// the accepting side's kernel thread is held up (milliseconds); a peer that is silent by
/// design (a protocol in which only this side talks) is left alone after that.
const NUDGE_LIMIT: u32 = 8;

/// Nudges a silent peer until it has been heard from: the connecting side of an iWARP
/// connection posts an RDMA WRITE of no bytes after [`NUDGE_FIRST`], then after each doubled
/// wait, until a receive completes, the connection is gone, or [`NUDGE_LIMIT`] nudges went.
///
/// Why: soft-iWARP (siw; Linux 6.1's `siw_accept`) sends the MPA reply and only then moves the
/// accepted socket's receive callback from its connection manager to the QP. A packet that the
/// connecting side sends in between (it may send as soon as the reply arrived) lands in the
/// socket while the connection manager's callback, already in RDMA mode, ignores it, and the
/// QP reads the socket only when the next packet arrives. A client whose first message waits
/// for an answer (an RPC greeting) then waits until its timeout: seen in the guest tests with
/// the host loaded (docs/rdma-history.md). A nudge is that next packet: the peer's QP reads
/// what was stranded with it. An RDMA WRITE of no bytes takes no receive slot and no credit at
/// the peer and raises no completion there, so the peer's protocol never sees it, and it may
/// go as often as needed. A peer that answers within [`NUDGE_FIRST`] is never nudged.
async fn nudge_until_heard(shared: Weak<Shared>) {
    let mut wait = NUDGE_FIRST;
    // the last nudge's completion: one nudge at a time
    let mut last: Option<oneshot::Receiver<Done>> = None;
    loop {
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(NUDGE_MAX);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.heard.load(Ordering::Relaxed) || shared.check_open().is_err() {
            return;
        }
        if let Some(rx) = &mut last {
            match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => continue,
                Ok(Done { res: Err(_), .. }) => return,
                _ => {}
            }
        }
        // a place of the send queue's for one-sided requests, given back at once: the queue
        // holds as many again for requests whose waiter left before their completion
        let Ok(_place) = shared.one_sided_permits.try_acquire() else {
            continue;
        };
        match post(&shared, Qp::post_empty_write) {
            Ok(rx) => last = Some(rx),
            Err(_) => return,
        }
        let n = shared.nudges.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(
            "transport-rdma: qp {}: nothing heard from the peer since the set-up; nudge {n}",
            shared.qp.qp_num()
        );
        if n >= NUDGE_LIMIT {
            return;
        }
    }
}

fn on_cm_event(shared: &Shared, ev: CmEvent) {
    match ev.kind {
        // A peer that dies while the connection is being set up can make rdma_cm reject it
        // after our side saw it established (rxe: REJ after our RTU): the connection is gone
        // all the same, so it ends here, not only when the keep-alive gives up.
        CmEventKind::Disconnected
        | CmEventKind::DeviceRemoval
        | CmEventKind::Rejected
        | CmEventKind::ConnectError
        | CmEventKind::Unreachable => {
            tracing::debug!("transport-rdma: {:?} on qp {}", ev.kind, shared.qp.qp_num());
            {
                let mut st = lock(&shared.state);
                st.disconnected = true;
                if st.closed.is_none() {
                    st.closed = Some(format!("{:?}", ev.kind).to_lowercase());
                    shared.closing.store(true, Ordering::Release);
                }
            }
            // Deliver what already arrived first: the rdma_cm event travels apart from the
            // data, so messages the peer sent (and saw completed) before disconnecting may
            // still sit in our CQ.
            while matches!(shared.poll_once(true), Ok(n) if n > 0) {}
            let _ = shared.recv_tx.send(RecvEvent::Eof);
            // flush what is posted: waiters fail
            if let Err(e) = shared.qp.set_error() {
                tracing::debug!("transport-rdma: {e}");
            }
            // ... and do not wait for those flushes: siw has been seen to report none for an
            // RDMA READ in flight when the connection dropped, which left its waiter (and the
            // connection it holds) waiting for ever. The requests' buffers stay with the QP
            // until a completion retires them or the QP is destroyed.
            fail_waiters(shared, "disconnected");
        }
        _ => tracing::debug!(
            "transport-rdma: rdma_cm event {:?} on an established connection",
            ev.kind
        ),
    }
}

/// What the receive channel holds now: `Some(Some(event))`, `Some(None)` once it is closed (the
/// end of the stream), `None` if nothing is there yet.
fn ready(rx: &mut mpsc::UnboundedReceiver<RecvEvent>) -> Option<Option<RecvEvent>> {
    match rx.try_recv() {
        Ok(ev) => Some(Some(ev)),
        Err(mpsc::error::TryRecvError::Disconnected) => Some(None),
        Err(mpsc::error::TryRecvError::Empty) => None,
    }
}

/// Hands the messages waiting in `rx` to `lend`, in order; `true` at the end of the stream.
fn drain(
    shared: &Shared,
    rx: &mut mpsc::UnboundedReceiver<RecvEvent>,
    lend: &mut Lend<'_>,
) -> Result<bool, RdmaError> {
    while let Some(ev) = ready(rx) {
        match shared.take_received(ev)? {
            Some(msg) => lend(&msg),
            None => return Ok(true),
        }
    }
    Ok(false)
}

/// What takes a received message borrowed from its slot (see `dispatch`).
type Lend<'a> = dyn FnMut(&[u8]) + 'a;

/// What small received messages are offered to before they are copied out (see
/// [`RdmaConnection::poll_completions_offering`]), with a copier into the poller's arena (as
/// in [`Offered::offer`]); true: consumed.
pub(crate) type Offer<'a> = dyn FnMut(&[u8], &mut dyn FnMut(&[u8]) -> bytes::Bytes) -> bool + 'a;

/// What a connection offers each small received message to, borrowed, whoever polls (see
/// [`RdmaConnection::offer_to`]).
pub(crate) trait Offered: Send + Sync {
    /// `msg`, borrowed from its slot; `copy` copies bytes into the poller's arena (as small
    /// messages are copied out for the receiver). True if it consumed `msg`: it then never
    /// reaches the receiver, and [`reposted`](Self::reposted) follows once its slot is
    /// posted again.
    fn offer(&self, msg: &[u8], copy: &mut dyn FnMut(&[u8]) -> bytes::Bytes) -> bool;

    /// The slot of the message [`offer`](Self::offer) consumed last is posted again.
    fn reposted(&self);
}

/// Handles polled completions: waiters woken, slots freed, received messages to the installed
/// receiver or to `recv_bytes`; or, with `lend` (and no receiver installed), each received
/// message handed to it borrowed from its slot, which is posted again at once (see
/// [`RdmaConnection::poll_recv_with`]); with `offer` (and a receiver installed), each small
/// message offered to it borrowed first, and handed on only if it did not consume it (see
/// [`RdmaConnection::poll_completions_offering`]).
fn dispatch(
    shared: &Shared,
    wcs: &[Wc],
    arena: &mut bytes::BytesMut,
    held: &mut Option<PoolBuf>,
    mut lend: Option<&mut Lend<'_>>,
    mut offer: Option<&mut Offer<'_>>,
) {
    if shared.receiver.get().is_some() {
        lend = None;
    } else {
        offer = None;
    }
    for wc in wcs {
        if wc.kind == WrKind::Recv {
            crate::probe::mark(crate::probe::Point::Recv);
            if !shared.heard.load(Ordering::Relaxed) {
                shared.heard.store(true, Ordering::Relaxed);
            }
        }
        // what this connection keeps for a work request leaves its tables before the QP retires
        // the request's id, which frees the id's slot for the next post
        let waiter = if wc.kind == WrKind::Recv || crate::verbs::keeps_no_waiter(wc.wr_id) {
            None
        } else {
            lock(&shared.state).waiters.remove(wc.wr_id)
        };
        let mem = if crate::verbs::is_inline_send(wc.wr_id) {
            // the QP keeps nothing for it: its send permit back
            shared.send_retired();
            None
        } else {
            shared.qp.retire(wc.wr_id)
        };
        let op = match wc.kind {
            WrKind::Recv => "RECV",
            WrKind::Send => "SEND",
            WrKind::Write => "RDMA WRITE",
            WrKind::Read => "RDMA READ",
            WrKind::Unknown => "unknown operation",
        };
        if !wc.ok() {
            let why = format!("{op}: {}", wc.status_str());
            if wc.is_flush() {
                tracing::debug!("transport-rdma: {why}");
            } else {
                tracing::warn!("transport-rdma: {why}");
            }
            shared.close(&why);
            if !wc.is_flush() {
                lock(&shared.state).failed.get_or_insert(why);
            }
        }
        match wc.kind {
            WrKind::Recv if shared.srq_share.is_some() => {
                let recv = &shared.srq_share.as_ref().expect("checked").recv;
                shared.received(srq_received(recv, wc, mem, op, arena));
            }
            WrKind::Recv => {
                let ev = match (wc.ok(), mem, lend.as_deref_mut()) {
                    (true, Some(Mem::Pool(buf)), Some(lend)) => {
                        match in_place(shared, buf, wc.byte_len as usize, lend) {
                            Ok(()) => continue,
                            Err(ev) => ev,
                        }
                    }
                    (true, Some(Mem::Pool(buf)), None) if wc.byte_len as usize <= COPY_AT_MOST => {
                        let offer = offer.as_deref_mut();
                        let standing = shared.standing.get();
                        let mut consumed = false;
                        let mut lent = false;
                        let read = read_in_place(shared, buf, wc.byte_len as usize, |msg| {
                            if let Some(offer) = offer {
                                if offer(msg, &mut |b| copy_out(arena, b)) {
                                    lent = true;
                                    return None;
                                }
                            }
                            if let Some(s) = standing {
                                if s.offer(msg, &mut |b| copy_out(arena, b)) {
                                    consumed = true;
                                    return None;
                                }
                            }
                            Some(RecvEvent::Copied(copy_out(arena, msg)))
                        });
                        let taken = match read {
                            Ok((taken, buf)) => {
                                if lent && held.is_none() {
                                    // posted again by the next poll (see `Poller::held`)
                                    *held = Some(buf);
                                } else if lent {
                                    shared.repost_lent(buf);
                                } else {
                                    repost(shared, buf);
                                }
                                taken
                            }
                            Err(ev) => Some(ev),
                        };
                        if let (true, Some(s)) = (consumed, standing) {
                            s.reposted();
                        }
                        match taken {
                            None => continue,
                            Some(ev) => ev,
                        }
                    }
                    (true, Some(r), _) => RecvEvent::Data(r, wc.byte_len as usize),
                    (true, None, _) => RecvEvent::Failed {
                        err: RdmaError::Completion {
                            op,
                            status: "completion for an unknown receive".into(),
                        },
                        flushed: false,
                    },
                    (false, _, _) => RecvEvent::Failed {
                        err: RdmaError::Completion {
                            op,
                            status: wc.status_str(),
                        },
                        flushed: wc.is_flush(),
                    },
                };
                shared.received(ev);
            }
            _ => {
                // release a region before waking the waiter, which may touch it at once; a pool
                // buffer goes to the waiter (or back to the pool if the waiter is gone)
                let buf = match mem {
                    Some(Mem::Pool(b)) => Some(b),
                    Some(Mem::Send { region }) => {
                        // the slot back in the pool before its permit is returned
                        if wc.ok() {
                            lock(&shared.send_pool).push(region);
                        }
                        shared.send_retired();
                        None
                    }
                    other => {
                        drop(other);
                        None
                    }
                };
                if let Some(w) = waiter {
                    let res = if wc.ok() {
                        Ok(())
                    } else {
                        Err(RdmaError::Completion {
                            op,
                            status: wc.status_str(),
                        })
                    };
                    let _ = w.send(Done { res, buf });
                }
            }
        }
    }
}

/// Hands the message received into slot `buf` (`len` bytes) to `take`, borrowed, and posts the
/// same slot again (a closed connection's goes back to the pool instead: its QP flushes what is
/// posted): no fresh slot leased and no owner made for the message. What `take` returned, or,
/// if the message cannot be taken so (a completion longer than its slot), the event to queue
/// instead. Lends to `poll_recv_with`'s callers, and copies out small messages (see
/// [`COPY_AT_MOST`]).
fn in_place<R>(
    shared: &Shared,
    buf: PoolBuf,
    len: usize,
    take: impl FnOnce(&[u8]) -> R,
) -> Result<R, RecvEvent> {
    let (taken, buf) = read_in_place(shared, buf, len, take)?;
    repost(shared, buf);
    Ok(taken)
}

/// [`in_place`] without the posting: what `take` returned, and the slot, to be posted again
/// by the caller ([`repost`], or later: `Poller::held`).
fn read_in_place<R>(
    shared: &Shared,
    mut buf: PoolBuf,
    len: usize,
    take: impl FnOnce(&[u8]) -> R,
) -> Result<(R, PoolBuf), RecvEvent> {
    if len > buf.len().max(shared.slot_size) {
        // `take_received` turns it into the error
        return Err(RecvEvent::Data(Mem::Pool(buf), len));
    }
    buf.set_len(len);
    let taken = take(buf.bytes());
    Ok((taken, buf))
}

/// Posts a receive slot again, unless the connection is closing (its QP flushes what is
/// posted: the slot goes back to the pool instead); whether it did.
#[inline(always)]
fn repost(shared: &Shared, buf: PoolBuf) -> bool {
    if shared.check_open().is_err() {
        return false;
    }
    match shared.qp.post_recv_pool(buf) {
        Ok(_) => true,
        Err((e, _)) => {
            shared.close(&format!("re-posting a receive failed: {e}"));
            false
        }
    }
}

/// `msg` copied into `arena` (see [`ARENA_CHUNK`]).
fn copy_out(arena: &mut bytes::BytesMut, msg: &[u8]) -> bytes::Bytes {
    if arena.capacity() < msg.len() {
        // reclaims the chunk if no copy of it is left, else allocates another
        arena.reserve(ARENA_CHUNK);
    }
    arena.extend_from_slice(msg);
    arena.split().freeze()
}

/// A receive of a shared queue completed: a slot goes back to the queue at once (a fresh one,
/// or this one once its message is copied out), whoever consumes the message, so the queue
/// always holds every slot of its budget.
fn srq_received(
    recv: &SharedRecv,
    wc: &Wc,
    mem: Option<Mem>,
    op: &'static str,
    arena: &mut bytes::BytesMut,
) -> RecvEvent {
    let mut buf = match mem {
        Some(Mem::Pool(buf)) => buf,
        other => {
            drop(other);
            return RecvEvent::Failed {
                err: RdmaError::Completion {
                    op,
                    status: "completion for an unknown receive".into(),
                },
                flushed: false,
            };
        }
    };
    if !wc.ok() {
        recv.repost(buf);
        return RecvEvent::Failed {
            err: RdmaError::Completion {
                op,
                status: wc.status_str(),
            },
            flushed: wc.is_flush(),
        };
    }
    // (a slot's used length is whatever its previous message set: the completion's counts)
    let len = wc.byte_len as usize;
    buf.set_len(len);
    if len <= COPY_AT_MOST {
        let data = copy_out(arena, buf.bytes());
        recv.repost(buf);
        return RecvEvent::Copied(data);
    }
    match PoolRegion::lease(&recv.slots, recv.slot_size) {
        Some(fresh) => {
            recv.repost(fresh);
            RecvEvent::Data(Mem::Pool(buf), len)
        }
        None => {
            let data = bytes::Bytes::copy_from_slice(buf.bytes_mut());
            recv.repost(buf);
            RecvEvent::Copied(data)
        }
    }
}

fn fail_all(shared: &Shared, why: &str) {
    tracing::error!("transport-rdma: completion driver stopped: {why}");
    shared.close(why);
    lock(&shared.state)
        .failed
        .get_or_insert_with(|| why.to_string());
    fail_waiters(shared, why);
    let _ = shared.recv_tx.send(RecvEvent::Failed {
        err: RdmaError::Closed(Some(why.to_string())),
        flushed: false,
    });
}

/// Fails every task waiting for a completion. The buffers of those requests stay with the QP
/// until a completion retires them (then back to the pool) or the QP is destroyed.
fn fail_waiters(shared: &Shared, why: &str) {
    let waiters = lock(&shared.state).waiters.drain();
    // the SENDs posted with no task waiting give back their permits; their send slots are not
    // reused: they go when the QP lets go of them
    shared.release_sends_out();
    for w in waiters {
        let _ = w.send(Done {
            res: Err(RdmaError::Closed(Some(why.to_string()))),
            buf: None,
        });
    }
}

/// Accepts RDMA connections (an rdma_cm id listening on an address).
pub struct RdmaListener {
    id: CmId,
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<CmEvent>>,
    cm: Arc<CmDispatcher>,
    opts: RdmaOptions,
    addr: SocketAddr,
    monitor: PoolMonitor,
    shared_recv: Arc<SharedRecvs>,
}

impl std::fmt::Debug for RdmaListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaListener")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RdmaListener {
    /// Listens on `addr` (an IP address of an RDMA device, or the unspecified address).
    /// Port 0 picks a free port (read it back with [`RdmaListener::local_addr`]).
    pub fn bind(addr: SocketAddr, opts: RdmaOptions) -> Result<RdmaListener, RdmaError> {
        // "no RDMA here" must be an error before anything else
        crate::devices()?;
        let cm = CmDispatcher::start()?;
        // Port 0: rdma_cm picks a free port of its own port space at bind time, and we read it
        // back. On iWARP the listen also takes the same port among the kernel's TCP ports,
        // where it may be in use: a few more tries, each with a port rdma_cm picks afresh.
        let tries = if addr.port() == 0 { 16 } else { 1 };
        let mut last = None;
        for _ in 0..tries {
            let id = cm.channel().create_id()?;
            let (tx, rx) = mpsc::unbounded_channel();
            id.set_route(tx);
            match id.bind(addr).and_then(|()| id.listen(128)) {
                Ok(()) => {
                    let port = id.local_port();
                    if port == 0 {
                        return Err(RdmaError::InvalidArgument(format!(
                            "rdma_cm reports no port for the listener bound to {addr}"
                        )));
                    }
                    return Ok(RdmaListener {
                        id,
                        rx: tokio::sync::Mutex::new(rx),
                        cm,
                        opts,
                        addr: SocketAddr::new(addr.ip(), port),
                        monitor: PoolMonitor::default(),
                        shared_recv: Arc::default(),
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| RdmaError::InvalidArgument("no port to bind".into())))
    }

    /// The address it listens on (with the port picked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters of the registered pools of every connection it accepted.
    pub fn pool_monitor(&self) -> PoolMonitor {
        self.monitor.clone()
    }

    /// The shared receive queues of its connections ([`RdmaOptions::srq_slots`]), to watch.
    pub fn shared_receive_monitor(&self) -> SharedReceiveMonitor {
        SharedReceiveMonitor(Arc::clone(&self.shared_recv))
    }

    /// Waits for the next connection request and accepts it
    /// ([`RdmaListener::next_request`] then [`PendingConnection::establish`]).
    pub async fn accept(&self) -> Result<RdmaConnection, RdmaError> {
        self.next_request().await?.establish().await
    }

    /// Waits for the next connection request, without answering it yet: a server can finish
    /// the set-up ([`PendingConnection::establish`]) in the connection's own task, so a slow
    /// or silent peer holds up nobody else. Dropping the request rejects it.
    pub async fn next_request(&self) -> Result<PendingConnection, RdmaError> {
        let mut rx = self.rx.lock().await;
        loop {
            let ev = rx
                .recv()
                .await
                .ok_or_else(|| RdmaError::Closed(Some("listener channel closed".into())))?;
            if ev.kind != CmEventKind::ConnectRequest {
                tracing::debug!("transport-rdma: listener got {:?}", ev.kind);
                continue;
            }
            let Some(id) = ev.id else { continue };
            let (tx, rx) = mpsc::unbounded_channel();
            id.set_route(tx);
            return Ok(PendingConnection {
                id,
                offer: ev.peer.unwrap_or(ReadDepth::ONE),
                rx,
                cm: Arc::clone(&self.cm),
                opts: self.opts.clone(),
                monitor: self.monitor.clone(),
                shared_recv: Arc::clone(&self.shared_recv),
            });
        }
    }
}

/// A connection request received by an [`RdmaListener`], not answered yet.
pub struct PendingConnection {
    id: CmId,
    /// the READ depths the peer offered
    offer: ReadDepth,
    rx: mpsc::UnboundedReceiver<CmEvent>,
    cm: Arc<CmDispatcher>,
    opts: RdmaOptions,
    monitor: PoolMonitor,
    shared_recv: Arc<SharedRecvs>,
}

impl std::fmt::Debug for PendingConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingConnection").finish_non_exhaustive()
    }
}

impl PendingConnection {
    /// The counters of the pools the connection will use (its listener's).
    pub fn pool_monitor(&self) -> PoolMonitor {
        self.monitor.clone()
    }

    /// Sets up the queue pair (receives posted first), accepts, and waits for the connection
    /// to be established (at most the options' `connect_timeout`).
    pub async fn establish(self) -> Result<RdmaConnection, RdmaError> {
        let PendingConnection {
            id,
            offer,
            mut rx,
            cm,
            opts,
            monitor,
            shared_recv,
        } = self;
        let deadline = Instant::now() + opts.connect_timeout;
        let prepared = prepare(&id, &opts, monitor, Some(&shared_recv))?;
        let depth = ReadDepth::accepting(read_limit(&prepared, &opts), offer);
        if prepared.qp.device().transport() != Transport::IWarp {
            // InfiniBand/RoCE: RTR and RTS before accepting; on iWARP the provider does it
            id.modify_qp(&prepared.qp, CmQpState::ReadyToReceive(depth))?;
            id.modify_qp(
                &prepared.qp,
                CmQpState::ReadyToSend(depth, opts.ack_timeout),
            )?;
        }
        id.accept(&prepared.qp, depth)?;
        let ev = next_cm_event(&mut rx, deadline, "the connection to be established").await?;
        if ev.kind != CmEventKind::Established {
            return Err(unexpected(&ev, "the connection to be established"));
        }
        check_device(&prepared, &opts)?;
        RdmaConnection::start(id, cm, prepared, rx, &opts, true)
    }
}

impl Drop for RdmaListener {
    fn drop(&mut self) {
        // the id is destroyed with its last clone: no more connection requests
        tracing::trace!("transport-rdma: listener on {} closed", self.addr);
        let _ = &self.id;
    }
}

/// Memory registered with an RDMA device (allocated by [`RdmaConnection::alloc_buffer`]).
/// Its bytes are accessible only while no RDMA operation uses it and it is not exposed.
pub struct RdmaBuffer {
    region: Arc<Region>,
}

impl std::fmt::Debug for RdmaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaBuffer")
            .field("len", &self.region.len())
            .finish()
    }
}

/// What the peer may do with an exposed buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteAccess {
    /// RDMA READ
    Read,
    /// RDMA WRITE
    Write,
    /// both
    ReadWrite,
}

impl RdmaBuffer {
    /// The length in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Whether the buffer is empty (never: empty buffers cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.region.len() == 0
    }

    /// The bytes; [`RdmaError::BufferBusy`] while an operation or an exposure uses the buffer.
    pub fn bytes(&mut self) -> Result<&[u8], RdmaError> {
        Region::bytes(&mut self.region).ok_or(RdmaError::BufferBusy)
    }

    /// The bytes, mutably, under the same condition as [`RdmaBuffer::bytes`].
    pub fn bytes_mut(&mut self) -> Result<&mut [u8], RdmaError> {
        Region::bytes_mut(&mut self.region).ok_or(RdmaError::BufferBusy)
    }

    /// Turns the buffer into read-only bytes (e.g. for `Payload::from_owner`), if no operation
    /// and no exposure uses it; otherwise gives it back.
    pub fn freeze(self) -> Result<FrozenBuffer, RdmaBuffer> {
        Region::freeze(self.region)
            .map(|inner| FrozenBuffer { inner })
            .map_err(|region| RdmaBuffer { region })
    }

    /// Lets the peer access the whole buffer until the returned exposure is dropped (the
    /// registration is then revoked in hardware). Local access waits for that drop.
    pub fn expose(&self, access: RemoteAccess) -> Result<RemoteExposure, RdmaError> {
        let (r, w) = match access {
            RemoteAccess::Read => (true, false),
            RemoteAccess::Write => (false, true),
            RemoteAccess::ReadWrite => (true, true),
        };
        Ok(RemoteExposure {
            inner: Region::expose(&self.region, r, w)?,
        })
    }
}

/// A registered buffer nothing else can reach any more: read-only bytes.
pub struct FrozenBuffer {
    inner: verbs::Frozen,
}

impl AsRef<[u8]> for FrozenBuffer {
    fn as_ref(&self) -> &[u8] {
        self.inner.as_ref()
    }
}

impl std::fmt::Debug for FrozenBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrozenBuffer")
            .field("len", &self.as_ref().len())
            .finish()
    }
}

/// A buffer exposed to the peer; give it [`RemoteExposure::token`].
pub struct RemoteExposure {
    inner: verbs::Exposure,
}

impl std::fmt::Debug for RemoteExposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteExposure")
            .field("token", &self.token())
            .finish()
    }
}

impl RemoteExposure {
    /// What the peer needs to address the buffer.
    pub fn token(&self) -> RemoteToken {
        RemoteToken {
            addr: self.inner.addr(),
            len: self.inner.len() as u64,
            rkey: self.inner.rkey(),
        }
    }
}

/// The address, length and remote key of a peer's exposed buffer (20 bytes on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteToken {
    /// the buffer's address in the peer's memory
    pub addr: u64,
    /// its length
    pub len: u64,
    /// the remote key
    pub rkey: u32,
}

impl RemoteToken {
    /// Encoded size.
    pub const LEN: usize = 20;

    /// Little-endian encoding: addr, len, rkey.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// Decodes [`RemoteToken::to_bytes`]; `None` if `b` is too short.
    pub fn from_bytes(b: &[u8]) -> Option<RemoteToken> {
        if b.len() < Self::LEN {
            return None;
        }
        Some(RemoteToken {
            addr: u64::from_le_bytes(b[..8].try_into().ok()?),
            len: u64::from_le_bytes(b[8..16].try_into().ok()?),
            rkey: u32::from_le_bytes(b[16..20].try_into().ok()?),
        })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn one_sided_places_bound_the_bytes_in_flight() {
        let budget = 16 << 20;
        assert_eq!(one_sided_places(0, budget), 1);
        assert_eq!(
            one_sided_places(1 << 20, budget),
            1,
            "eight 1 MiB READs at once"
        );
        assert_eq!(one_sided_places(2 << 20, budget), 1);
        assert_eq!(one_sided_places((2 << 20) + 1, budget), 2);
        assert_eq!(
            one_sided_places(4 << 20, budget),
            2,
            "four 4 MiB READs at once"
        );
        assert_eq!(one_sided_places(16 << 20, budget), 8, "one 16 MiB READ");
        assert_eq!(one_sided_places(1 << 30, budget), 8, "never more than all");
        // twice the budget: two 16 MiB READs at once
        assert_eq!(one_sided_places(16 << 20, 2 * budget), 4);
        // a budget below the places still gives each transfer a place
        assert_eq!(one_sided_places(1 << 20, 1), 8);
        assert_eq!(one_sided_places(1, 0), 1);
    }

    use super::*;

    const US: u64 = 1_000;

    #[test]
    fn spin_window_follows_the_round_trip_within_its_bounds() {
        let w = SpinWindow::new(Duration::from_micros(50), Duration::from_millis(1));
        assert_eq!(w.window(), Duration::from_micros(50), "starts at the floor");
        // a call-and-answer rhythm: a send completion soon after each answer, then the answer
        // one round trip (300 µs) later
        let mut t = 10_000 * US;
        for _ in 0..20 {
            t += 10 * US;
            w.on_completions(t);
            t += 300 * US;
            w.on_completions(t);
        }
        let win = w.window();
        assert!(
            win >= Duration::from_micros(600) && win <= Duration::from_micros(700),
            "twice the round trip, give or take the decay: {win:?}"
        );
        // back-to-back completions: the window decays to the floor
        for _ in 0..200 {
            t += US;
            w.on_completions(t);
        }
        assert_eq!(w.window(), Duration::from_micros(50));
        // a gap above the ceiling is idle time: it changes nothing
        t += 5_000 * US;
        w.on_completions(t);
        assert_eq!(w.window(), Duration::from_micros(50));
        // a slow round trip is capped at the ceiling
        t += 900 * US;
        w.on_completions(t);
        assert_eq!(w.window(), Duration::from_millis(1));
    }

    #[test]
    fn spin_window_is_fixed_when_the_ceiling_is_not_above_the_floor() {
        for (floor, ceiling) in [(2000, 2000), (2000, 0), (0, 0)] {
            let w = SpinWindow::new(Duration::from_micros(floor), Duration::from_micros(ceiling));
            let mut t = 0;
            for _ in 0..10 {
                t += 700 * US;
                w.on_completions(t);
            }
            assert_eq!(
                w.window(),
                Duration::from_micros(floor),
                "{floor}/{ceiling}"
            );
        }
    }

    #[test]
    fn transfers_longer_than_the_window_are_not_spun_for() {
        let w = SpinWindow::new(Duration::from_micros(50), Duration::from_millis(1));
        assert!(
            w.worth_spinning_for(16 << 20),
            "nothing measured yet: spin as for any completion"
        );
        // 1 MiB READs taking 4 ms each (250 MiB/s, a soft device's rate)
        for _ in 0..20 {
            w.one_sided_done(1 << 20, 4_000 * US);
        }
        assert!(
            !w.worth_spinning_for(1 << 20),
            "4 ms against a 50 µs window"
        );
        assert!(
            w.worth_spinning_for(8 << 10),
            "8 KiB at that rate: 31 µs, within the window"
        );
        assert!(!w.worth_spinning_for(16 << 10), "16 KiB: 62 µs");
        // the device gets faster (1 MiB in 20 µs): the average follows, an eighth of the way
        // per transfer
        for _ in 0..60 {
            w.one_sided_done(1 << 20, 20 * US);
        }
        assert!(w.worth_spinning_for(1 << 20));
        // a fixed window (busy-poll mode) is compared the same way
        let fixed = SpinWindow::new(Duration::from_micros(2000), Duration::from_micros(2000));
        fixed.one_sided_done(1 << 20, 1_000 * US);
        assert!(fixed.worth_spinning_for(1 << 20), "1 ms within 2 ms");
        assert!(!fixed.worth_spinning_for(4 << 20), "4 ms beyond it");
    }

    #[test]
    fn remote_token_round_trip() {
        let t = RemoteToken {
            addr: 0x1122_3344_5566_7788,
            len: 4 << 20,
            rkey: 0xdead_beef,
        };
        let b = t.to_bytes();
        assert_eq!(b.len(), RemoteToken::LEN);
        assert_eq!(RemoteToken::from_bytes(&b), Some(t));
        assert_eq!(RemoteToken::from_bytes(&b[..19]), None);
    }

    #[test]
    fn remote_range_is_checked() {
        let t = RemoteToken {
            addr: 1000,
            len: 100,
            rkey: 7,
        };
        let r = RdmaConnection::remote(&t, 10, 90).unwrap();
        assert_eq!((r.addr, r.rkey), (1010, 7));
        assert!(RdmaConnection::remote(&t, 10, 91).is_err());
        assert!(RdmaConnection::remote(&t, u64::MAX, 1).is_err());
    }
}
