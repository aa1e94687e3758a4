//! The only module of this crate with `unsafe` code: it owns every verbs and rdma_cm resource.
//!
//! Built on `sideway` (RAII wrappers over libibverbs, which `rdma-mummy-sys` loads with
//! `dlopen`), plus direct `rdma-mummy-sys` calls where sideway has gaps (arming a CQ, reading and
//! acknowledging completion-channel events; shared receive queues; queue pairs, which
//! sideway 0.4.3 always creates without an SRQ, so `Qp` creates them with `ibv_create_qp` and
//! posts with `ibv_post_send`/`ibv_post_recv`; and all of rdma_cm, whose sideway wrapper fixes
//! a connection's READ depth at 1, see `CmChannel`).
//!
//! Ownership (children hold an `Arc` of their parents, so drop order is always right):
//! `CmChannel` <- `CmId`; `Device` (context + PD) <- `Cq` (CQ + completion channel) <- `Qp`;
//! `Device` <- `Srq` <- `Qp` (a QP that receives from a shared queue);
//! `Device` <- `Region` (memory owned by this module + its local MR) <- `Exposure` (remote MR);
//! `Device` <- `PoolRegion` (a connection's pool: memory + one MR, registered once) <-
//! `PoolBuf` (an exclusive `rpc_core::pool::Lease` of a range) -> `PoolView` (frozen, read-only).
//!
//! Memory soundness rules enforced here (the rest of the crate cannot break them):
//! * a `Region`'s bytes are reachable from safe code only through `Arc::get_mut`, i.e. when no
//!   posted work request and no `Exposure` holds a reference to it;
//! * every posted work request that reads or writes local memory holds an `Arc<Region>` (in
//!   `Qp::inflight`) until it is retired after its completion was polled, or until the QP is
//!   destroyed (after which the device no longer touches the memory): memory is never freed or
//!   handed out while the device may use it (an inline SEND reads none after its post, which
//!   copied its bytes, and holds nothing);
//!   a receive posted to a shared queue is held the same way by the `Srq` (retired through the
//!   completion on whichever QP took it; a QP collects its leftover ones when destroyed);
//! * an `Exposure` (a remotely accessible MR) holds the region too; dropping it deregisters the
//!   MR, which revokes the peer's access in hardware before local access becomes possible again;
//! * a `PoolBuf`'s bytes are reachable only through `&mut PoolBuf` (the pool lends each range
//!   to one lease at a time) or, once frozen, through a `PoolView` that is never posted again;
//!   posting a `PoolBuf` moves it into `Qp::inflight` (same rule as regions), and every buffer
//!   holds an `Arc` of its `PoolRegion`, which deregisters its MR before freeing the memory.
//!
//! sideway panics on values it does not know (`From<u32>` for transport types, QP states...).
//! Those conversions are only called through [`guarded`], which turns a panic into an error
//! value; rdma_cm event types are read as plain numbers here.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use rdma_mummy_sys::{
    ibv_access_flags, ibv_get_device_name, ibv_modify_qp, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask,
    ibv_qp_cap, ibv_qp_init_attr, ibv_qp_state, ibv_qp_type, ibv_query_qp, ibv_recv_wr,
    ibv_send_flags, ibv_send_wr, ibv_sge, ibv_srq, ibv_srq_attr, ibv_srq_init_attr, ibv_wr_opcode,
    rdma_accept, rdma_ack_cm_event, rdma_bind_addr, rdma_cm_event, rdma_cm_event_type, rdma_cm_id,
    rdma_conn_param, rdma_connect, rdma_create_event_channel, rdma_create_id,
    rdma_destroy_event_channel, rdma_destroy_id, rdma_disconnect, rdma_establish,
    rdma_event_channel, rdma_get_cm_event, rdma_init_qp_attr, rdma_listen, rdma_port_space,
    rdma_resolve_addr, rdma_resolve_route, rdma_t, wr_t,
};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::device::{DeviceInfo, DeviceList, TransportType};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicPostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
};
use sideway::ibverbs::AccessFlags;

use crate::error::RdmaError;
use crate::ReadDepth;
use rpc_core::ids::IdSlab;

/// Runs `f`, turning a panic inside sideway (unknown enum value) into an error.
/// (With `panic = "abort"` nothing can be caught; the values guarded here come from the kernel and
/// are all known to the rdma-core version we target, so this is a last line of defence.)
fn guarded<T>(what: &'static str, f: impl FnOnce() -> T) -> Result<T, RdmaError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|_| RdmaError::Verbs {
        op: what,
        source: "sideway panicked on a value it does not know".into(),
    })
}

fn verbs_err<E: std::error::Error + Send + Sync + 'static>(
    op: &'static str,
) -> impl FnOnce(E) -> RdmaError {
    move |e| RdmaError::Verbs {
        op,
        source: Box::new(e),
    }
}

/// Normalises a verbs return code: providers return a positive errno, siw a negative one.
fn errno_result(op: &'static str, ret: i32) -> Result<(), RdmaError> {
    if ret == 0 {
        Ok(())
    } else {
        Err(RdmaError::Verbs {
            op,
            source: Box::new(std::io::Error::from_raw_os_error(ret.abs())),
        })
    }
}

/// The transport family of an RDMA device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Transport {
    /// InfiniBand or RoCE (Soft-RoCE `rxe` reports this)
    InfiniBand,
    /// iWARP (`siw` reports this)
    IWarp,
    /// anything else
    Other,
}

fn transport_of(t: TransportType) -> Transport {
    match t {
        TransportType::InfiniBand => Transport::InfiniBand,
        TransportType::IWarp => Transport::IWarp,
        _ => Transport::Other,
    }
}

/// Lists the RDMA devices: name and transport. An error when rdma-core cannot be loaded.
pub(crate) fn list_devices() -> Result<Vec<(String, Transport)>, RdmaError> {
    let list = DeviceList::new().map_err(|e| {
        RdmaError::Unavailable(format!(
            "cannot list RDMA devices (is rdma-core's libibverbs installed?): {e}"
        ))
    })?;
    let mut out = Vec::with_capacity(list.len());
    for dev in list.iter() {
        let name = dev.name();
        let transport = guarded("ibv_device.transport_type", || {
            transport_of(dev.transport_type())
        })?;
        out.push((name, transport));
    }
    Ok(out)
}

// ------------------------------------------------------------------------------------------------
// rdma_cm
//
// Called through rdma-mummy-sys directly, not through sideway's wrapper: sideway 0.4.3 fixes
// the READ depth a connection negotiates at 1 (its `ConnectionParameter` has no setter for
// responder resources and initiator depth, and its id and event pointers are private), and on
// iWARP the connection manager sets the QP's READ limits from exactly those values, so an
// iWARP connection could never have more than one RDMA READ in flight.

/// An rdma_cm event channel (non-blocking; its fd goes into tokio's reactor), with the ids made
/// on it by address, so that an event reaches the id it is about.
pub(crate) struct CmChannel {
    ch: NonNull<rdma_event_channel>,
    ids: Mutex<HashMap<usize, Weak<RawCmId>>>,
}

// SAFETY: librdmacm's calls on a channel may come from any thread (the channel is a file
// descriptor; librdmacm locks its own state); the id table is behind a mutex.
unsafe impl Send for CmChannel {}
// SAFETY: as for `Send`: nothing here is touched without librdmacm's or our own lock.
unsafe impl Sync for CmChannel {}

impl Drop for CmChannel {
    fn drop(&mut self) {
        // SAFETY: every id made on the channel holds an `Arc` of it, so none is left; the channel
        // is destroyed once, here.
        unsafe { rdma_destroy_event_channel(self.ch.as_ptr()) };
    }
}

/// What happened, in this crate's terms (no librdmacm type leaves this module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CmEventKind {
    AddrResolved,
    AddrError,
    RouteResolved,
    RouteError,
    ConnectRequest,
    ConnectResponse,
    ConnectError,
    Unreachable,
    Rejected,
    Established,
    Disconnected,
    DeviceRemoval,
    TimewaitExit,
    Other,
}

fn kind_of(t: rdma_cm_event_type::Type) -> CmEventKind {
    use rdma_cm_event_type as t_;
    match t {
        t_::RDMA_CM_EVENT_ADDR_RESOLVED => CmEventKind::AddrResolved,
        t_::RDMA_CM_EVENT_ADDR_ERROR => CmEventKind::AddrError,
        t_::RDMA_CM_EVENT_ROUTE_RESOLVED => CmEventKind::RouteResolved,
        t_::RDMA_CM_EVENT_ROUTE_ERROR => CmEventKind::RouteError,
        t_::RDMA_CM_EVENT_CONNECT_REQUEST => CmEventKind::ConnectRequest,
        t_::RDMA_CM_EVENT_CONNECT_RESPONSE => CmEventKind::ConnectResponse,
        t_::RDMA_CM_EVENT_CONNECT_ERROR => CmEventKind::ConnectError,
        t_::RDMA_CM_EVENT_UNREACHABLE => CmEventKind::Unreachable,
        t_::RDMA_CM_EVENT_REJECTED => CmEventKind::Rejected,
        t_::RDMA_CM_EVENT_ESTABLISHED => CmEventKind::Established,
        t_::RDMA_CM_EVENT_DISCONNECTED => CmEventKind::Disconnected,
        t_::RDMA_CM_EVENT_DEVICE_REMOVAL => CmEventKind::DeviceRemoval,
        t_::RDMA_CM_EVENT_TIMEWAIT_EXIT => CmEventKind::TimewaitExit,
        _ => CmEventKind::Other,
    }
}

/// An rdma_cm event, already acknowledged (no pointer into librdmacm's event survives).
pub(crate) struct CmEvent {
    pub(crate) kind: CmEventKind,
    pub(crate) status: i32,
    /// the id the event is about (for `ConnectRequest`: the new id of the incoming connection)
    pub(crate) id: Option<CmId>,
    /// for `ConnectRequest`: the listening id
    pub(crate) listener: Option<CmId>,
    /// the peer's READ depths (connect request: its offer; connect response and established:
    /// its answer)
    pub(crate) peer: Option<ReadDepth>,
}

/// Where the events of one id are delivered.
pub(crate) type CmRoute = tokio::sync::mpsc::UnboundedSender<CmEvent>;

/// A librdmacm call's result: 0, or -1 with errno set.
fn cm_result(op: &'static str, ret: i32) -> Result<(), RdmaError> {
    if ret == 0 {
        Ok(())
    } else {
        Err(RdmaError::Verbs {
            op,
            source: Box::new(std::io::Error::last_os_error()),
        })
    }
}

/// A socket address in the C layout librdmacm reads.
enum OsAddr {
    V4(libc::sockaddr_in),
    V6(libc::sockaddr_in6),
}

