//! Benchmarks of rdma-rpc against its peers, with the same workloads on each:
//!
//! - **small call**: one `u64` in, one `u64` out (`small(x) -> x + 1`);
//! - **calls/s**: N small calls kept in flight (closed loop, N tasks) over 1 or 8 connections;
//! - **bandwidth**: `put(bytes) -> len` (upload) and `get(len) -> bytes` (download), one call
//!   in flight, 4 KiB to 64 MiB.
//!
//! Systems ([`System`]): rdma-rpc over TCP ([`rdma_rpc_sys`]), tarpc 0.38 with bincode over
//! its TCP transport ([`tarpc_sys`]), ruapc 0.2.0-alpha.7 on TCP with MessagePack, inline and
//! with its bulk-buffer API ([`ruapc_sys`]), and hand-written length-prefixed exchanges on raw
//! tokio TCP as the floor ([`raw`]). Each gets its fast path: `TCP_NODELAY`, payloads as byte
//! strings (`serde_bytes`) that the client does not copy before sending, and the server
//! answering `get` from one prepared buffer.
//!
//! Server and client share one process and one tokio multi-thread runtime of 2 workers
//! ([`runtime`]); each system gets a fresh runtime.
//!
//! The `rdma` feature adds rdma-rpc over `rdma://` to the criterion bench (endpoint from
//! `RDMA_RPC_BENCH_RDMA`, default `rdma://127.0.0.1:0`): the hook for the guest with a device.
//! `compare --rdma-ip IP --rdma-device DEV` runs rdma-rpc over `rdma://` and, with the
//! `ruapc-rdma` feature (ruapc's RDMA transport, which links libibverbs at build time), ruapc
//! over `tcp+rdma://` ([`ruapc_sys::RuapcNet`]) on that device: scripts/ruapc-rdma-compare.sh
//! runs it in the QEMU guest on Soft-RoCE.
#![allow(missing_docs, unreachable_pub)]

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub mod raw;
pub mod rdma_rpc_sys;
pub mod ruapc_sys;
pub mod tarpc_sys;

/// Largest payload any workload moves.
pub const MAX_PAYLOAD: usize = 64 << 20;

/// Payload sizes of the bandwidth curves.
pub const BANDWIDTH_SIZES: [usize; 5] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

/// In-flight counts of the calls/s curves.
pub const IN_FLIGHT: [usize; 4] = [1, 16, 64, 256];

/// Errors are reported as text: a bench prints them and goes on.
pub type Error = String;

/// Makes any error printable as [`Error`].
pub fn err(e: impl std::fmt::Display) -> Error {
    e.to_string()
}

/// The runtime every measurement runs on: multi-thread, 2 workers, I/O and timers.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The bytes payloads are cut from (a pattern, not zeros, so nothing compresses or skips).
pub fn payload_source() -> Bytes {
    payload_source_of(MAX_PAYLOAD)
}

/// The first `len` bytes of [`payload_source`] (a run that never moves more keeps its
/// memory: in the 2 GiB guest every byte counts).
pub fn payload_source_of(len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8)
            .collect::<Vec<u8>>(),
    )
}

/// Payload bytes, serialised with `serde_bytes` (one length-prefixed byte string, no per-byte
/// visits) and cheap to clone, so a call does not copy the caller's buffer before encoding.
#[derive(Debug, Clone, Default)]
pub struct Blob(pub Bytes);

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serde_bytes::serialize(&self.0[..], s)
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Blob, D::Error> {
        let v: serde_bytes::ByteBuf = serde_bytes::ByteBuf::deserialize(d)?;
        Ok(Blob(Bytes::from(v.into_vec())))
    }
}

/// Direction of a bulk transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Client to server (`put`).
    Put,
    /// Server to client (`get`).
    Get,
}

impl Dir {
    pub fn name(self) -> &'static str {
        match self {
            Dir::Put => "put",
            Dir::Get => "get",
        }
    }
}

/// One client connection of a system. Clones share the connection.
pub trait Conn: Clone + Send + Sync + 'static {
    /// One small call.
    fn small(&self) -> impl Future<Output = Result<(), Error>> + Send;
    /// Uploads `data` (the server answers with the length it got, which is checked).
    fn put(&self, data: Bytes) -> impl Future<Output = Result<(), Error>> + Send;
    /// Downloads `len` bytes (the length received is checked).
    fn get(&self, len: usize) -> impl Future<Output = Result<(), Error>> + Send;
}

/// A running server of some system, in this process, and the way to connect to it.
pub trait System: Send + Sync + Sized + 'static {
    type Conn: Conn;

    /// Name in tables (`rdma-rpc`, `tarpc`, …).
    fn name(&self) -> String;

    /// Opens a new connection.
    fn connect(&self) -> impl Future<Output = Result<Self::Conn, Error>> + Send;

    /// Stops the server.
    fn stop(self) -> impl Future<Output = ()> + Send;

    /// Which workloads this system takes part in (a bulk-only variant skips small calls).
    fn does_small_calls(&self) -> bool {
        true
    }

    /// Largest payload it can move in one call, if limited.
    fn max_payload(&self) -> usize {
        MAX_PAYLOAD
    }

    /// Small calls per second with `in_flight` calls kept in flight over `conns` (task `i`
    /// uses connection `i % conns.len()`), for `dur`. The default runs `in_flight` tasks that
    /// each call in a loop; the raw floor overrides it with one pipelining task per connection.
    fn calls_per_sec(
        &self,
        conns: &[Self::Conn],
        in_flight: usize,
        dur: Duration,
    ) -> impl Future<Output = Result<f64, Error>> + Send {
        closed_loop(conns.to_vec(), in_flight, dur)
    }

    /// Runs `count` small calls with `in_flight` in flight over `conns`; returns the time taken.
    /// (For criterion's `iter_custom`.)
    fn run_calls(
        &self,
        conns: &[Self::Conn],
        in_flight: usize,
        count: u64,
    ) -> impl Future<Output = Result<Duration, Error>> + Send {
        fixed_calls(conns.to_vec(), in_flight, count)
    }
}

