//! `soak`: mixed small and large calls with verified contents from several clients, while the
//! servers are killed and restarted at random.
//!
//! ```text
//! cargo run --release --example soak -- [--secs 60] [--servers 2] [--clients 3] [--workers 4]
//!     [--max-size 1m] [--up-ms 500..3000] [--down-ms 0..500] [--graceful-percent 25]
//!     [--deadline-ms 10000] [--rss-tolerance-mib 24] [--seed N] [--endpoint tcp://127.0.0.1:0]
//! ```
//!
//! `scripts/test.sh` runs the CI form (`--secs 60`); `scripts/soak.sh` the long form
//! (`--secs 600` unless told otherwise).
//!
//! - `--servers` servers, each in its own tokio runtime on its own thread, bound to a port of
//!   their own. Each lives for a random time in `--up-ms`, then is either killed (its runtime
//!   dropped: listener, connections and running handlers vanish at once, as when a process
//!   dies) or, `--graceful-percent` of the time, shut down gracefully; it stays down for a
//!   random time in `--down-ms` and is started again on the same port.
//! - `--clients` client connections to each server, `--workers` tasks on each calling in a
//!   closed loop. A call sends 64 B..`--max-size` bytes (60% up to 4 KiB, 25% up to 64 KiB,
//!   15% up to the maximum) of a pattern derived from the call's own seed, and asks for an
//!   answer of an independently chosen size derived from the inverted seed; a quarter of the
//!   handlers sleep up to 3 ms first, so that kills find calls in flight. The server checks
//!   the request's bytes; the client checks the answer's seed, the server's verdict and every
//!   byte. Clients are never rebuilt: they reconnect by themselves (`Config::reconnect`, on by
//!   default) and calls wait for the new connection (`wait_for_reconnect`).
//! - Every call has a deadline (`--deadline-ms`) and, on top, a watchdog of the deadline plus
//!   5 s: a call the watchdog has to stop is a hang.
//!
//! Fails (exit status 1) on any wrong answer, any hang, any error other than the clear ones a
//! dying server causes (`ConnectionClosed`, `Unavailable`, `DeadlineExceeded`, `I/O`, server
//! `ShuttingDown`), if too few calls succeed, if a client has not reconnected by itself
//! after the last restart, or if RSS is not flat after warm-up: the highest RSS over the last
//! twelfth of the run may exceed the highest over [1/4, 1/3] of the run by at most
//! `--rss-tolerance-mib`. (Calls in flight hold up to `2 * max-size` each, so RSS is compared
//! as window maxima, not single samples.)
//!
//! Measured on 2 shared cores (60 s, defaults): ~2,100 calls/s (~380 MB/s of payload), 66
//! restarts (50 kills), ~550 calls failed with `ConnectionClosed` (in flight at a kill), a few
//! with `ShuttingDown`/`Unavailable` (a graceful drain), none wrong or hung; RSS 41 MiB at 1/3
//! and 38 MiB at the end. `SOAK_TRACE=1` prints every failure with its time on stderr.
//!
//! Over RDMA (`--endpoint rdma://…`) the same run applies, and after every server life (killed
//! or stopped) the server's registered pools must have every buffer back and every region freed
//! ([`Server::rdma_pools`](rdma_rpc::Server::rdma_pools)); so must each client's, over every
//! connection it made, once the servers are gone and the clients dropped
//! ([`Client::rdma_pools`](rdma_rpc::Client::rdma_pools)); the run fails otherwise.

mod common;

use common::{load_average, rss_kib};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rdma_rpc::{rdma_service, Client, Endpoint, Payload, RpcError, Server, ServerErrorKind};
use serde::{Deserialize, Serialize};

/// The server's answer to [`Soak::exchange`].
#[derive(Serialize, Deserialize)]
pub struct Answer {
    /// The seed of the call this answers.
    pub seed: u64,
    /// Whether the request's bytes were the pattern of its seed.
    pub request_ok: bool,
    /// `reply_len` bytes of the pattern of `!seed`.
    pub data: Payload,
}

/// The calls of the soak.
#[rdma_service]
pub trait Soak {
    /// Sleeps `micros`, checks `data`, answers with `reply_len` bytes.
    async fn exchange(&self, seed: u64, data: Payload, reply_len: u64, micros: u64) -> Answer;
}