impl OsAddr {
    fn new(addr: SocketAddr) -> OsAddr {
        match addr {
            SocketAddr::V4(a) => OsAddr::V4(libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            }),
            SocketAddr::V6(a) => OsAddr::V6(libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            }),
        }
    }

    fn as_mut_ptr(&mut self) -> *mut libc::sockaddr {
        match self {
            OsAddr::V4(a) => (a as *mut libc::sockaddr_in).cast(),
            OsAddr::V6(a) => (a as *mut libc::sockaddr_in6).cast(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

impl CmChannel {
    pub(crate) fn new() -> Result<Arc<CmChannel>, RdmaError> {
        // SAFETY: no arguments; returns a channel we own, or null with errno set (also when
        // librdmacm could not be loaded).
        let raw = unsafe { rdma_create_event_channel() };
        let ch = NonNull::new(raw).ok_or_else(|| {
            RdmaError::Unavailable(format!(
                "cannot open an rdma_cm event channel (is librdmacm installed and /dev/infiniband/rdma_cm present?): {}",
                std::io::Error::last_os_error()
            ))
        })?;
        let ch = Arc::new(CmChannel {
            ch,
            ids: Mutex::default(),
        });
        let fd = ch.as_raw_fd();
        // SAFETY: `fd` is the channel's open descriptor; F_GETFL/F_SETFL only change its flags.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFL);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
        };
        if !ok {
            return Err(RdmaError::Verbs {
                op: "rdma_cm channel O_NONBLOCK",
                source: Box::new(std::io::Error::last_os_error()),
            });
        }
        Ok(ch)
    }

    pub(crate) fn create_id(self: &Arc<Self>) -> Result<CmId, RdmaError> {
        let mut raw: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: the channel is live (`self`); the call writes the new id to `raw`.
        let ret = unsafe {
            rdma_create_id(
                self.ch.as_ptr(),
                &mut raw,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        cm_result("rdma_create_id", ret)?;
        self.adopt(raw).ok_or(RdmaError::Verbs {
            op: "rdma_create_id",
            source: "no id returned".into(),
        })
    }

    /// Takes ownership of `raw`, an id of this channel (destroyed with the returned id's last
    /// clone), and records it for routing its events.
    fn adopt(self: &Arc<Self>, raw: *mut rdma_cm_id) -> Option<CmId> {
        let id = Arc::new(RawCmId {
            id: NonNull::new(raw)?,
            route: Mutex::new(None),
            channel: Arc::clone(self),
        });
        lock(&self.ids).insert(raw as usize, Arc::downgrade(&id));
        Some(CmId { id })
    }

    /// The live id at `raw`, if it is one of ours.
    fn find(&self, raw: *mut rdma_cm_id) -> Option<CmId> {
        let id = lock(&self.ids).get(&(raw as usize))?.upgrade()?;
        Some(CmId { id })
    }

    /// The next event, or `None` when none is pending. The event is acknowledged before return.
    pub(crate) fn next_event(self: &Arc<Self>) -> Result<Option<CmEvent>, RdmaError> {
        let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: the channel is live; it is non-blocking, so the call returns at once, writing
        // an event we must acknowledge to `ev` on success.
        let ret = unsafe { rdma_get_cm_event(self.ch.as_ptr(), &mut ev) };
        if ret != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(RdmaError::Verbs {
                op: "rdma_get_cm_event",
                source: Box::new(e),
            });
        }
        let out = {
            // SAFETY: on success `ev` points to an event librdmacm keeps until it is
            // acknowledged below; it is only read, and nothing read from it borrows it.
            let e = unsafe { &*ev };
            let kind = kind_of(e.event);
            let peer = matches!(
                kind,
                CmEventKind::ConnectRequest
                    | CmEventKind::ConnectResponse
                    | CmEventKind::Established
            )
            .then(|| {
                // SAFETY: for these events of a connected (RDMA_PS_TCP) id, `conn` is the member
                // of the parameter union librdmacm filled in.
                let p = unsafe { e.param.conn };
                ReadDepth {
                    responder: p.responder_resources,
                    initiator: p.initiator_depth,
                }
            });
            // a connect request brings a new id, ours from now on (rejected when dropped)
            let id = if kind == CmEventKind::ConnectRequest {
                self.adopt(e.id)
            } else {
                self.find(e.id)
            };
            CmEvent {
                kind,
                status: e.status,
                id,
                listener: self.find(e.listen_id),
                peer,
            }
        };
        // SAFETY: `ev` came from rdma_get_cm_event and is acknowledged exactly once; nothing
        // uses it afterwards.
        if unsafe { rdma_ack_cm_event(ev) } != 0 {
            tracing::warn!(
                "rdma_ack_cm_event failed: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(Some(out))
    }
}

impl AsRawFd for CmChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: the channel is live; `fd` is a plain field librdmacm set at creation.
        unsafe { (*self.ch.as_ptr()).fd }
    }
}

/// An owned `rdma_cm_id`, destroyed with its last `CmId`.
struct RawCmId {
    id: NonNull<rdma_cm_id>,
    route: Mutex<Option<CmRoute>>,
    /// the channel outlives its ids
    channel: Arc<CmChannel>,
}

// SAFETY: librdmacm's calls on an id may come from any thread (each is a command written to the
// channel's descriptor, serialised by the kernel); our own state is behind a mutex.
unsafe impl Send for RawCmId {}
// SAFETY: as for `Send`.
unsafe impl Sync for RawCmId {}

impl Drop for RawCmId {
    fn drop(&mut self) {
        lock(&self.channel.ids).remove(&(self.id.as_ptr() as usize));
        // SAFETY: the id is ours (created or adopted once) and no QP was made through it; every
        // event about it was acknowledged before `next_event` returned, so this does not wait;
        // nothing uses the pointer afterwards. An incoming connection never accepted is
        // rejected by this.
        if unsafe { rdma_destroy_id(self.id.as_ptr()) } != 0 {
            tracing::debug!(
                "rdma_destroy_id failed: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// An rdma_cm identifier (like a socket). Cheap to clone; destroyed with its last clone.
#[derive(Clone)]
pub(crate) struct CmId {
    id: Arc<RawCmId>,
}

fn conn_param(qp: &Qp, depth: ReadDepth) -> rdma_conn_param {
    rdma_conn_param {
        private_data: std::ptr::null(),
        private_data_len: 0,
        responder_resources: depth.responder,
        initiator_depth: depth.initiator,
        flow_control: 0,
        // retry 7, RNR retry 7 (infinite)
        retry_count: 7,
        rnr_retry_count: 7,
        srq: 0,
        qp_num: qp.qp_num(),
    }
}

fn timeout_ms(t: Duration) -> i32 {
    i32::try_from(t.min(Duration::from_secs(60)).as_millis()).unwrap_or(60_000)
}

impl CmId {
    fn raw(&self) -> *mut rdma_cm_id {
        self.id.id.as_ptr()
    }

    /// Delivers this id's future events to `route`.
    pub(crate) fn set_route(&self, route: CmRoute) {
        *lock(&self.id.route) = Some(route);
    }

    pub(crate) fn route(&self) -> Option<CmRoute> {
        lock(&self.id.route).clone()
    }

    pub(crate) fn bind(&self, addr: SocketAddr) -> Result<(), RdmaError> {
        let mut sa = OsAddr::new(addr);
        // SAFETY: the id is live; `sa` is a valid socket address the call only reads.
        cm_result("rdma_bind_addr", unsafe {
            rdma_bind_addr(self.raw(), sa.as_mut_ptr())
        })
    }

    /// The port this id is bound to, as rdma_cm reports it (0 if it is not bound): the one it
    /// picked when it was bound to port 0. Called by `RdmaListener::bind` right after the
    /// listen, before the id is shared.
    pub(crate) fn local_port(&self) -> u16 {
        let raw = self.raw();
        // SAFETY: the id is live. librdmacm writes the route's source address when the id is
        // bound (from the kernel's answer) and in later calls on this same id; the only caller
        // reads it on the thread that just bound the id, before any other thread holds it, so
        // nothing writes it meanwhile. The union holds a `sockaddr_storage`, so it is large
        // enough for the layout its family names, which is the one read.
        unsafe {
            let addr = std::ptr::addr_of!((*raw).route.addr.src_addr_union);
            match i32::from((*addr).src_addr.sa_family) {
                libc::AF_INET => u16::from_be((*addr).src_sin.sin_port),
                libc::AF_INET6 => u16::from_be((*addr).src_sin6.sin6_port),
                _ => 0,
            }
        }
    }

    pub(crate) fn listen(&self, backlog: i32) -> Result<(), RdmaError> {
        // SAFETY: the id is live.
        cm_result("rdma_listen", unsafe { rdma_listen(self.raw(), backlog) })
    }

    pub(crate) fn resolve_addr(&self, dst: SocketAddr, timeout: Duration) -> Result<(), RdmaError> {
        let mut sa = OsAddr::new(dst);
        // SAFETY: the id is live; `sa` is a valid socket address the call only reads; no source
        // address (null).
        cm_result("rdma_resolve_addr", unsafe {
            rdma_resolve_addr(
                self.raw(),
                std::ptr::null_mut(),
                sa.as_mut_ptr(),
                timeout_ms(timeout),
            )
        })
    }

    pub(crate) fn resolve_route(&self, timeout: Duration) -> Result<(), RdmaError> {
        // SAFETY: the id is live.
        cm_result("rdma_resolve_route", unsafe {
            rdma_resolve_route(self.raw(), timeout_ms(timeout))
        })
    }

    /// Asks the peer to connect `qp`, offering `depth` READs each way.
    pub(crate) fn connect(&self, qp: &Qp, depth: u8) -> Result<(), RdmaError> {
        let mut p = conn_param(
            qp,
            ReadDepth {
                responder: depth,
                initiator: depth,
            },
        );
        // SAFETY: the id is live; `p` is a complete parameter block (no private data) that the
        // call only reads.
        cm_result("rdma_connect", unsafe { rdma_connect(self.raw(), &mut p) })
    }

    /// Accepts the connection this (incoming) id stands for, with `qp` and `depth`.
    pub(crate) fn accept(&self, qp: &Qp, depth: ReadDepth) -> Result<(), RdmaError> {
        let mut p = conn_param(qp, depth);
        // SAFETY: as in `connect`.
        cm_result("rdma_accept", unsafe { rdma_accept(self.raw(), &mut p) })
    }

    pub(crate) fn establish(&self) -> Result<(), RdmaError> {
        // SAFETY: the id is live.
        cm_result("rdma_establish", unsafe { rdma_establish(self.raw()) })
    }

    pub(crate) fn disconnect(&self) -> Result<(), RdmaError> {
        // SAFETY: the id is live.
        cm_result("rdma_disconnect", unsafe { rdma_disconnect(self.raw()) })
    }

    /// The name of the device this id is bound to.
    pub(crate) fn device_name(&self) -> Result<String, RdmaError> {
        // SAFETY: the id is live; `verbs` is set by librdmacm once the id is bound to a device
        // (null before).
        let verbs = unsafe { (*self.raw()).verbs };
        if verbs.is_null() {
            return Err(RdmaError::Unavailable(
                "the rdma_cm id is not bound to an RDMA device".into(),
            ));
        }
        // SAFETY: `verbs` is the device context librdmacm keeps open while the id lives; the
        // device's name is a NUL-terminated string owned by the device, copied out at once.
        let name = unsafe { std::ffi::CStr::from_ptr(ibv_get_device_name((*verbs).device)) };
        Ok(name.to_string_lossy().into_owned())
    }

    /// The device this id is bound to (after bind to a device address, address resolution, or
    /// for an incoming connection), with a fresh protection domain.
    pub(crate) fn device(&self) -> Result<Arc<Device>, RdmaError> {
        Device::new(open_device(&self.device_name()?)?)
    }

    /// Moves `qp` to `state` with the attributes rdma_cm computes for this connection, and the
    /// READ depths negotiated (InfiniBand/RoCE; iWARP's CM moves the QP itself).
    pub(crate) fn modify_qp(&self, qp: &Qp, state: CmQpState) -> Result<(), RdmaError> {
        // SAFETY: an all-zero `ibv_qp_attr` is a valid value (plain integers and structs of
        // them).
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = match state {
            CmQpState::Init => ibv_qp_state::IBV_QPS_INIT,
            CmQpState::ReadyToReceive(_) => ibv_qp_state::IBV_QPS_RTR,
            CmQpState::ReadyToSend(..) => ibv_qp_state::IBV_QPS_RTS,
        };
        let mut mask: i32 = 0;
        // SAFETY: the id is live; the call fills in `attr` and `mask` for `attr.qp_state`.
        cm_result("rdma_init_qp_attr", unsafe {
            rdma_init_qp_attr(self.raw(), &mut attr, &mut mask)
        })?;
        // InfiniBand/RoCE: the kernel derives the READ limits and the access flags from what it
        // knows of the negotiation at that moment; on the passive side RTR/RTS come before
        // rdma_accept (so 0: no RDMA READ from that side; librdmacm's own rdma_accept sets
        // them by hand too), and we saw READs rejected as invalid requests on rxe. Set what
        // was negotiated, on both sides, and READ and WRITE allowed (memory is still guarded
        // by each MR's keys). iWARP's CM moves the QP itself.
        if qp.device.transport != Transport::IWarp {
            let remote = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
            let flag = |m: ibv_qp_attr_mask| m.0 as i32;
            match state {
                CmQpState::Init => {
                    attr.qp_access_flags = remote;
                    mask |= flag(ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS);
                }
                CmQpState::ReadyToReceive(depth) => {
                    attr.qp_access_flags = remote;
                    attr.max_dest_rd_atomic = depth.responder;
                    mask |= flag(ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS)
                        | flag(ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC);
                }
                CmQpState::ReadyToSend(depth, ack_timeout) => {
                    attr.max_rd_atomic = depth.initiator;
                    mask |= flag(ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC);
                    let cm = attr.timeout;
                    if let Some(t) = ack_timeout {
                        attr.timeout = crate::ack_timeout_exponent(t);
                        mask |= flag(ibv_qp_attr_mask::IBV_QP_TIMEOUT);
                    }
                    tracing::debug!(
                        rdma_cm = cm,
                        timeout = attr.timeout,
                        retry_cnt = attr.retry_cnt,
                        rnr_retry = attr.rnr_retry,
                        "queue pair's local ACK timeout (4.096 us x 2^timeout)"
                    );
                }
            }
        }
        qp.modify_raw(&mut attr, mask, "ibv_modify_qp (rdma_cm attributes)")
    }
}

/// The device contexts this process opened, by device name: one per device, kept for the
/// process's life (rdma_cm opens its own; a QP made in ours is connected by its number).
fn open_device(name: &str) -> Result<Arc<DeviceContext>, RdmaError> {
    static OPENED: OnceLock<Mutex<HashMap<String, Arc<DeviceContext>>>> = OnceLock::new();
    let mut opened = lock(OPENED.get_or_init(Mutex::default));
    if let Some(ctx) = opened.get(name) {
        return Ok(Arc::clone(ctx));
    }
    let list = DeviceList::new().map_err(|e| {
        RdmaError::Unavailable(format!(
            "cannot list RDMA devices (is rdma-core's libibverbs installed?): {e}"
        ))
    })?;
    let dev = list
        .iter()
        .find(|d| d.name() == name)
        .ok_or_else(|| RdmaError::Unavailable(format!("RDMA device {name} not found")))?;
    let ctx = dev.open().map_err(verbs_err("ibv_open_device"))?;
    opened.insert(name.to_string(), Arc::clone(&ctx));
    Ok(ctx)
}

/// QP states reached with rdma_cm's attributes (and the READ depths negotiated).
#[derive(Debug, Clone, Copy)]
pub(crate) enum CmQpState {
    Init,
    ReadyToReceive(ReadDepth),
    /// with the local ACK timeout if the options set one ([`crate::RdmaOptions::ack_timeout`],
    /// rounded up to the device's 4.096 µs × 2^n)
    ReadyToSend(ReadDepth, Option<Duration>),
}

// ------------------------------------------------------------------------------------------------
// device, CQ, QP

/// An opened device (this process's context of it, see `open_device`) and a protection domain
/// on it.
pub(crate) struct Device {
    pd: Arc<ProtectionDomain>,
    ctx: Arc<DeviceContext>,
    name: String,
    transport: Transport,
    /// the most RDMA READs a QP of this device may have in flight each way (the smaller of the
    /// device's initiator and responder limits, at most 255)
    max_read_depth: u8,
}

impl Device {
    fn new(ctx: Arc<DeviceContext>) -> Result<Arc<Device>, RdmaError> {
        let name = ctx.name();
        let transport = guarded("ibv_device.transport_type", || {
            transport_of(ctx.transport_type())
        })?;
        let attr = ctx.query_device().map_err(verbs_err("ibv_query_device"))?;
        let max_read_depth = attr
            .max_qp_rd_atom()
            .min(attr.max_qp_init_rd_atom())
            .clamp(1, i32::from(u8::MAX));
        let pd = ctx.alloc_pd().map_err(verbs_err("ibv_alloc_pd"))?;
        Ok(Arc::new(Device {
            pd,
            ctx,
            name,
            transport,
            max_read_depth: u8::try_from(max_read_depth).unwrap_or(1),
        }))
    }

    /// The most RDMA READs a connection on this device may have in flight each way.
    pub(crate) fn max_read_depth(&self) -> u8 {
        self.max_read_depth
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn transport(&self) -> Transport {
        self.transport
    }
}

/// A completion queue with its own completion channel (non-blocking fd, for tokio's `AsyncFd`).
pub(crate) struct Cq {
    // drop order: CQ first (it holds an Arc of the channel too), then the channel
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    _device: Arc<Device>,
}

/// Where [`Cq::poll`] puts completions: the provider's raw entries, and ours.
///
/// The raw array is zeroed once, when this is made, and reused: zeroing 1.5 KiB on every poll
/// cost ~100 instructions, and a spinning driver polls far more often than it finds anything.
/// (Entries a poll did not write keep an earlier poll's values, never uninitialised bytes:
/// providers need not write every field, e.g. `vendor_err` of a successful completion.)
pub(crate) struct Polled {
    raw: Box<[rdma_mummy_sys::ibv_wc; Polled::MAX]>,
    wcs: Vec<Wc>,
}

impl Polled {
    /// The most completions one poll takes.
    pub(crate) const MAX: usize = 32;

    pub(crate) fn new() -> Polled {
        Polled {
            // SAFETY: `ibv_wc` is a plain C struct (integers and a union of integers), for
            // which all-zero bytes are a valid value.
            raw: Box::new(unsafe { std::mem::zeroed() }),
            wcs: Vec::with_capacity(Polled::MAX),
        }
    }

    /// The completions of the last poll.
    pub(crate) fn wcs(&self) -> &[Wc] {
        &self.wcs
    }
}

/// A work completion, decoded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wc {
    pub(crate) wr_id: u64,
    pub(crate) kind: WrKind,
    /// 0 = success (IBV_WC_SUCCESS)
    pub(crate) status: u32,
    pub(crate) vendor_err: u32,
    pub(crate) byte_len: u32,
}

impl Wc {
    pub(crate) fn ok(&self) -> bool {
        self.status == rdma_mummy_sys::ibv_wc_status::IBV_WC_SUCCESS
    }

    pub(crate) fn is_flush(&self) -> bool {
        self.status == rdma_mummy_sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    }

    pub(crate) fn status_str(&self) -> String {
        use rdma_mummy_sys::ibv_wc_status as s;
        let name = match self.status {
            s::IBV_WC_SUCCESS => "success",
            s::IBV_WC_LOC_LEN_ERR => "local length error",
            s::IBV_WC_LOC_QP_OP_ERR => "local QP operation error",
            s::IBV_WC_LOC_PROT_ERR => "local protection error",
            s::IBV_WC_WR_FLUSH_ERR => "work request flushed",
            s::IBV_WC_BAD_RESP_ERR => "bad response",
            s::IBV_WC_LOC_ACCESS_ERR => "local access error",
            s::IBV_WC_REM_INV_REQ_ERR => "remote invalid request",
            s::IBV_WC_REM_ACCESS_ERR => "remote access error",
            s::IBV_WC_REM_OP_ERR => "remote operation error",
            s::IBV_WC_RETRY_EXC_ERR => "transport retry counter exceeded",
            s::IBV_WC_RNR_RETRY_EXC_ERR => "RNR retry counter exceeded",
            s::IBV_WC_REM_ABORT_ERR => "remote aborted",
            s::IBV_WC_FATAL_ERR => "fatal error",
            s::IBV_WC_RESP_TIMEOUT_ERR => "response timeout",
            s::IBV_WC_GENERAL_ERR => "general error",
            _ => "other error",
        };
        format!(
            "{name} (status {}, vendor error {:#x})",
            self.status, self.vendor_err
        )
    }
}

impl Cq {
    pub(crate) fn new(device: &Arc<Device>, cqe: u32) -> Result<Arc<Cq>, RdmaError> {
        let channel = device
            .ctx
            .create_comp_channel()
            .map_err(verbs_err("ibv_create_comp_channel"))?;
        channel
            .set_nonblocking(true)
            .map_err(verbs_err("completion channel O_NONBLOCK"))?;
        // the basic CQ: the extended one returns garbage on rxe with rdma-core 44, siw refuses it
        let cq = device
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(verbs_err("ibv_create_cq"))?;
        Ok(Arc::new(Cq {
            cq,
            channel,
            _device: Arc::clone(device),
        }))
    }

    /// Polls up to [`Polled::MAX`] completions into `into` (replacing what it held); returns
    /// how many.
    ///
    /// Calls `ibv_poll_cq` directly into `into`'s array: sideway's `start_poll` allocates a
    /// vector for every poll, an empty one included, which a spinning completion driver pays
    /// on every turn.
    #[inline(always)]
    pub(crate) fn poll(&self, into: &mut Polled) -> Result<usize, RdmaError> {
        into.wcs.clear();
        let raw = &mut *into.raw;
        // SAFETY: the CQ is live (we hold its Arc for the duration of the call); `raw` has room
        // for `Polled::MAX` entries, which is all the provider may write; the function pointer
        // comes from the provider's ops table filled when the CQ was created.
        let ret = unsafe {
            rdma_mummy_sys::ibv_poll_cq(self.cq.cq().as_ptr(), Polled::MAX as i32, raw.as_mut_ptr())
        };
        if ret < 0 {
            // siw returns negative errno values, others -1 with errno set
            let e = if ret == -1 {
                std::io::Error::last_os_error()
            } else {
                std::io::Error::from_raw_os_error(-ret)
            };
            return Err(RdmaError::Verbs {
                op: "ibv_poll_cq",
                source: Box::new(e),
            });
        }
        let n = (ret as usize).min(Polled::MAX);
        into.wcs.extend(raw[..n].iter().map(|wc| Wc {
            wr_id: wc.wr_id,
            kind: WrKind::of(wc.wr_id),
            status: wc.status,
            vendor_err: wc.vendor_err,
            byte_len: wc.byte_len,
        }));
        Ok(n)
    }

    /// Requests an event on the completion channel for the next completion.
    pub(crate) fn arm(&self) -> Result<(), RdmaError> {
        // SAFETY: `self.cq` is a live CQ (we hold its Arc for the duration of the call); the
        // function pointer comes from the provider's ops table filled when the CQ was created.
        let ret = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        errno_result("ibv_req_notify_cq", ret)
    }

    /// Reads and acknowledges every pending completion-channel event; returns how many.
    pub(crate) fn drain_events(&self) -> Result<u32, RdmaError> {
        let mut n = 0;
        loop {
            let mut cq: *mut rdma_mummy_sys::ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::ffi::c_void = std::ptr::null_mut();
            // SAFETY: the channel is live (we hold its Arc) and its fd is non-blocking, so this
            // returns at once; `cq` and `ctx` are valid out-pointers to locals.
            let ret = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut cq,
                    &mut ctx,
                )
            };
            if ret != 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::WouldBlock || n > 0 {
                    return Ok(n);
                }
                return Err(RdmaError::Verbs {
                    op: "ibv_get_cq_event",
                    source: Box::new(err),
                });
            }
            // SAFETY: `self.cq` is live (we hold its Arc).
            let ours = unsafe { self.cq.cq().as_ptr() };
            debug_assert_eq!(cq, ours, "completion channel is dedicated to one CQ");
            if !cq.is_null() {
                // SAFETY: `cq` was just returned by ibv_get_cq_event for this channel, which only
                // this (live) CQ uses; acknowledging at once keeps ibv_destroy_cq from blocking.
                unsafe { rdma_mummy_sys::ibv_ack_cq_events(cq, 1) };
            }
            n += 1;
        }
    }
}

impl AsRawFd for Cq {
    fn as_raw_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }
}

/// What a work request did; encoded in the top byte of its `wr_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrKind {
    Recv,
    Send,
    Write,
    Read,
    Unknown,
}

impl WrKind {
    fn tag(self) -> u8 {
        match self {
            WrKind::Recv => 1,
            WrKind::Send => 2,
            WrKind::Write => 3,
            WrKind::Read => 4,
            WrKind::Unknown => 0,
        }
    }

    fn of(wr_id: u64) -> WrKind {
        match wr_id >> 56 {
            1 => WrKind::Recv,
            2 | SEND_SLOT_TAG | INLINE_SEND_TAG => WrKind::Send,
            3 => WrKind::Write,
            4 => WrKind::Read,
            _ => WrKind::Unknown,
        }
    }
}

/// The tag of a SEND posted with [`Qp::post_send_slot`] (a [`WrKind::Send`]).
const SEND_SLOT_TAG: u64 = 5;

/// The tag of an inline SEND posted with [`Qp::post_inline_send`] (a [`WrKind::Send`]), which
/// holds nothing: its `wr_id` is this tag alone, with no in-flight entry behind it.
const INLINE_SEND_TAG: u64 = 6;

/// Whether `wr_id` is a SEND posted with [`Qp::post_send_slot`] or [`Qp::post_inline_send`]:
/// the connection keeps nothing for it in its own tables (the QP holds a send slot's region and
/// permit; an inline SEND holds nothing), so its completion needs no look there.
pub(crate) fn keeps_no_waiter(wr_id: u64) -> bool {
    matches!(wr_id >> 56, SEND_SLOT_TAG | INLINE_SEND_TAG)
}

/// Whether `wr_id` is an inline SEND posted with [`Qp::post_inline_send`]: nothing to retire
/// from the QP; its poster counts it until its completion (see `Shared::sends_out` in
/// conn.rs).
pub(crate) fn is_inline_send(wr_id: u64) -> bool {
    wr_id >> 56 == INLINE_SEND_TAG
}

/// Where a one-sided operation goes in the peer's memory.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RemoteAddr {
    pub(crate) addr: u64,
    pub(crate) rkey: u32,
}

/// The memory a posted work request uses: kept here (out of every other hand) until the
/// request is retired after its completion, or until the QP is destroyed.
pub(crate) enum Mem {
    /// a region of its own (the verbs-level API)
    Region(Arc<Region>),
    /// a buffer of a connection's registered pool
    Pool(PoolBuf),
    /// a frozen payload whose bytes lie in a pool region of the connection, the source of a
    /// WRITE: the payload keeps its buffer leased (so this side neither reuses nor changes its
    /// bytes), the region keeps them allocated and registered
    View {
        _payload: rpc_core::Payload,
        _region: Arc<PoolRegion>,
    },
    /// none: an RDMA WRITE of no bytes ([`Qp::post_empty_write`])
    Empty,
    /// a connection's send slot, posted with no task waiting ([`Qp::post_send_slot`]); its
    /// poster counts it as in flight until it is retired, as it does an inline SEND
    /// ([`Qp::post_inline_send`], which keeps no entry at all)
    Send { region: Arc<Region> },
}

struct InFlight {
    // drop order: a per-operation MR (iWARP read sink) before the memory it covers
    _mr: Option<Arc<MemoryRegion>>,
    mem: Mem,
}

/// A queue pair created with `ibv_create_qp` directly (sideway's builder always passes no SRQ),
/// destroyed when dropped. Work requests are posted with `ibv_post_send`/`ibv_post_recv`.
struct RawQp {
    qp: NonNull<ibv_qp>,
}

// SAFETY: a verbs QP may be used from any thread; libibverbs' post and modify calls are
// thread-safe (the providers lock their queues), and the pointer is only freed in Drop.
unsafe impl Send for RawQp {}
// SAFETY: as above: every call made through `&RawQp` is one of libibverbs' thread-safe verbs.
unsafe impl Sync for RawQp {}

impl Drop for RawQp {
    fn drop(&mut self) {
        // SAFETY: `qp` came from a successful `ibv_create_qp` and is destroyed once, here; the
        // `Qp` holding this drops it before releasing the memory of posted work requests, the
        // CQ, the SRQ and the PD (which all outlive the QP by field order / their Arcs).
        let ret = unsafe { rdma_mummy_sys::ibv_destroy_qp(self.qp.as_ptr()) };
        if ret != 0 {
            tracing::warn!("transport-rdma: ibv_destroy_qp failed: {ret}");
        }
    }
}

/// A borrowed QP handle for sideway's `QueuePair::modify` (which only needs the pointer).
struct ModifyHandle(NonNull<ibv_qp>);

impl QueuePair for ModifyHandle {
    unsafe fn qp(&self) -> NonNull<ibv_qp> {
        self.0
    }

    type Guard<'g>
        = BasicPostSendGuard<'g>
    where
        Self: 'g;

    fn start_post_send(&mut self) -> Self::Guard<'_> {
        // Work requests are posted with `ibv_post_send` (see `Qp::post_send_wr`); this handle
        // exists only to reach sideway's checked `modify`.
        unreachable!("ModifyHandle is never used to post")
    }
}