/// Default `calls_per_sec`: `in_flight` tasks calling in a loop until `dur` has passed.
pub async fn closed_loop<C: Conn>(
    conns: Vec<C>,
    in_flight: usize,
    dur: Duration,
) -> Result<f64, Error> {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(in_flight);
    for i in 0..in_flight {
        let conn = conns[i % conns.len()].clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                conn.small().await?;
                n += 1;
            }
            Ok::<u64, Error>(n)
        }));
    }
    tokio::time::sleep(dur).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(err)??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

/// `count` calls shared by `in_flight` tasks; the time they took.
pub async fn fixed_calls<C: Conn>(
    conns: Vec<C>,
    in_flight: usize,
    count: u64,
) -> Result<Duration, Error> {
    let in_flight = in_flight.max(1);
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(in_flight);
    for i in 0..in_flight {
        let conn = conns[i % conns.len()].clone();
        let n = count / in_flight as u64 + u64::from((i as u64) < count % in_flight as u64);
        tasks.push(tokio::spawn(async move {
            for _ in 0..n {
                conn.small().await?;
            }
            Ok::<(), Error>(())
        }));
    }
    for t in tasks {
        t.await.map_err(err)??;
    }
    Ok(start.elapsed())
}

/// Round-trip times of sequential small calls (one in flight) for `dur`, after `warmup`;
/// a histogram in nanoseconds. Runs in a task of the runtime (not on the thread that blocks on
/// it), like every other workload.
pub async fn latency<C: Conn>(
    conn: &C,
    warmup: Duration,
    dur: Duration,
) -> Result<Histogram<u64>, Error> {
    let conn = conn.clone();
    in_task(async move {
        let end = Instant::now() + warmup;
        while Instant::now() < end {
            conn.small().await?;
        }
        let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(err)?;
        let end = Instant::now() + dur;
        loop {
            let t = Instant::now();
            if t >= end {
                break;
            }
            conn.small().await?;
            h.saturating_record(t.elapsed().as_nanos() as u64);
        }
        Ok(h)
    })
    .await
}

/// Runs `f` as a task of the current runtime and waits for it: workloads run on the
/// runtime's workers, never on a thread blocked in `Runtime::block_on` (which would add a
/// cross-thread wake-up to every call).
pub async fn in_task<T: Send + 'static>(
    f: impl Future<Output = Result<T, Error>> + Send + 'static,
) -> Result<T, Error> {
    tokio::spawn(f).await.map_err(err)?
}

/// One bulk call of `len` bytes in direction `dir`.
pub async fn bulk<C: Conn>(conn: &C, dir: Dir, src: &Bytes, len: usize) -> Result<(), Error> {
    match dir {
        Dir::Put => conn.put(src.slice(..len)).await,
        Dir::Get => conn.get(len).await,
    }
}

/// Bytes per second moving `len`-byte payloads in direction `dir`, one call in flight, for at
/// least `dur` and at least `min_calls` calls, after one warm-up call (in a task).
pub async fn bandwidth<C: Conn>(
    conn: &C,
    dir: Dir,
    src: &Bytes,
    len: usize,
    dur: Duration,
    min_calls: u64,
) -> Result<f64, Error> {
    let (conn, src) = (conn.clone(), src.clone());
    in_task(async move {
        bulk(&conn, dir, &src, len).await?;
        let start = Instant::now();
        let mut n = 0u64;
        while n < min_calls || start.elapsed() < dur {
            bulk(&conn, dir, &src, len).await?;
            n += 1;
        }
        Ok((n * len as u64) as f64 / start.elapsed().as_secs_f64())
    })
    .await
}

/// `count` bulk calls back to back (in a task); the time they took (for criterion's
/// `iter_custom`).
pub async fn run_bulk<C: Conn>(
    conn: &C,
    dir: Dir,
    src: &Bytes,
    len: usize,
    count: u64,
) -> Result<Duration, Error> {
    let (conn, src) = (conn.clone(), src.clone());
    in_task(async move {
        let start = Instant::now();
        for _ in 0..count {
            bulk(&conn, dir, &src, len).await?;
        }
        Ok(start.elapsed())
    })
    .await
}

/// Opens `n` connections.
pub async fn connect_n<S: System>(sys: &S, n: usize) -> Result<Vec<S::Conn>, Error> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(sys.connect().await?);
    }
    Ok(conns)
}

/// `4k`, `16m`, `1g`, or a number of bytes.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim().to_ascii_lowercase();
    let s = s.strip_suffix("ib").or(s.strip_suffix('b')).unwrap_or(&s);
    let (num, mul) = match s.chars().last()? {
        'k' => (&s[..s.len() - 1], 1usize << 10),
        'm' => (&s[..s.len() - 1], 1 << 20),
        'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

/// `4 KiB`, `16 MiB`, `12 B`.
pub fn fmt_size(n: usize) -> String {
    if n >= 1 << 30 && n % (1 << 30) == 0 {
        format!("{} GiB", n >> 30)
    } else if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{} KiB", n >> 10)
    } else {
        format!("{n} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("16MiB"), Some(16 << 20));
        assert_eq!(parse_size("0"), Some(0));
        assert_eq!(parse_size("x"), None);
        assert_eq!(fmt_size(64 << 20), "64 MiB");
        assert_eq!(fmt_size(12), "12 B");
    }
}