struct SoakImpl;

impl Soak for SoakImpl {
    async fn exchange(&self, seed: u64, data: Payload, reply_len: u64, micros: u64) -> Answer {
        if micros > 0 {
            tokio::time::sleep(Duration::from_micros(micros)).await;
        }
        Answer {
            seed,
            request_ok: matches(&data, seed),
            data: Payload::from(pattern(reply_len as usize, !seed)),
        }
    }
}

/// `len` bytes determined by `seed` (splitmix64 words).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut x = seed;
    while out.len() < len {
        let w = splitmix(&mut x).to_le_bytes();
        let n = (len - out.len()).min(8);
        out.extend_from_slice(&w[..n]);
    }
    out
}

/// Whether `data` is `pattern(data.len(), seed)`.
fn matches(data: &[u8], seed: u64) -> bool {
    let mut x = seed;
    data.chunks(8).all(|c| {
        let w = splitmix(&mut x).to_le_bytes();
        c == &w[..c.len()]
    })
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A small random number generator (xorshift64*), one per task.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut s = seed;
        Rng(splitmix(&mut s) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// A payload size: 60% 64 B..4 KiB, 25% up to 64 KiB, 15% up to `max`.
    fn size(&mut self, max: u64) -> u64 {
        let hi = match self.next() % 100 {
            0..60 => 4 << 10,
            60..85 => 64 << 10,
            _ => max,
        };
        let lo = 64.min(max);
        self.range(lo, hi.clamp(lo, max))
    }
}

// ---------------------------------------------------------------------------------------------
// Options.

struct Opts {
    secs: f64,
    servers: usize,
    clients: usize,
    workers: usize,
    max_size: u64,
    up_ms: (u64, u64),
    down_ms: (u64, u64),
    graceful_percent: u64,
    deadline: Duration,
    rss_tolerance_mib: u64,
    seed: u64,
    endpoint: String,
}

const USAGE: &str = "soak [--secs 60] [--servers 2] [--clients 3] [--workers 4] [--max-size 1m] \
[--up-ms 500..3000] [--down-ms 0..500] [--graceful-percent 25] [--deadline-ms 10000] \
[--rss-tolerance-mib 24] [--seed N] [--endpoint tcp://127.0.0.1:0]";

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        _ => (&t[..], 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|n| *n >= 1)
        .ok_or_else(|| format!("bad size {s:?} (like 4096, 64k, 1m)"))
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("bad range {s:?} (like 500..3000)");
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let (a, b) = (
        a.parse::<u64>().map_err(|_| bad())?,
        b.parse::<u64>().map_err(|_| bad())?,
    );
    if a > b {
        return Err(bad());
    }
    Ok((a, b))
}