/// A reliable-connected queue pair (basic QP: siw refuses the extended one), receiving either
/// into its own receive queue or from a shared one ([`Srq`]).
pub(crate) struct Qp {
    // drop order matters: the QP is destroyed first (in Drop: the device stops touching posted
    // buffers), only then are the regions of still-posted work requests released, the SRQ, the
    // CQ, the PD.
    qp: ManuallyDrop<RawQp>,
    /// serializes `ibv_modify_qp` calls
    modify_lock: Mutex<()>,
    inflight: Mutex<IdSlab<InFlight>>,
    qp_num: u32,
    /// The most bytes a SEND carries inline (copied into the work request as it is posted, so
    /// the device reads no registered memory for it): what the provider granted of
    /// `QpCaps::max_inline`, or less, down to 0.
    max_inline: u32,
    srq: Option<Arc<Srq>>,
    device: Arc<Device>,
    _cq: Arc<Cq>,
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: dropped once, here; nothing uses the QP after this.
        unsafe { ManuallyDrop::drop(&mut self.qp) };
        // A receive of the shared queue that this QP had taken (a message arriving, or flushed
        // as the QP died) completes on this QP's CQ; nobody polls that CQ any more, so
        // collect those completions here, before the CQ goes, and post their buffers to the
        // shared queue again: otherwise the queue would count them as posted for ever.
        let Some(srq) = &self.srq else { return };
        let mut polled = Polled::new();
        loop {
            match self._cq.poll(&mut polled) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            for wc in polled.wcs() {
                if wc.kind != WrKind::Recv {
                    continue;
                }
                if let Some(Mem::Pool(buf)) = srq.retire(wc.wr_id) {
                    if let Err((e, _)) = srq.post_recv_pool(buf) {
                        tracing::error!(
                            "transport-rdma: re-posting to the shared receive queue: {e}"
                        );
                    }
                }
            }
        }
    }
}

