//! Timestamps of SEND posts and receive completions, for splitting a round trip into its
//! parts across two processes: built only with the `latency-probe` feature (without it,
//! [`mark`] is empty and compiles to nothing).
//!
//! With `RDMA_RPC_PROBE_DIR` set, each process records the wall-clock time (`CLOCK_REALTIME`,
//! the one clock two processes of one machine share) just before every SEND is posted, just
//! after its post returned, and just after every receive completion is polled, and appends
//! them, 8,192 at a time, to `<dir>/probe-<pid>-post.txt`, `<dir>/probe-<pid>-posted.txt` and
//! `<dir>/probe-<pid>-recv.txt` (one number of nanoseconds per line), up to
//! `RDMA_RPC_PROBE_COUNT` of each (1,000,000 by default). The room for one batch is reserved at
//! the first mark; a process that ends between two appends loses the last partial batch.
//! `scripts/latency-split.py <dir>` pairs a client's and a server's records of a one-in-flight
//! run (`rpc-perf --concurrency 1`) and prints the median and the 99th percentile of each
//! part: request on the wire (post to the peer's completion found; of which the sender's post
//! call, which on rxe does the device's whole work), server (its completion to its answer's
//! post), answer on the wire, client (its completion to its next post). See docs/latency.md.

/// What is recorded.
#[derive(Clone, Copy)]
pub(crate) enum Point {
    /// just before a SEND is posted
    Post = 0,
    /// just after a receive completion was polled
    Recv = 1,
    /// just after a SEND's post returned
    Posted = 2,
}

#[cfg(feature = "latency-probe")]
mod imp {
    use std::io::Write;
    use std::sync::{Mutex, OnceLock};
    use std::time::{SystemTime, UNIX_EPOCH};

    use super::Point;

    /// Marks written to the file at a time.
    const BATCH: usize = 8192;

    struct Probe {
        dir: std::path::PathBuf,
        count: usize,
        /// per point: the batch not yet written, and how many were recorded in all
        marks: [Mutex<(Vec<u64>, usize)>; 3],
    }

    fn probe() -> Option<&'static Probe> {
        static PROBE: OnceLock<Option<Probe>> = OnceLock::new();
        PROBE
            .get_or_init(|| {
                let dir = std::env::var_os("RDMA_RPC_PROBE_DIR")?;
                let count = std::env::var("RDMA_RPC_PROBE_COUNT")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1_000_000);
                Some(Probe {
                    dir: dir.into(),
                    count,
                    marks: std::array::from_fn(|_| Mutex::new((Vec::new(), 0))),
                })
            })
            .as_ref()
    }

    pub(crate) fn mark(point: Point) {
        let Some(p) = probe() else { return };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let mut guard = p.marks[point as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (batch, recorded) = &mut *guard;
        if *recorded >= p.count {
            return;
        }
        if batch.capacity() == 0 {
            batch.reserve_exact(BATCH);
        }
        batch.push(now);
        *recorded += 1;
        if batch.len() == BATCH || *recorded == p.count {
            let name = match point {
                Point::Post => "post",
                Point::Recv => "recv",
                Point::Posted => "posted",
            };
            let path = p
                .dir
                .join(format!("probe-{}-{name}.txt", std::process::id()));
            let text: String = batch.iter().map(|t| format!("{t}\n")).collect();
            batch.clear();
            let res = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut f| f.write_all(text.as_bytes()));
            if let Err(e) = res {
                tracing::warn!("transport-rdma: probe {}: {e}", path.display());
            }
        }
    }
}

#[cfg(feature = "latency-probe")]
pub(crate) use imp::mark;

/// Records `point` (the `latency-probe` feature is off: nothing).
#[cfg(not(feature = "latency-probe"))]
#[inline(always)]
pub(crate) fn mark(_point: Point) {}