fn parse_args() -> Result<Opts, String> {
    let mut o = Opts {
        secs: 60.0,
        servers: 2,
        clients: 3,
        workers: 4,
        max_size: 1 << 20,
        up_ms: (500, 3000),
        down_ms: (0, 500),
        graceful_percent: 25,
        deadline: Duration::from_secs(10),
        rss_tolerance_mib: 24,
        seed: 0x50a4,
        endpoint: "tcp://127.0.0.1:0".into(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--help" || a == "-h" {
            return Err(USAGE.into());
        }
        let (flag, v) = match a.split_once('=') {
            Some((f, v)) => (f.to_owned(), v.to_owned()),
            None => {
                let v = args.next().ok_or_else(|| format!("{a} needs a value"))?;
                (a, v)
            }
        };
        let n = || -> Result<u64, String> {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: expected a whole number, got {v:?}"))
        };
        match flag.as_str() {
            "--secs" => {
                o.secs = v
                    .parse::<f64>()
                    .ok()
                    .filter(|s| *s > 0.0)
                    .ok_or_else(|| format!("--secs: {v:?}"))?
            }
            "--servers" => o.servers = n()? as usize,
            "--clients" => o.clients = n()? as usize,
            "--workers" => o.workers = n()? as usize,
            "--max-size" => o.max_size = parse_size(&v)?,
            "--up-ms" => o.up_ms = parse_range(&v)?,
            "--down-ms" => o.down_ms = parse_range(&v)?,
            "--graceful-percent" => o.graceful_percent = n()?.min(100),
            "--deadline-ms" => o.deadline = Duration::from_millis(n()?),
            "--rss-tolerance-mib" => o.rss_tolerance_mib = n()?,
            "--seed" => o.seed = n()?,
            "--endpoint" => o.endpoint = v,
            _ => return Err(format!("unknown option {flag}\nusage: {USAGE}")),
        }
    }
    if o.servers == 0 || o.clients == 0 || o.workers == 0 {
        return Err("--servers, --clients and --workers must be at least 1".into());
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// Servers that die.

#[derive(Default)]
struct Restarts {
    killed: AtomicU64,
    graceful: AtomicU64,
    /// server lives whose RDMA buffer pools were checked after the server died
    pools_checked: AtomicU64,
    /// lives after which a buffer was still out or a region still registered
    pool_leaks: Mutex<Vec<String>>,
}

/// What is left of a side's RDMA pools once its connections are gone: `None` if every buffer
/// is back and every region freed (waits a little for a straggling drop); TCP has no pools.
/// Blocks: call it off the runtime.
#[cfg(feature = "rdma")]
fn pools_left(pools: Pools) -> Option<String> {
    let pools = pools?;
    let give_up = Instant::now() + Duration::from_secs(5);
    let mut c = pools.counts();
    while (c.outstanding() != 0 || c.live_regions != 0) && Instant::now() < give_up {
        thread::sleep(Duration::from_millis(10));
        c = pools.counts();
    }
    (c.outstanding() != 0 || c.live_regions != 0).then(|| format!("{c:?}"))
}

#[cfg(not(feature = "rdma"))]
fn pools_left(_: Pools) -> Option<String> {
    None
}

impl Restarts {
    /// After a server life ended (its runtime dropped): every buffer of its RDMA pools is back
    /// and every region freed (see `pools_left`).
    #[cfg(feature = "rdma")]
    fn check_pools(&self, index: usize, pools: Pools) {
        if pools.is_none() {
            return;
        }
        let left = pools_left(pools);
        self.pools_checked.fetch_add(1, Ordering::Relaxed);
        if let Some(left) = left {
            self.pool_leaks
                .lock()
                .unwrap()
                .push(format!("server {index}: {left}"));
        }
    }

    #[cfg(not(feature = "rdma"))]
    fn check_pools(&self, _: usize, _: Pools) {}
}

/// Starts server `index` on `bind` in a runtime of its own, in a thread that kills and
/// restarts it until `stop` says so (or is dropped); returns its endpoint once it serves.
fn spawn_server(
    index: usize,
    bind: Endpoint,
    o: &Opts,
    restarts: Arc<Restarts>,
    stop: std_mpsc::Receiver<()>,
) -> (Endpoint, thread::JoinHandle<Result<(), String>>) {
    let (up, down, graceful) = (o.up_ms, o.down_ms, o.graceful_percent);
    let mut rng = Rng::new(o.seed ^ (index as u64) << 48);
    let (ep_tx, ep_rx) = std_mpsc::channel();
    let thread = thread::spawn(move || -> Result<(), String> {
        let mut bind = bind;
        loop {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name(format!("soak-server-{index}"))
                .enable_all()
                .build()
                .map_err(|e| format!("server {index}: runtime: {e}"))?;
            let server = rt.block_on(bind_again(&bind))?;
            bind = server.local_endpoint();
            let _ = ep_tx.send(bind.clone());
            let shutdown = server.shutdown_handle();
            let pools = pools_of(&server);
            let serving = rt.spawn(server.serve(SoakServer::new(SoakImpl)));
            // Up for a random time, or until told to stop the chaos: then it stays up until
            // the stop channel closes, and shuts down gracefully.
            let lifetime = Duration::from_millis(rng.range(up.0, up.1));
            match stop.recv_timeout(lifetime) {
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    while stop.recv().is_ok() {}
                    shutdown.shutdown();
                    let drained = rt.block_on(async {
                        tokio::time::timeout(Duration::from_secs(30), serving).await
                    });
                    drop(rt);
                    restarts.check_pools(index, pools);
                    return match drained {
                        Ok(_) => Ok(()),
                        Err(_) => Err(format!("server {index}: no drain within 30 s")),
                    };
                }
            }
            if rng.range(0, 99) < graceful {
                shutdown.shutdown();
                let drained = rt.block_on(async {
                    tokio::time::timeout(Duration::from_secs(30), serving).await
                });
                if drained.is_err() {
                    return Err(format!(
                        "server {index}: graceful shutdown did not drain within 30 s"
                    ));
                }
                restarts.graceful.fetch_add(1, Ordering::Relaxed);
            } else {
                restarts.killed.fetch_add(1, Ordering::Relaxed);
            }
            // Kill: every task of the server (listener, connections, handlers) is dropped.
            drop(rt);
            restarts.check_pools(index, pools);
            thread::sleep(Duration::from_millis(rng.range(down.0, down.1)));
        }
    });
    let ep = ep_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the server starts");
    (ep, thread)
}

/// The server's RDMA pool counters (none over TCP).
#[cfg(feature = "rdma")]
type Pools = Option<rdma_rpc::PoolMonitor>;
/// A build without RDMA has no pools.
#[cfg(not(feature = "rdma"))]
type Pools = Option<std::convert::Infallible>;

#[cfg(feature = "rdma")]
fn pools_of(server: &Server) -> Pools {
    server.rdma_pools()
}

#[cfg(not(feature = "rdma"))]
fn pools_of(_: &Server) -> Pools {
    None
}

/// A client's RDMA pool counters, over all its connections (none over TCP).
#[cfg(feature = "rdma")]
fn client_pools_of(client: &Client) -> Pools {
    client.rdma_pools()
}

#[cfg(not(feature = "rdma"))]
fn client_pools_of(_: &Client) -> Pools {
    None
}

/// Binds, retrying for a while if the port is still held by the server just killed.
async fn bind_again(ep: &Endpoint) -> Result<Server, String> {
    let give_up = Instant::now() + Duration::from_secs(10);
    loop {
        match Server::bind(ep).await {
            Ok(s) => return Ok(s),
            Err(_) if Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(format!("bind {ep}: {e}")),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Callers.

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    bytes: AtomicU64,
    wrong: AtomicU64,
    hangs: AtomicU64,
    /// Clear failures by kind, and unexpected ones (prefixed "UNEXPECTED").
    failures: Mutex<BTreeMap<String, u64>>,
    /// The first message of each kind, with the second of the run it came at.
    first_of_kind: Mutex<BTreeMap<String, String>>,
    first_bad: Mutex<Option<String>>,
}

impl Tally {
    fn fail(&self, kind: String, e: &RpcError, at: f64) {
        self.first_of_kind
            .lock()
            .unwrap()
            .entry(kind.clone())
            .or_insert_with(|| format!("{at:.1} s: {e}"));
        if std::env::var_os("SOAK_TRACE").is_some() {
            eprintln!("{at:.3} {kind}");
        }
        *self.failures.lock().unwrap().entry(kind).or_default() += 1;
    }

    fn bad(&self, what: String) {
        self.first_bad.lock().unwrap().get_or_insert(what);
    }

    fn unexpected(&self) -> u64 {
        self.failures
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("UNEXPECTED"))
            .map(|(_, n)| n)
            .sum()
    }
}

/// A failure a dying server explains, or `None` for one it does not.
fn clear_failure(e: &RpcError) -> Option<&'static str> {
    match e {
        RpcError::ConnectionClosed => Some("ConnectionClosed"),
        RpcError::Unavailable(_) => Some("Unavailable"),
        RpcError::DeadlineExceeded => Some("DeadlineExceeded"),
        RpcError::Io(_) => Some("Io"),
        e if e.server_kind() == Some(ServerErrorKind::ShuttingDown) => Some("ShuttingDown"),
        _ => None,
    }
}

async fn caller(client: SoakClient, id: u64, o: Arc<OptsView>, stop: Instant, tally: Arc<Tally>) {
    let mut rng = Rng::new(o.seed ^ id.wrapping_mul(0x1000_0001));
    let mut i = 0u64;
    let client = SoakClient::from_client(client.client().with_timeout(o.deadline));
    while Instant::now() < stop {
        let seed = (id << 40) | i;
        i += 1;
        let req_len = rng.size(o.max_size);
        let reply_len = rng.size(o.max_size);
        let micros = if rng.next() % 4 == 0 {
            rng.range(0, 3000)
        } else {
            0
        };
        let data = Payload::from(pattern(req_len as usize, seed));
        let call = client.exchange(seed, data, reply_len, micros);
        match tokio::time::timeout(o.deadline + Duration::from_secs(5), call).await {
            Err(_) => {
                tally.hangs.fetch_add(1, Ordering::Relaxed);
                tally.bad(format!(
                    "call {seed:#x} ({req_len} B, answer {reply_len} B) hung past its deadline"
                ));
            }
            Ok(Ok(a)) => {
                let right = a.seed == seed
                    && a.request_ok
                    && a.data.len() as u64 == reply_len
                    && matches(&a.data, !seed);
                if right {
                    tally.ok.fetch_add(1, Ordering::Relaxed);
                    tally
                        .bytes
                        .fetch_add(req_len + reply_len, Ordering::Relaxed);
                } else {
                    tally.wrong.fetch_add(1, Ordering::Relaxed);
                    tally.bad(format!(
                        "call {seed:#x}: wrong answer (seed {:#x}, server saw the request {}, \
                         {} of {reply_len} bytes)",
                        a.seed,
                        if a.request_ok { "intact" } else { "CORRUPT" },
                        a.data.len()
                    ));
                }
            }
            Ok(Err(e)) => {
                match clear_failure(&e) {
                    Some(kind) => tally.fail(kind.to_owned(), &e, o.t0.elapsed().as_secs_f64()),
                    None => {
                        tally.fail(format!("UNEXPECTED {e}"), &e, o.t0.elapsed().as_secs_f64());
                        tally.bad(format!("call {seed:#x}: unexpected error: {e}"));
                    }
                }
                // Back off a little before trying again, as a real client would: a call that
                // fails at once (`Unavailable` while the server drains) never yields, and a
                // loop of them would starve the runtime's other tasks.
                tokio::time::sleep(Duration::from_millis(rng.range(5, 20))).await;
            }
        }
    }
}

/// What the callers need of the options.
struct OptsView {
    t0: Instant,
    seed: u64,
    max_size: u64,
    deadline: Duration,
}

// ---------------------------------------------------------------------------------------------

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    match rt.block_on(run(&o)) {
        Ok(()) => {
            println!("soak: OK");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("soak: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(o: &Opts) -> Result<(), String> {
    let bind: Endpoint = o.endpoint.parse().map_err(|e| format!("--endpoint: {e}"))?;
    println!(
        "soak: {} s, {} servers (up {}..{} ms, down {}..{} ms, {}% graceful), {} clients x {} \
         workers each, payloads 64 B..{} B, deadline {:?} (load average {})",
        o.secs,
        o.servers,
        o.up_ms.0,
        o.up_ms.1,
        o.down_ms.0,
        o.down_ms.1,
        o.graceful_percent,
        o.clients,
        o.workers,
        o.max_size,
        o.deadline,
        load_average()
    );
    let restarts = Arc::new(Restarts::default());
    let mut servers = Vec::new();
    let mut stops = Vec::new();
    for index in 0..o.servers {
        let (stop_tx, stop_rx) = std_mpsc::channel();
        let (ep, thread) = spawn_server(index, bind.clone(), o, restarts.clone(), stop_rx);
        servers.push((ep, thread));
        stops.push(stop_tx);
    }

    let t0 = Instant::now();
    let total = Duration::from_secs_f64(o.secs);
    let stop = t0 + total;
    let tally = Arc::new(Tally::default());
    let view = Arc::new(OptsView {
        t0,
        seed: o.seed,
        max_size: o.max_size,
        deadline: o.deadline,
    });
    let mut clients = Vec::new();
    let mut callers = Vec::new();
    for (s, (ep, _)) in servers.iter().enumerate() {
        for c in 0..o.clients {
            // The server may be between lives: connecting retries like any call would.
            let client = connect_retrying(ep).await?;
            let client = SoakClient::from_client(client);
            clients.push(client.clone());
            for w in 0..o.workers {
                let id = ((s * o.clients + c) * o.workers + w) as u64;
                callers.push(tokio::spawn(caller(
                    client.clone(),
                    id,
                    view.clone(),
                    stop,
                    tally.clone(),
                )));
            }
        }
    }

    // RSS samples every 250 ms, progress every 10 s.
    let mut samples: Vec<(f64, u64)> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    let mut last_report = Instant::now();
    while Instant::now() < stop {
        tick.tick().await;
        let t = t0.elapsed().as_secs_f64();
        samples.push((t, rss_kib()));
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            println!(
                "  {t:5.0} s: {} calls right, {} wrong, {} hung, failures {:?}, restarts {} \
                 killed + {} graceful, RSS {} KiB",
                tally.ok.load(Ordering::Relaxed),
                tally.wrong.load(Ordering::Relaxed),
                tally.hangs.load(Ordering::Relaxed),
                tally.failures.lock().unwrap(),
                restarts.killed.load(Ordering::Relaxed),
                restarts.graceful.load(Ordering::Relaxed),
                samples.last().map(|s| s.1).unwrap_or(0)
            );
        }
    }
    for c in callers {
        c.await.map_err(|e| format!("caller task: {e}"))?;
    }
    let elapsed = t0.elapsed().as_secs_f64();

    // Stop the chaos (each server stays up), then every client must work again by itself.
    for s in &stops {
        let _ = s.send(());
    }
    let mut problems = Vec::new();
    let recovered = recover(&clients, o.deadline).await;
    if let Err(e) = &recovered {
        problems.push(e.clone());
    }
    drop(stops);
    for (i, (_, thread)) in servers.into_iter().enumerate() {
        match thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => problems.push(e),
            Err(_) => problems.push(format!("server thread {i} panicked")),
        }
    }
    // The clients' side: with the servers gone and the clients dropped, every buffer of every
    // connection a client made (reconnections included) is back and every region freed.
    let client_pools: Vec<Pools> = clients
        .iter()
        .map(|c| client_pools_of(c.client()))
        .collect();
    drop(clients);
    let mut client_leaks = Vec::new();
    let mut clients_checked = 0;
    for (i, pools) in client_pools.into_iter().enumerate() {
        let left = tokio::task::spawn_blocking(move || pools_left(pools)).await;
        if let Some(leak) = left.map_err(|e| format!("pool check: {e}"))? {
            client_leaks.push(format!("client {i}: {leak}"));
        }
        clients_checked += 1;
    }

    // Memory: highest RSS over [1/4, 1/3] of the run against the highest over its last twelfth.
    let secs = total.as_secs_f64();
    let window_max = |from: f64, to: f64| {
        samples
            .iter()
            .filter(|(t, _)| *t >= from && *t <= to)
            .map(|s| s.1)
            .max()
            .unwrap_or(0)
    };
    let third = window_max(secs / 4.0, secs / 3.0);
    let end = window_max(secs * 11.0 / 12.0, secs);
    let peak = samples.iter().map(|s| s.1).max().unwrap_or(0);
    let tolerance = o.rss_tolerance_mib << 10;

    let ok = tally.ok.load(Ordering::Relaxed);
    let failures = tally.failures.lock().unwrap().clone();
    let failed: u64 = failures.values().sum();
    println!(
        "soak: {ok} calls right ({:.0}/s, {:.1} MB/s of payload), {} wrong, {} hung, {failed} \
         failed: {failures:?}",
        ok as f64 / elapsed,
        tally.bytes.load(Ordering::Relaxed) as f64 / elapsed / 1e6,
        tally.wrong.load(Ordering::Relaxed),
        tally.hangs.load(Ordering::Relaxed),
    );
    for (kind, first) in tally.first_of_kind.lock().unwrap().iter() {
        println!("soak: first {kind}: {first}");
    }
    println!(
        "soak: servers restarted {} times ({} killed, {} gracefully); clients reconnected by \
         themselves: {}",
        restarts.killed.load(Ordering::Relaxed) + restarts.graceful.load(Ordering::Relaxed),
        restarts.killed.load(Ordering::Relaxed),
        restarts.graceful.load(Ordering::Relaxed),
        if recovered.is_ok() { "all" } else { "NOT ALL" }
    );
    let checked = restarts.pools_checked.load(Ordering::Relaxed);
    if checked > 0 {
        println!(
            "soak: RDMA pools checked after {checked} server lives (killed or stopped): {} with a \
             buffer or region not returned",
            restarts.pool_leaks.lock().unwrap().len()
        );
        println!(
            "soak: RDMA pools of {clients_checked} clients checked once they were dropped: {} with \
             a buffer or region not returned",
            client_leaks.len()
        );
    }
    println!(
        "soak: RSS max over [1/4, 1/3] of the run {third} KiB, over the last twelfth {end} KiB \
         ({:+} KiB; tolerance {tolerance} KiB); peak {peak} KiB",
        end as i64 - third as i64
    );

    if let Some(first) = tally.first_bad.lock().unwrap().clone() {
        problems.push(format!("first bad call: {first}"));
    }
    if tally.wrong.load(Ordering::Relaxed) > 0 {
        problems.push(format!(
            "{} wrong answers",
            tally.wrong.load(Ordering::Relaxed)
        ));
    }
    if tally.hangs.load(Ordering::Relaxed) > 0 {
        problems.push(format!(
            "{} calls hung",
            tally.hangs.load(Ordering::Relaxed)
        ));
    }
    if tally.unexpected() > 0 {
        problems.push(format!("{} unexpected errors", tally.unexpected()));
    }
    // Servers are up most of the time: most calls must succeed.
    if ok < 10 * failed.max(1) {
        problems.push(format!(
            "only {ok} calls succeeded against {failed} failures"
        ));
    }
    let leaks = restarts.pool_leaks.lock().unwrap().clone();
    if !leaks.is_empty() {
        problems.push(format!(
            "buffers or regions of the RDMA pools not returned after {} of {} server lives: {}",
            leaks.len(),
            restarts.pools_checked.load(Ordering::Relaxed),
            leaks.join(", ")
        ));
    }
    if !client_leaks.is_empty() {
        problems.push(format!(
            "buffers or regions of the clients' RDMA pools not returned: {}",
            client_leaks.join(", ")
        ));
    }
    if restarts.killed.load(Ordering::Relaxed) == 0 {
        problems.push("no server was ever killed: the run tested nothing".into());
    }
    if third == 0 || end > third + tolerance {
        problems.push(format!(
            "RSS not flat after warm-up: {third} KiB at 1/3 of the run, {end} KiB at the end \
             (tolerance {tolerance} KiB)"
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// The first connection, retrying while the server is between lives.
async fn connect_retrying(ep: &Endpoint) -> Result<Client, String> {
    let give_up = Instant::now() + Duration::from_secs(30);
    loop {
        match Client::connect(ep).await {
            Ok(c) => return Ok(c),
            Err(_) if Instant::now() < give_up => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(format!("connect {ep}: {e}")),
        }
    }
}

/// After the last restart, each client makes a call that must succeed, reconnecting by itself.
async fn recover(clients: &[SoakClient], deadline: Duration) -> Result<(), String> {
    for (i, c) in clients.iter().enumerate() {
        let seed = u64::MAX - i as u64;
        // Calls right after a kill may still fail on the old connection; a few tries each.
        let mut last = String::new();
        let mut done = false;
        for _ in 0..5 {
            let call = SoakClient::from_client(c.client().with_timeout(deadline)).exchange(
                seed,
                Payload::from(pattern(100, seed)),
                100,
                0,
            );
            match tokio::time::timeout(deadline + Duration::from_secs(5), call).await {
                Ok(Ok(a)) if a.seed == seed && a.request_ok && matches(&a.data, !seed) => {
                    done = true;
                    break;
                }
                Ok(Ok(_)) => return Err(format!("client {i}: wrong answer after recovery")),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => return Err(format!("client {i}: call hung after recovery")),
            }
        }
        if !done {
            return Err(format!(
                "client {i} did not reconnect by itself after the last restart: {last}"
            ));
        }
    }
    Ok(())
}