/// Queue sizes of a QP.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpCaps {
    pub(crate) max_send_wr: u32,
    pub(crate) max_recv_wr: u32,
    /// inline bytes per SEND to ask for (see `Qp::max_inline`)
    pub(crate) max_inline: u32,
}

impl Qp {
    /// Creates an RC QP on `device`'s PD whose completions go to `cq`; its receives come from
    /// `srq` if given (which must belong to the same device and PD), else from its own receive
    /// queue of `caps.max_recv_wr` entries.
    pub(crate) fn new(
        device: &Arc<Device>,
        cq: &Arc<Cq>,
        caps: QpCaps,
        srq: Option<&Arc<Srq>>,
    ) -> Result<Arc<Qp>, RdmaError> {
        if let Some(srq) = srq {
            if !Arc::ptr_eq(&srq.device, device) {
                return Err(RdmaError::InvalidArgument(
                    "the shared receive queue belongs to another device/PD".into(),
                ));
            }
        }
        // SAFETY: the CQ is live (its Arc is kept in the Qp, which outlives the raw QP).
        let cq_ptr = unsafe { cq.cq.cq().as_ptr() };
        // Inline SENDs: as much as the provider grants of what we ask, trying the next power of
        // two down where it refuses (providers refuse a larger `max_inline_data` than they have; 0 always goes).
        let mut raw;
        let mut want = caps.max_inline;
        let (max_inline, failed) = loop {
            let mut init = ibv_qp_init_attr {
                qp_context: std::ptr::null_mut(),
                send_cq: cq_ptr,
                recv_cq: cq_ptr,
                srq: srq.map_or(std::ptr::null_mut(), |s| s.srq.as_ptr()),
                cap: ibv_qp_cap {
                    max_send_wr: caps.max_send_wr,
                    max_recv_wr: if srq.is_some() { 0 } else { caps.max_recv_wr },
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: want,
                },
                qp_type: ibv_qp_type::IBV_QPT_RC,
                sq_sig_all: 0,
            };
            // SAFETY: the PD, CQ and SRQ pointers are live objects of the same device context (each
            // kept alive by an Arc stored in the returned Qp, which destroys the QP first); `init`
            // is a fully initialized attribute block that the call only reads and updates.
            raw = unsafe { rdma_mummy_sys::ibv_create_qp(device.pd.pd().as_ptr(), &mut init) };
            if !raw.is_null() {
                // the provider writes back what it granted, which may be more than asked
                break (want.min(init.cap.max_inline_data), None);
            }
            // Only a refused size (EINVAL, 22 on Linux; a provider may give it negated) is
            // worth another try with less inline data; any other failure (out of QPs, of
            // memory) is reported as it is.
            let err = std::io::Error::last_os_error();
            if want == 0 || !matches!(err.raw_os_error(), Some(22 | -22)) {
                break (0, Some(err));
            }
            // the next power of two down (siw takes 64, rxe 256 here)
            want = if want > 16 {
                (want - 1).next_power_of_two() / 2
            } else {
                0
            };
        };
        let qp = NonNull::new(raw).ok_or_else(|| RdmaError::Verbs {
            op: "ibv_create_qp",
            source: Box::new(failed.unwrap_or_else(std::io::Error::last_os_error)),
        })?;
        // SAFETY: `qp` is the live QP just created; `qp_num` is set by the provider at creation.
        let qp_num = unsafe { qp.as_ref().qp_num };
        tracing::debug!(qp_num, max_inline, "queue pair created");
        Ok(Arc::new(Qp {
            qp: ManuallyDrop::new(RawQp { qp }),
            modify_lock: Mutex::new(()),
            inflight: Mutex::new(IdSlab::default()),
            qp_num,
            max_inline,
            srq: srq.cloned(),
            device: Arc::clone(device),
            _cq: Arc::clone(cq),
        }))
    }

    pub(crate) fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The most bytes a SEND carries inline (see the field).
    pub(crate) fn max_inline(&self) -> u32 {
        self.max_inline
    }

    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// `ibv_modify_qp` with an attribute block and mask built here (for rdma_cm's attributes,
    /// which sideway's `QueuePairAttribute` cannot be made from).
    fn modify_raw(
        &self,
        attr: &mut ibv_qp_attr,
        mask: i32,
        op: &'static str,
    ) -> Result<(), RdmaError> {
        let _serial = lock(&self.modify_lock);
        // SAFETY: the QP is live (owned by `self`); `attr` is a fully initialised attribute
        // block (from rdma_init_qp_attr) that the call only reads, for the fields in `mask`.
        errno_result(op, unsafe {
            ibv_modify_qp(self.qp.qp.as_ptr(), attr, mask)
        })
    }

    /// The READ depths the QP has now (what the connection negotiated; on iWARP, what the
    /// connection manager set).
    pub(crate) fn read_depth(&self) -> Result<ReadDepth, RdmaError> {
        let attr = self.query(
            ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0,
        )?;
        Ok(ReadDepth {
            responder: attr.max_dest_rd_atomic,
            initiator: attr.max_rd_atomic,
        })
    }

    /// The QP's local ACK timeout exponent (4.096 µs × 2^n), as the device reports it now.
    pub(crate) fn ack_timeout_exponent(&self) -> Result<u8, RdmaError> {
        Ok(self.query(ibv_qp_attr_mask::IBV_QP_TIMEOUT.0)?.timeout)
    }

    /// `ibv_query_qp` for the attributes in `mask` (the others stay zero).
    fn query(&self, mask: u32) -> Result<ibv_qp_attr, RdmaError> {
        // SAFETY: all-zero attribute blocks are valid values (plain integers and structs of
        // them).
        let (mut attr, mut init): (ibv_qp_attr, ibv_qp_init_attr) =
            unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
        // SAFETY: the QP is live; the call only writes the two blocks.
        let ret = unsafe { ibv_query_qp(self.qp.qp.as_ptr(), &mut attr, mask as i32, &mut init) };
        errno_result("ibv_query_qp", ret)?;
        Ok(attr)
    }

    fn modify(&self, attr: &QueuePairAttribute, op: &'static str) -> Result<(), RdmaError> {
        let _serial = lock(&self.modify_lock);
        let mut handle = ModifyHandle(self.qp.qp);
        guarded(op, || handle.modify(attr))?.map_err(verbs_err(op))
    }

    /// Posts one signaled send-queue work request (`opcode`) of one scatter/gather entry;
    /// `inline` (a SEND of at most [`Qp::max_inline`] bytes only) has the post copy the bytes
    /// into the work request.
    fn post_send_wr(
        &self,
        wr_id: u64,
        opcode: ibv_wr_opcode::Type,
        sge: Option<(u32, u64, usize)>,
        remote: Option<RemoteAddr>,
        inline: bool,
    ) -> Result<(), std::io::Error> {
        let (lkey, addr, len) = sge.unwrap_or_default();
        let mut entry = ibv_sge {
            addr,
            length: len as u32,
            lkey,
        };
        // SAFETY: an all-zero `ibv_send_wr` is a valid value (null pointers, zero counts).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        if sge.is_some() {
            wr.sg_list = &mut entry;
            wr.num_sge = 1;
        }
        wr.opcode = opcode;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        let send = opcode == ibv_wr_opcode::IBV_WR_SEND;
        if inline {
            debug_assert!(send && sge.is_some() && self.inlines(len));
            // copied into the work request by the post itself: the device reads no memory for
            // it afterwards (saves its key lookup and DMA; on rxe and siw, a copy in the kernel)
            wr.send_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
        }
        if let Some(r) = remote {
            // an RDMA READ/WRITE reads the union's `rdma` member, the one written here
            wr.wr = wr_t {
                rdma: rdma_t {
                    remote_addr: r.addr,
                    rkey: r.rkey,
                },
            };
        }
        if send {
            crate::probe::mark(crate::probe::Point::Post);
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is live (owned by `self`); `wr` and `entry` live across the call, which
        // copies them into the send queue; with an `sge`, the caller has checked that the local
        // range lies in memory registered under `lkey` and keeps that memory in `inflight` until
        // the work request is retired or the QP destroyed, or (`inline`) that it is a SEND of at
        // most the QP's inline size, whose bytes the call copies into the work request, so they
        // need to be valid for reads only during the call (without an `sge`, the request touches
        // no local memory: no scatter/gather entry, `num_sge` 0).
        let ret = unsafe { rdma_mummy_sys::ibv_post_send(self.qp.qp.as_ptr(), &mut wr, &mut bad) };
        if send {
            crate::probe::mark(crate::probe::Point::Posted);
        }
        // siw returns negative errno values
        match ret {
            0 => Ok(()),
            e => Err(std::io::Error::from_raw_os_error(e.abs())),
        }
    }

    /// Posts one receive of one scatter/gather entry on the QP's own receive queue.
    fn post_recv_wr(&self, wr_id: u64, sge: (u32, u64, usize)) -> Result<(), std::io::Error> {
        let (lkey, addr, len) = sge;
        let mut sge = ibv_sge {
            addr,
            length: len as u32,
            lkey,
        };
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in `post_send_wr`; the caller keeps the buffer in `inflight`.
        let ret = unsafe { rdma_mummy_sys::ibv_post_recv(self.qp.qp.as_ptr(), &mut wr, &mut bad) };
        match ret {
            0 => Ok(()),
            e => Err(std::io::Error::from_raw_os_error(e.abs())),
        }
    }

    /// Moves the QP to the error state: every posted work request completes (flushed).
    pub(crate) fn set_error(&self) -> Result<(), RdmaError> {
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        self.modify(&attr, "ibv_modify_qp (error)")
    }

    /// Checks that `[off, off+len)` lies in `region`, registered on this QP's PD.
    fn check(&self, region: &Region, off: usize, len: usize) -> Result<(), RdmaError> {
        if !Arc::ptr_eq(&region.device, &self.device) {
            return Err(RdmaError::InvalidArgument(
                "buffer registered on another connection's device/PD".into(),
            ));
        }
        match off.checked_add(len) {
            Some(end) if end <= region.len && len <= u32::MAX as usize => Ok(()),
            _ => Err(RdmaError::InvalidArgument(format!(
                "range {off}+{len} outside the {}-byte buffer",
                region.len
            ))),
        }
    }

    /// Posts a signaled SEND of `region[off..off+len]`.
    pub(crate) fn post_send(
        &self,
        region: &Arc<Region>,
        off: usize,
        len: usize,
    ) -> Result<u64, RdmaError> {
        self.post_one(WrKind::Send, region, off, len, None)
    }

    /// Posts a signaled SEND of `region[..len]` with no task waiting for it: the QP keeps the
    /// region until the SEND is retired ([`Mem::Send`]); whoever posts it counts it as in
    /// flight until then. On failure the region is dropped.
    pub(crate) fn post_send_slot(&self, region: Arc<Region>, len: usize) -> Result<u64, RdmaError> {
        self.check(&region, 0, len)?;
        let (lkey, addr) = (region.mr.lkey(), region.addr(0));
        let entry = InFlight {
            _mr: None,
            mem: Mem::Send { region },
        };
        // `..len` lies inside the region (checked above), which the entry keeps allocated and
        // registered until this work request is retired or the QP is destroyed
        self.post_kept(
            SEND_SLOT_TAG as u8,
            entry,
            (ibv_wr_opcode::IBV_WR_SEND, "ibv_post_send (SEND)"),
            Some((lkey, addr, len)),
            None,
            self.inlines(len),
        )
    }

    /// Posts a signaled send-queue work request (see `post_send_wr`) whose `entry` (the memory
    /// it uses, what else it holds) stays in the in-flight table under `tag` until the request
    /// is retired or the QP destroyed; on failure the entry is dropped and the error names the
    /// operation. The caller has checked that `sge` lies in memory the entry keeps allocated
    /// and registered under its key, or that the request is an inline SEND, whose bytes the
    /// post copies.
    fn post_kept(
        &self,
        tag: u8,
        entry: InFlight,
        (opcode, op): (ibv_wr_opcode::Type, &'static str),
        sge: Option<(u32, u64, usize)>,
        remote: Option<RemoteAddr>,
        inline: bool,
    ) -> Result<u64, RdmaError> {
        let mut inflight = lock(&self.inflight);
        let wr_id = inflight.insert(tag, entry);
        let res = self.post_send_wr(wr_id, opcode, sge, remote, inline);
        res.map(|()| wr_id).map_err(|e| {
            inflight.remove(wr_id);
            RdmaError::Verbs {
                op,
                source: Box::new(e),
            }
        })
    }

    /// Whether a SEND of `len` bytes goes inline (see [`Qp::max_inline`]).
    fn inlines(&self, len: usize) -> bool {
        len <= self.max_inline as usize
    }

    /// Posts a signaled SEND of `bytes` inline (copied into the work request by the post
    /// itself, so they need not be registered and may be reused once this returns). It keeps
    /// no in-flight entry: the device reads no memory of ours for it, so there is nothing to
    /// hold until it is retired, and its completion ([`is_inline_send`]) has nothing to take
    /// out. Whoever posts it counts it as in flight until then (the connection: a send
    /// permit). An error if `bytes` is longer than the QP's inline size.
    pub(crate) fn post_inline_send(&self, bytes: &[u8]) -> Result<(), RdmaError> {
        if !self.inlines(bytes.len()) {
            return Err(RdmaError::InvalidArgument(format!(
                "{} bytes do not go inline (at most {})",
                bytes.len(),
                self.max_inline
            )));
        }
        // inline (checked above): the provider copies `bytes` during the call and the device
        // never reads them afterwards, so unregistered memory that lives only across the call
        // is enough; the key is not checked for an inline SEND
        self.post_send_wr(
            INLINE_SEND_TAG << 56,
            ibv_wr_opcode::IBV_WR_SEND,
            Some((0, bytes.as_ptr() as u64, bytes.len())),
            None,
            true,
        )
        .map_err(|e| RdmaError::Verbs {
            op: "ibv_post_send (inline SEND)",
            source: Box::new(e),
        })
    }

    /// Posts a signaled RDMA WRITE of `region[off..off+len]` to `remote`.
    pub(crate) fn post_write(
        &self,
        region: &Arc<Region>,
        off: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<u64, RdmaError> {
        self.post_one(WrKind::Write, region, off, len, Some(remote))
    }

    /// Posts a signaled RDMA WRITE of no bytes: no memory on either side and no remote key (a
    /// zero-length WRITE is checked against none; rxe and siw complete it and the connection
    /// carries on). It still travels to the peer as a packet, which is what it is for: see
    /// `RdmaConnection`'s nudge (conn.rs).
    pub(crate) fn post_empty_write(&self) -> Result<u64, RdmaError> {
        let entry = InFlight {
            _mr: None,
            mem: Mem::Empty,
        };
        // no scatter/gather entry: the request touches no local memory
        self.post_kept(
            WrKind::Write.tag(),
            entry,
            (
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                "ibv_post_send (empty RDMA WRITE)",
            ),
            None,
            Some(RemoteAddr { addr: 0, rkey: 0 }),
            false,
        )
    }

    /// Posts a signaled RDMA READ of `len` bytes at `remote` into `region[off..off+len]`.
    pub(crate) fn post_read(
        &self,
        region: &Arc<Region>,
        off: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<u64, RdmaError> {
        self.post_one(WrKind::Read, region, off, len, Some(remote))
    }

    fn post_one(
        &self,
        kind: WrKind,
        region: &Arc<Region>,
        off: usize,
        len: usize,
        remote: Option<RemoteAddr>,
    ) -> Result<u64, RdmaError> {
        self.check(region, off, len)?;
        // iWARP places RDMA READ responses through the sink's STag, which must allow remote
        // writes: register the sink for this operation only (revoked when it is retired).
        let op_mr = if kind == WrKind::Read && self.device.transport == Transport::IWarp {
            Some(region.register(AccessFlags::LocalWrite | AccessFlags::RemoteWrite)?)
        } else {
            None
        };
        let lkey = op_mr
            .as_ref()
            .map_or_else(|| region.mr.lkey(), |m| m.lkey());
        let entry = InFlight {
            _mr: op_mr,
            mem: Mem::Region(Arc::clone(region)),
        };
        let (opcode, op) = match (kind, remote) {
            (WrKind::Write, Some(_)) => (
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                "ibv_post_send (RDMA WRITE)",
            ),
            (WrKind::Read, Some(_)) => {
                (ibv_wr_opcode::IBV_WR_RDMA_READ, "ibv_post_send (RDMA READ)")
            }
            _ => (ibv_wr_opcode::IBV_WR_SEND, "ibv_post_send (SEND)"),
        };
        // the range was checked to lie inside the region, whose memory stays allocated (the Arc
        // in the entry) until this work request is retired or the QP is destroyed; `lkey`
        // belongs to an MR covering the whole region
        let inline = opcode == ibv_wr_opcode::IBV_WR_SEND && self.inlines(len);
        self.post_kept(
            kind.tag(),
            entry,
            (opcode, op),
            Some((lkey, region.addr(off), len)),
            remote,
            inline,
        )
    }

    /// Releases what a completed work request held: returns its memory.
    pub(crate) fn retire(&self, wr_id: u64) -> Option<Mem> {
        if let (WrKind::Recv, Some(srq)) = (WrKind::of(wr_id), &self.srq) {
            return srq.retire(wr_id);
        }
        let mut inflight = lock(&self.inflight);
        inflight.remove(wr_id).map(|f| f.mem)
    }

    fn check_pool(&self, buf: &PoolBuf, len: usize) -> Result<(), RdmaError> {
        if !Arc::ptr_eq(&buf.region.device, &self.device) {
            return Err(RdmaError::InvalidArgument(
                "pool buffer registered on another connection's device/PD".into(),
            ));
        }
        if len > buf.lease.capacity() || len > u32::MAX as usize {
            return Err(RdmaError::InvalidArgument(format!(
                "{len} bytes exceed the {}-byte pool buffer",
                buf.lease.capacity()
            )));
        }
        Ok(())
    }

    /// Posts a receive into the whole of pool buffer `buf`, which the work request keeps
    /// (see [`Qp::retire`]); on failure the buffer comes back with the error.
    pub(crate) fn post_recv_pool(&self, buf: PoolBuf) -> Result<u64, (RdmaError, PoolBuf)> {
        if let Some(srq) = &self.srq {
            return srq.post_recv_pool(buf);
        }
        let len = buf.lease.capacity();
        if let Err(e) = self.check_pool(&buf, len) {
            return Err((e, buf));
        }
        let (addr, lkey) = (buf.addr(), buf.region.mr.lkey());
        let mut inflight = lock(&self.inflight);
        let wr_id = inflight.insert(
            WrKind::Recv.tag(),
            InFlight {
                _mr: None,
                mem: Mem::Pool(buf),
            },
        );
        // `addr..addr+len` is the buffer's leased range (exclusive to it, inside the pool
        // region, which its `Arc` keeps allocated and registered); the buffer now sits in
        // `inflight` until this request is retired or the QP destroyed, so nothing else reaches
        // those bytes meanwhile; `lkey` is the region's MR (LOCAL_WRITE)
        let res = self.post_recv_wr(wr_id, (lkey, addr, len));
        res.map(|()| wr_id)
            .map_err(|e| unpost_pool(&mut inflight, wr_id, "ibv_post_recv", e))
    }

    /// Posts a signaled RDMA READ of `len` bytes at `remote` into pool buffer `buf` (from its
    /// start), which the work request keeps until it is retired (the completion hands it back)
    /// or the QP is destroyed: a dropped waiter never frees what the device may still write.
    pub(crate) fn post_read_pool(
        &self,
        buf: PoolBuf,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<u64, (RdmaError, PoolBuf)> {
        self.post_pool_op(WrKind::Read, buf, len, remote)
    }

    /// Posts a signaled RDMA WRITE of the first `len` bytes of pool buffer `buf` to `remote`;
    /// the work request keeps the buffer as [`Qp::post_read_pool`] does.
    pub(crate) fn post_write_pool(
        &self,
        buf: PoolBuf,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<u64, (RdmaError, PoolBuf)> {
        self.post_pool_op(WrKind::Write, buf, len, remote)
    }

    /// Posts a signaled RDMA WRITE of `payload`'s bytes, which lie in `region` (a pool region
    /// of this QP's connection), to `remote`; the work request keeps the payload and the
    /// region until it is retired, so the bytes stay registered and unchanged meanwhile.
    pub(crate) fn post_write_view(
        &self,
        region: &Arc<PoolRegion>,
        payload: rpc_core::Payload,
        remote: RemoteAddr,
    ) -> Result<u64, RdmaError> {
        if !Arc::ptr_eq(&region.device, &self.device) {
            return Err(RdmaError::InvalidArgument(
                "pool region registered on another connection's device/PD".into(),
            ));
        }
        let Some(addr) = region.local_address_of(&payload) else {
            return Err(RdmaError::InvalidArgument(
                "payload is not a view of the given pool region".into(),
            ));
        };
        let len = payload.len();
        if len > u32::MAX as usize {
            return Err(RdmaError::InvalidArgument(format!(
                "{len} bytes exceed one work request"
            )));
        }
        let lkey = region.mr.lkey();
        let entry = InFlight {
            _mr: None,
            mem: Mem::View {
                _payload: payload,
                _region: Arc::clone(region),
            },
        };
        // `addr..addr+len` lies inside the region (checked above), which its `Arc`, in the
        // entry, keeps allocated and registered under `lkey`; the payload beside it keeps
        // those bytes leased and frozen, so nothing on this side writes them while the device
        // reads them (in a write-exposed region the peer still may: see `PoolRegion`)
        self.post_kept(
            WrKind::Write.tag(),
            entry,
            (
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                "ibv_post_send (RDMA WRITE)",
            ),
            Some((lkey, addr, len)),
            Some(remote),
            false,
        )
    }

    fn post_pool_op(
        &self,
        kind: WrKind,
        mut buf: PoolBuf,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<u64, (RdmaError, PoolBuf)> {
        if let Err(e) = self.check_pool(&buf, len) {
            return Err((e, buf));
        }
        buf.lease.set_len(len);
        // iWARP places RDMA READ responses through the sink's STag, which must allow remote
        // writes; the pool regions a READ lands in never do (see `PoolRegion`): register the
        // sink buffer alone for this READ, revoked when it is retired (before the buffer is
        // handed back). InfiniBand/RoCE need no remote access on a READ's sink.
        let op_mr = if kind == WrKind::Read
            && self.device.transport == Transport::IWarp
            && buf.region.access != PoolAccess::RemoteWrite
            && len > 0
        {
            match buf.register_range(len, AccessFlags::LocalWrite | AccessFlags::RemoteWrite) {
                Ok(mr) => Some(mr),
                Err(e) => return Err((e, buf)),
            }
        } else {
            None
        };
        let addr = buf.addr();
        let lkey = op_mr
            .as_ref()
            .map_or_else(|| buf.region.mr.lkey(), |m| m.lkey());
        let mut inflight = lock(&self.inflight);
        let wr_id = inflight.insert(
            kind.tag(),
            InFlight {
                _mr: op_mr,
                mem: Mem::Pool(buf),
            },
        );
        let opcode = if kind == WrKind::Write {
            ibv_wr_opcode::IBV_WR_RDMA_WRITE
        } else {
            ibv_wr_opcode::IBV_WR_RDMA_READ
        };
        // as in `post_recv_pool`: the leased range is the buffer's alone, stays allocated and
        // registered, and the buffer sits in `inflight` until retired; `lkey` is the region's
        // MR or the per-READ MR covering `addr..addr+len`, kept in `inflight` beside the buffer
        // (and dropped before it)
        let res = self.post_send_wr(wr_id, opcode, Some((lkey, addr, len)), Some(remote), false);
        let op = if kind == WrKind::Write {
            "ibv_post_send (RDMA WRITE)"
        } else {
            "ibv_post_send (RDMA READ)"
        };
        res.map(|()| wr_id)
            .map_err(|e| unpost_pool(&mut inflight, wr_id, op, e))
    }
}

/// A shared receive queue: one pool of posted receive buffers for every QP created with it
/// (all on its device's PD), so that receive memory does not grow with the number of
/// connections. Its receive completions arrive on the CQ of the QP that received the message,
/// with the `wr_id` this SRQ gave them ([`Qp::retire`] hands them here).
pub(crate) struct Srq {
    // drop order: the SRQ is destroyed (in Drop) before the buffers posted to it are released
    srq: NonNull<ibv_srq>,
    inflight: Mutex<IdSlab<PoolBuf>>,
    device: Arc<Device>,
}

// SAFETY: libibverbs' SRQ verbs (post, destroy) are thread-safe; the pointer is only freed in
// Drop, and the posted buffers are only reached under the `inflight` lock.
unsafe impl Send for Srq {}
// SAFETY: as above.
unsafe impl Sync for Srq {}

impl Srq {
    /// Creates an SRQ of `max_wr` receives (one scatter/gather entry each) on `device`'s PD.
    pub(crate) fn new(device: &Arc<Device>, max_wr: u32) -> Result<Arc<Srq>, RdmaError> {
        let mut init = ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: ibv_srq_attr {
                max_wr,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: the PD is live (its Device's Arc is kept in the Srq, which destroys the SRQ
        // first); `init` is fully initialized and only read and updated by the call.
        let raw = unsafe { rdma_mummy_sys::ibv_create_srq(device.pd.pd().as_ptr(), &mut init) };
        let srq = NonNull::new(raw).ok_or_else(|| RdmaError::Verbs {
            op: "ibv_create_srq",
            source: Box::new(std::io::Error::last_os_error()),
        })?;
        Ok(Arc::new(Srq {
            srq,
            inflight: Mutex::new(IdSlab::default()),
            device: Arc::clone(device),
        }))
    }

    /// The device (and PD) whose QPs may use this SRQ.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Receives posted and not yet completed.
    pub(crate) fn posted(&self) -> usize {
        self.inflight.lock().len()
    }

    /// Posts a receive into the whole of pool buffer `buf` (registered on this SRQ's PD), which
    /// the SRQ keeps until the completion retires it or the SRQ is destroyed.
    pub(crate) fn post_recv_pool(&self, buf: PoolBuf) -> Result<u64, (RdmaError, PoolBuf)> {
        let len = buf.lease.capacity();
        if !Arc::ptr_eq(&buf.region.device, &self.device) || len > u32::MAX as usize {
            return Err((
                RdmaError::InvalidArgument(
                    "receive buffer not registered on the shared receive queue's PD".into(),
                ),
                buf,
            ));
        }
        let mut sge = ibv_sge {
            addr: buf.addr(),
            length: len as u32,
            lkey: buf.region.mr.lkey(),
        };
        let mut inflight = lock(&self.inflight);
        let wr_id = inflight.insert(WrKind::Recv.tag(), buf);
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the SRQ is live (owned by `self`); `wr` and `sge` live across the call, which
        // copies them; the range is the buffer's leased range (exclusive to it, registered
        // LOCAL_WRITE under `lkey` on this SRQ's PD), and the buffer now sits in `inflight`
        // until its completion retires it or the SRQ is destroyed.
        let ret =
            unsafe { rdma_mummy_sys::ibv_post_srq_recv(self.srq.as_ptr(), &mut wr, &mut bad) };
        if ret != 0 {
            let Some(buf) = inflight.remove(wr_id) else {
                unreachable!("inserted before posting")
            };
            return Err((
                RdmaError::Verbs {
                    op: "ibv_post_srq_recv",
                    source: Box::new(std::io::Error::from_raw_os_error(ret.abs())),
                },
                buf,
            ));
        }
        Ok(wr_id)
    }

    fn retire(&self, wr_id: u64) -> Option<Mem> {
        let mut inflight = lock(&self.inflight);
        inflight.remove(wr_id).map(Mem::Pool)
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        // SAFETY: every QP using this SRQ holds an Arc of it, so none is left; the SRQ came from
        // a successful `ibv_create_srq` and is destroyed once. Its posted buffers (in
        // `inflight`) are released after this, when the device no longer touches them.
        let ret = unsafe { rdma_mummy_sys::ibv_destroy_srq(self.srq.as_ptr()) };
        if ret != 0 {
            tracing::warn!("transport-rdma: ibv_destroy_srq failed: {ret}");
        }
    }
}

/// A pool work request that failed to post: its buffer comes back out of `inflight`, with the
/// error.
fn unpost_pool<E: std::error::Error + Send + Sync + 'static>(
    inflight: &mut IdSlab<InFlight>,
    wr_id: u64,
    op: &'static str,
    e: E,
) -> (RdmaError, PoolBuf) {
    let Some(InFlight {
        mem: Mem::Pool(buf),
        ..
    }) = inflight.remove(wr_id)
    else {
        unreachable!("inserted before posting")
    };
    (
        RdmaError::Verbs {
            op,
            source: Box::new(e),
        },
        buf,
    )
}

// ------------------------------------------------------------------------------------------------
// memory

/// Memory owned by this module, registered for local access on a device's PD.
pub(crate) struct Region {
    // deregistered in Drop before the memory is freed
    mr: ManuallyDrop<Arc<MemoryRegion>>,
    ptr: NonNull<u8>,
    len: usize,
    device: Arc<Device>,
}

// SAFETY: the region owns its heap memory (like a Box<[u8]>); the raw pointer is only
// dereferenced through `&mut Arc<Region>` with a unique Arc (see `bytes`/`bytes_mut`), and the
// MR handle is Send + Sync (sideway).
unsafe impl Send for Region {}
// SAFETY: shared references give no access to the bytes (only to the length and keys).
unsafe impl Sync for Region {}

impl Region {
    pub(crate) fn new(device: &Arc<Device>, len: usize) -> Result<Arc<Region>, RdmaError> {
        if len == 0 {
            return Err(RdmaError::InvalidArgument(
                "cannot register an empty buffer".into(),
            ));
        }
        let boxed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw: *mut [u8] = Box::into_raw(boxed);
        // SAFETY: Box::into_raw never returns null.
        let ptr = unsafe { NonNull::new_unchecked(raw as *mut u8) };
        // SAFETY: `ptr..ptr+len` is a live allocation owned by the region being built; it is
        // freed only in Drop, after the MR was deregistered.
        let mr = unsafe {
            device
                .pd
                .reg_mr(ptr.as_ptr() as usize, len, AccessFlags::LocalWrite)
        };
        match mr {
            Ok(mr) => Ok(Arc::new(Region {
                mr: ManuallyDrop::new(mr),
                ptr,
                len,
                device: Arc::clone(device),
            })),
            Err(e) => {
                // SAFETY: `raw` came from Box::into_raw above and was not registered.
                drop(unsafe { Box::from_raw(raw) });
                Err(RdmaError::Verbs {
                    op: "ibv_reg_mr",
                    source: Box::new(e),
                })
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn addr(&self, off: usize) -> u64 {
        self.ptr.as_ptr() as u64 + off as u64
    }

    /// Registers one more MR over the whole region.
    fn register(&self, access: AccessFlags) -> Result<Arc<MemoryRegion>, RdmaError> {
        // SAFETY: the memory is live while `self` is; callers keep the region alive (an Arc
        // held next to the MR) until the returned MR is dropped.
        unsafe {
            self.device
                .pd
                .reg_mr(self.ptr.as_ptr() as usize, self.len, access)
        }
        .map_err(verbs_err("ibv_reg_mr"))
    }

    /// The bytes, when no posted work request and no exposure holds the region.
    pub(crate) fn bytes(this: &mut Arc<Region>) -> Option<&[u8]> {
        let r = Arc::get_mut(this)?;
        // SAFETY: the Arc is unique, so no work request (each holds an Arc) can make the device
        // touch this memory and no exposure (holds an Arc) lets a peer reach it; the slice
        // borrows `this` mutably, so the Arc cannot be cloned while it lives.
        Some(unsafe { std::slice::from_raw_parts(r.ptr.as_ptr(), r.len) })
    }

    /// The bytes, mutably, under the same condition as [`Region::bytes`].
    pub(crate) fn bytes_mut(this: &mut Arc<Region>) -> Option<&mut [u8]> {
        let r = Arc::get_mut(this)?;
        // SAFETY: as in `bytes`; the unique `&mut Region` makes this the only reference.
        Some(unsafe { std::slice::from_raw_parts_mut(r.ptr.as_ptr(), r.len) })
    }

    /// Makes the whole region remotely accessible until the returned exposure is dropped.
    pub(crate) fn expose(
        this: &Arc<Region>,
        remote_read: bool,
        remote_write: bool,
    ) -> Result<Exposure, RdmaError> {
        let mut access = AccessFlags::LocalWrite;
        if remote_read {
            access |= AccessFlags::RemoteRead;
        }
        if remote_write {
            access |= AccessFlags::RemoteWrite;
        }
        let mr = this.register(access)?;
        Ok(Exposure {
            mr,
            region: Arc::clone(this),
        })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let only = Arc::strong_count(&self.mr) == 1;
        debug_assert!(only, "the local MR of a region is never shared");
        if !only {
            // Cannot happen (the MR Arc never leaves this module). Leak rather than free memory
            // that an MR still covers.
            tracing::error!(
                "transport-rdma: region MR still referenced at drop; leaking {} bytes",
                self.len
            );
            return;
        }
        // Deregister first: the device must not be able to reach the memory once it is freed.
        // SAFETY: `self.mr` is dropped exactly once, here, and never touched again.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
        let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `raw` is the allocation made by Box::into_raw in `new`; the MR covering it was
        // just deregistered, and every work request or exposure using it held an Arc of this
        // region, so none is left.
        drop(unsafe { Box::from_raw(raw) });
    }
}

/// A region made remotely accessible: address + length + rkey can be given to the peer.
/// Dropping it deregisters the MR, which revokes the peer's access.
pub(crate) struct Exposure {
    // drop order: the MR before our reference to the memory
    mr: Arc<MemoryRegion>,
    region: Arc<Region>,
}

impl Exposure {
    pub(crate) fn addr(&self) -> u64 {
        self.region.addr(0)
    }

    pub(crate) fn len(&self) -> usize {
        self.region.len
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

// ------------------------------------------------------------------------------------------------
// tokio registration of the channels' fds

/// Objects owning a file descriptor that stays open, and the same, for their whole life.
pub(crate) trait StableFd: AsRawFd {}
impl StableFd for Cq {}
impl StableFd for CmChannel {}

/// Keeps the object whose fd is registered with tokio alive as long as the registration.
pub(crate) struct FdOwner<T: StableFd>(pub(crate) Arc<T>);

impl<T: StableFd> AsRawFd for FdOwner<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Registers a channel's fd (readable interest) with the current tokio runtime.
pub(crate) fn async_fd<T: StableFd>(
    obj: Arc<T>,
) -> Result<tokio::io::unix::AsyncFd<FdOwner<T>>, RdmaError> {
    // SAFETY: the fd belongs to a completion channel or rdma_cm event channel, which closes it
    // only when destroyed; the `FdOwner` inside the AsyncFd holds an Arc of that channel, so the
    // fd stays open and unchanged for the whole life of the AsyncFd.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(
            FdOwner(obj),
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| RdmaError::Verbs {
        op: "register fd with tokio",
        source: Box::new(e.into_parts().1),
    })
}

/// A region nobody else can reach any more (no work request, no exposure, no other handle):
/// read-only bytes for as long as it lives, still registered (so it can be pooled later).
pub(crate) struct Frozen {
    region: Arc<Region>,
}

impl Region {
    /// Freezes `this` if it is the only handle of the region.
    pub(crate) fn freeze(this: Arc<Region>) -> Result<Frozen, Arc<Region>> {
        if Arc::strong_count(&this) == 1 && Arc::weak_count(&this) == 0 {
            Ok(Frozen { region: this })
        } else {
            Err(this)
        }
    }
}

impl AsRef<[u8]> for Frozen {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `freeze` checked that this Arc was the only handle; `Frozen` never clones it
        // nor gives it out, so no work request or exposure can be created for the region and
        // the device cannot write to it: shared, read-only access is sound.
        unsafe { std::slice::from_raw_parts(self.region.ptr.as_ptr(), self.region.len) }
    }
}

// ------------------------------------------------------------------------------------------------
// registered pools

/// What a peer may do to a [`PoolRegion`] through its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolAccess {
    /// `LOCAL_WRITE` only: receive slots
    Local,
    /// `LOCAL_WRITE | REMOTE_READ`: the read-exposed rendezvous region
    RemoteRead,
    /// `LOCAL_WRITE | REMOTE_WRITE` (no `REMOTE_READ`): the write-exposed rendezvous region
    RemoteWrite,
}

/// One allocation, registered ONCE (receive slots when the connection is set up, rendezvous
/// regions on their first use) on the connection's own protection domain, and carved into
/// buffers by an `rpc_core::pool::Pool`.
///
/// The key is only valid on QPs of the connection's PD, i.e. on this one connection: a peer can
/// reach only the buffers of its own connection, never another's. Within the connection, the
/// key covers the whole region for its whole life (per-transfer narrowing would need memory
/// windows, which siw lacks, or a registration per transfer), which is why the rendezvous pool
/// is split by what the peer may do ([`PoolAccess`]):
///
/// - the *read-exposed* region (`REMOTE_READ`, never `REMOTE_WRITE`) holds our outbound pull
///   sources, our push sources, and the sinks of our RDMA READs (inbound pulls) on every
///   transport: on InfiniBand/RoCE a READ sink needs no remote access; on iWARP, whose READ
///   responses are placed through the sink's STag, [`Qp::post_read_pool`] registers the one
///   sink buffer `LOCAL_WRITE | REMOTE_WRITE` for that READ only and deregisters it when the
///   READ is retired, before the buffer is handed on. So no key a peer holds lets it write into
///   our outbound sources, nor into a payload we received by pull once it is delivered. The
///   peer may read anything in this region (data sent to it, or data it sent us), which is what
///   lets a pulled payload be re-exposed without a copy.
/// - the *write-exposed* region (`REMOTE_WRITE`, no `REMOTE_READ`: nothing in it is ever
///   re-exposed for reading: a payload pushed to us is copied if it is sent on by pull, WRITten
///   from where it is if by push) holds only the
///   buffers we grant the peer to push into. **What remains:** the peer's key covers the whole
///   region for the connection's life, so a buffer granted to a push stays writable by that
///   peer after its `PushDone`, while the handler holds the payload delivered in it (and any
///   other granted buffer of the region): a misbehaving peer can change data it pushed to us
///   after a handler checked it (time-of-check/time-of-use), on its own connection only.
///   Closing that needs a registration per transfer or memory windows (siw has none); a service
///   that must not trust its peers after the check should copy pushed payloads, or receive by
///   pull (`push_up_to = 0` on the sender).
pub(crate) struct PoolRegion {
    // deregistered in Drop before the memory is freed
    mr: ManuallyDrop<Arc<MemoryRegion>>,
    ptr: NonNull<u8>,
    len: usize,
    device: Arc<Device>,
    pool: rpc_core::pool::Pool,
    access: PoolAccess,
}

// SAFETY: the region owns its heap memory (like a Box<[u8]>); its bytes are only reached
// through a `PoolBuf` (an exclusive lease of a range) or a `PoolView` (a frozen lease), never
// through `&PoolRegion`; the MR handle is Send + Sync (sideway).
unsafe impl Send for PoolRegion {}
// SAFETY: shared references give no access to the bytes (only to the keys and the range).
unsafe impl Sync for PoolRegion {}

impl PoolRegion {
    pub(crate) fn new(
        device: &Arc<Device>,
        pool: rpc_core::pool::Pool,
        access: PoolAccess,
    ) -> Result<Arc<PoolRegion>, RdmaError> {
        let len = pool.region_len();
        if len == 0 {
            return Err(RdmaError::InvalidArgument("empty pool".into()));
        }
        let flags = match access {
            PoolAccess::Local => AccessFlags::LocalWrite,
            PoolAccess::RemoteRead => AccessFlags::LocalWrite | AccessFlags::RemoteRead,
            PoolAccess::RemoteWrite => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
        };
        let boxed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let raw: *mut [u8] = Box::into_raw(boxed);
        // SAFETY: Box::into_raw never returns null.
        let ptr = unsafe { NonNull::new_unchecked(raw as *mut u8) };
        // SAFETY: `ptr..ptr+len` is a live allocation owned by the region being built; it is
        // freed only in Drop, after the MR was deregistered.
        let mr = unsafe { device.pd.reg_mr(ptr.as_ptr() as usize, len, flags) };
        match mr {
            Ok(mr) => Ok(Arc::new(PoolRegion {
                mr: ManuallyDrop::new(mr),
                ptr,
                len,
                device: Arc::clone(device),
                pool,
                access,
            })),
            Err(e) => {
                // SAFETY: `raw` came from Box::into_raw above and was not registered.
                drop(unsafe { Box::from_raw(raw) });
                Err(RdmaError::Verbs {
                    op: "ibv_reg_mr (pool)",
                    source: Box::new(e),
                })
            }
        }
    }

    /// Lends a buffer of at least `len` bytes (its used length set to `len`), or `None`.
    pub(crate) fn lease(this: &Arc<PoolRegion>, len: usize) -> Option<PoolBuf> {
        let lease = this.pool.lease(len)?;
        Some(PoolBuf {
            lease,
            region: Arc::clone(this),
        })
    }

    pub(crate) fn pool(&self) -> &rpc_core::pool::Pool {
        &self.pool
    }

    pub(crate) fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// What the peer may do through the region's key.
    pub(crate) fn access(&self) -> PoolAccess {
        self.access
    }

    /// The registered bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// If `bytes` lie inside this region and the region lets the peer READ them (and nothing
    /// more), their address (for the peer): then they are (part of) a frozen view handed out by
    /// this region, kept alive by whoever holds `bytes`.
    pub(crate) fn address_of(&self, bytes: &[u8]) -> Option<u64> {
        if self.access != PoolAccess::RemoteRead {
            return None;
        }
        self.local_address_of(bytes)
    }

    /// If `bytes` lie inside this region, whatever it exposes, their address (for a local
    /// work request).
    pub(crate) fn local_address_of(&self, bytes: &[u8]) -> Option<u64> {
        let start = self.ptr.as_ptr() as usize;
        let p = bytes.as_ptr() as usize;
        (!bytes.is_empty() && p >= start && p + bytes.len() <= start + self.len).then_some(p as u64)
    }
}

impl Drop for PoolRegion {
    fn drop(&mut self) {
        if Arc::strong_count(&self.mr) != 1 {
            // Cannot happen (the MR Arc never leaves this module). Leak rather than free memory
            // that an MR still covers.
            tracing::error!("transport-rdma: pool MR still referenced at drop; leaking it");
            return;
        }
        // SAFETY: `self.mr` is dropped exactly once, here, and never touched again.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
        let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `raw` is the allocation made by Box::into_raw in `new`; the MR covering it was
        // just deregistered, and every buffer (posted or not) and view held an Arc of this
        // region, so none is left.
        drop(unsafe { Box::from_raw(raw) });
    }
}

/// Exclusive use of one buffer of a [`PoolRegion`] (an `rpc_core::pool::Lease` of it). Posting
/// it moves it into the QP's in-flight table; it returns to the pool when dropped.
pub(crate) struct PoolBuf {
    // drop order: the lease goes back to the free list, then the region may go
    lease: rpc_core::pool::Lease,
    region: Arc<PoolRegion>,
}

impl PoolBuf {
    fn addr(&self) -> u64 {
        self.region.ptr.as_ptr() as u64 + self.lease.offset() as u64
    }

    /// Registers the buffer's first `len` bytes (at most its capacity) with `access`, on its
    /// region's PD: an MR of its own, for one operation.
    fn register_range(
        &self,
        len: usize,
        access: AccessFlags,
    ) -> Result<Arc<MemoryRegion>, RdmaError> {
        let len = len.min(self.lease.capacity());
        // SAFETY: `addr..addr+len` lies inside the buffer's leased range, inside the region,
        // which stays allocated while an Arc of it lives; callers keep this buffer (and so its
        // region Arc) beside the returned MR until the MR is dropped (`InFlight` drops its MR
        // before its memory).
        unsafe {
            self.region
                .device
                .pd
                .reg_mr(self.addr() as usize, len, access)
        }
        .map_err(verbs_err("ibv_reg_mr (READ sink)"))
    }

    /// Address of the buffer for the peer, and the region's remote key.
    pub(crate) fn remote(&self) -> (u64, u32) {
        (self.addr(), self.region.rkey())
    }

    pub(crate) fn len(&self) -> usize {
        self.lease.len()
    }

    /// Sets the used length (at most the capacity).
    pub(crate) fn set_len(&mut self, len: usize) {
        self.lease.set_len(len.min(self.lease.capacity()));
    }

    /// The used bytes, mutably.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        let (ptr, len) = (self.addr() as *mut u8, self.lease.len());
        // SAFETY: the lease's range lies inside the region (the pool lays it out within
        // `region_len`), which this buffer's Arc keeps allocated; the pool lends a range to one
        // lease at a time, so no other PoolBuf or PoolView covers it; this buffer is not posted
        // (posting moves it into the QP) and is held by value, so the device does not touch it;
        // the slice borrows `self` mutably, so it is the only reference. (In the write-exposed
        // region, a misbehaving peer holding its key could still write here: see `PoolRegion`.)
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }

    /// The used bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        let (ptr, len) = (self.addr() as *const u8, self.lease.len());
        // SAFETY: as in `bytes_mut`: the leased range is this buffer's alone, inside the region
        // this buffer's Arc keeps allocated, and the buffer is not posted; the slice borrows
        // `self`, so no `bytes_mut` slice exists beside it.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// Freezes the buffer: read-only bytes for as long as the view lives, then back to the pool.
    pub(crate) fn freeze(self) -> PoolView {
        PoolView { buf: self }
    }
}

/// A pool buffer nothing can write any more (no work request holds it; it is never posted
/// again): read-only bytes, e.g. the owner of a received `Payload`. Returns to the pool when
/// dropped.
pub(crate) struct PoolView {
    buf: PoolBuf,
}

impl AsRef<[u8]> for PoolView {
    fn as_ref(&self) -> &[u8] {
        let (ptr, len) = (self.buf.addr() as *const u8, self.buf.lease.len());
        // SAFETY: as in `PoolBuf::bytes_mut`, the leased range is this buffer's alone and stays
        // allocated; `PoolView` owns the buffer and never gives it out nor posts it, so neither
        // local code nor the device writes to it while shared references exist.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}
