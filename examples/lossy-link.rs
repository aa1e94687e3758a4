//! Calls over a slow, lossy link (issue 5): every call completes with the right bytes, or
//! fails as its deadline says, or fails with a clear error; none hangs, none returns corrupted
//! data.
//!
//! The server (`--serve`) offers one method, `exchange(seed, data, reply_len)`: it checks that
//! `data` is exactly the byte pattern of `seed` and answers with `reply_len` bytes of the
//! pattern of another seed derived from it. The driver (`--connect`) runs concurrent callers
//! for `--duration` seconds; each call has a fresh seed (so a reply that belongs to another
//! call cannot pass the check), request and reply sizes drawn independently from 0 B to 4 MiB
//! (around the eager threshold too), and a deadline: most calls get a generous one
//! (`--deadline-ms` plus the time their bytes take at `--deadline-rate` MB/s), one in ten a
//! tight one (1 ms to `--tight-ms`), below the link's round trip, so that deadlines are hit.
//!
//! Each call ends in one of:
//! - `ok`: the answer came and both directions' bytes are exact;
//! - `deadline`: `RpcError::DeadlineExceeded`;
//! - `connection`: `ConnectionClosed`, `Unavailable` or `Io` (the link dropped the connection;
//!   the next call reconnects);
//! - `wrong`: an answer with wrong bytes or length, in either direction (must be 0);
//! - `other`: `Codec`, `Server`, `Protocol`, `TooLarge` errors (must be 0: over this link they
//!   would mean damaged frames got through);
//! - `late`: any outcome that came more than `--margin-ms` after the call's deadline (must
//!   be 0);
//! - `hung`: no outcome `--hang-ms` after the deadline; the call is dropped (must be 0).
//!
//! A watchdog thread outside the async runtime ends the process with status 3 if the whole
//! run overstays its bound. The last line is machine-readable:
//! `LOSSY-SUMMARY endpoint=… calls=… ok=… deadline=… connection=… other=… wrong=… late=… hung=… result=PASS|FAIL`.
//! The exit status is 0 only if `wrong`, `other`, `late` and `hung` are 0 and at least one
//! call was `ok`.
//!
//! `scripts/lossy-link-test.sh` runs it in the project's QEMU guest across a veth pair with
//! `tc netem` delay, loss, duplication, reordering and corruption, over TCP, soft-iWARP and
//! Soft-RoCE.
//!
//! # Running
//! ```text
//! cargo run --release --example lossy-link -- --serve --endpoint tcp://0.0.0.0:7600
//! cargo run --release --example lossy-link -- --connect --endpoint tcp://127.0.0.1:7600 --duration 10
//! cargo run --release --example lossy-link                     # both in one process, loopback
//! cargo run --release --example lossy-link -- --help
//! ```

#[path = "common/log.rs"]
mod log;

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_rpc::{rdma_service, Endpoint, Payload, RpcError, Server};
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// The service
// ---------------------------------------------------------------------------------------------

/// Largest reply the server makes.
const MAX_REPLY: u64 = 64 << 20;

/// What the server found and what it sends back.
#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    /// Length of the request's payload as received.
    request_len: u64,
    /// Offset of the first byte of the request's payload that differs from the pattern.
    request_mismatch: Option<u64>,
    /// `reply_len` bytes of the pattern of [`reply_seed`]`(seed)`.
    data: Payload,
}

/// Checks bytes both ways.
#[rdma_service]
trait Lossy {
    /// Checks `data` against the pattern of `seed`; answers with `reply_len` bytes of the
    /// pattern of `reply_seed(seed)` (at most 64 MiB).
    async fn exchange(&self, seed: u64, data: Payload, reply_len: u64) -> Answer;
}

/// Counts what the server saw.
#[derive(Default)]
struct Checker {
    calls: AtomicU64,
    bad_requests: AtomicU64,
}

impl Lossy for Arc<Checker> {
    async fn exchange(&self, seed: u64, data: Payload, reply_len: u64) -> Answer {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let request_mismatch = first_mismatch(seed, &data).map(|i| i as u64);
        if let Some(at) = request_mismatch {
            self.bad_requests.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "lossy-link server: BAD REQUEST seed {seed:#x}, {} bytes, first wrong byte at {at}",
                data.len()
            );
        }
        let mut reply = vec![0u8; reply_len.min(MAX_REPLY) as usize];
        fill(reply_seed(seed), &mut reply);
        Answer {
            request_len: data.len() as u64,
            request_mismatch,
            data: reply.into(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Byte patterns and randomness
// ---------------------------------------------------------------------------------------------

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `i`-th 8 bytes of the pattern of `seed`.
fn word(seed: u64, i: u64) -> [u8; 8] {
    mix(seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes()
}

/// The seed of the reply to a call with `seed`.
fn reply_seed(seed: u64) -> u64 {
    mix(seed ^ 0x5eed_5eed_5eed_5eed)
}

/// Fills `buf` with the pattern of `seed`.
fn fill(seed: u64, buf: &mut [u8]) {
    let mut chunks = buf.chunks_exact_mut(8);
    let mut i = 0;
    for c in &mut chunks {
        c.copy_from_slice(&word(seed, i));
        i += 1;
    }
    let rest = chunks.into_remainder();
    let n = rest.len();
    rest.copy_from_slice(&word(seed, i)[..n]);
}

/// Where `buf` first differs from the pattern of `seed`, if anywhere.
fn first_mismatch(seed: u64, buf: &[u8]) -> Option<usize> {
    buf.chunks(8).enumerate().find_map(|(i, c)| {
        let w = word(seed, i as u64);
        c.iter()
            .zip(w)
            .position(|(a, b)| *a != b)
            .map(|j| i * 8 + j)
    })
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// A payload size: mostly small, some around the eager threshold (8 KiB), a tenth
    /// 256 KiB..1 MiB, 3 % up to 4 MiB.
    fn size(&mut self) -> u64 {
        match self.next() % 100 {
            0..=29 => self.range(0, 64),
            30..=49 => self.range(65, 7 * 1024),
            50..=59 => self.range(8 * 1024 - 160, 8 * 1024 + 160),
            60..=86 => self.range(8 * 1024, 256 * 1024),
            87..=96 => self.range(256 * 1024, 1 << 20),
            _ => self.range(1 << 20, 4 << 20),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------------

/// How the driver runs.
#[derive(Debug, Clone)]
struct Drive {
    duration: Duration,
    concurrency: usize,
    max_calls: u64,
    /// Generous deadline: this plus the bytes' time at `deadline_rate`.
    deadline_base: Duration,
    /// Bytes per second assumed for the generous deadlines.
    deadline_rate: f64,
    /// Longest generous deadline.
    deadline_max: Duration,
    /// Tight deadlines are 1 ms ..= this.
    tight: Duration,
    /// Per mille of calls with a tight deadline.
    tight_permille: u64,
    /// An outcome later than deadline + margin is `late`.
    margin: Duration,
    /// No outcome by deadline + hang: `hung`.
    hang: Duration,
    seed: u64,
}

/// The outcome classes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Deadline,
    Connection,
    Other,
    Wrong,
    Hung,
}

/// What the callers saw.
#[derive(Debug, Default)]
struct Tally {
    calls: u64,
    ok: u64,
    deadline: u64,
    connection: u64,
    other: u64,
    wrong: u64,
    late: u64,
    hung: u64,
    tight_calls: u64,
    tight_ok: u64,
    bytes_ok: u64,
    /// Latencies of `ok` calls.
    ok_latency: Vec<Duration>,
    /// Latencies of `ok` calls with a payload of 1 MiB or more either way.
    ok_large_latency: Vec<Duration>,
    /// How long after its deadline each `deadline` outcome came (0 if before).
    deadline_overshoot: Vec<Duration>,
    /// The largest time past the deadline of any outcome.
    max_past_deadline: Duration,
    /// The first few non-deadline failures, described.
    notes: Vec<String>,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.calls += o.calls;
        self.ok += o.ok;
        self.deadline += o.deadline;
        self.connection += o.connection;
        self.other += o.other;
        self.wrong += o.wrong;
        self.late += o.late;
        self.hung += o.hung;
        self.tight_calls += o.tight_calls;
        self.tight_ok += o.tight_ok;
        self.bytes_ok += o.bytes_ok;
        self.ok_latency.extend(o.ok_latency);
        self.ok_large_latency.extend(o.ok_large_latency);
        self.deadline_overshoot.extend(o.deadline_overshoot);
        self.max_past_deadline = self.max_past_deadline.max(o.max_past_deadline);
        for n in o.notes {
            if self.notes.len() < 20 {
                self.notes.push(n);
            }
        }
    }

    fn note(&mut self, s: String) {
        eprintln!("lossy-link: {s}");
        if self.notes.len() < 20 {
            self.notes.push(s);
        }
    }

    fn passed(&self) -> bool {
        self.wrong == 0 && self.other == 0 && self.late == 0 && self.hung == 0 && self.ok > 0
    }
}

/// One caller: calls until the time or the call budget is used up.
async fn caller(
    id: u64,
    client: LossyClient,
    drive: Drive,
    end: Instant,
    issued: Arc<AtomicU64>,
) -> Tally {
    let mut rng = Rng(mix(drive.seed ^ id.wrapping_mul(0xa076_1d64_78bd_642f)));
    let mut t = Tally::default();
    while Instant::now() < end && issued.fetch_add(1, Ordering::Relaxed) < drive.max_calls {
        let seed = rng.next();
        let req_len = rng.size();
        let reply_len = rng.size();
        let tight = rng.next() % 1000 < drive.tight_permille;
        let deadline = if tight {
            Duration::from_millis(rng.range(1, drive.tight.as_millis().max(1) as u64))
        } else {
            (drive.deadline_base
                + Duration::from_secs_f64((req_len + reply_len) as f64 / drive.deadline_rate))
            .min(drive.deadline_max)
        };
        let mut data = vec![0u8; req_len as usize];
        fill(seed, &mut data);

        t.calls += 1;
        t.tight_calls += tight as u64;
        let started = Instant::now();
        let call = client
            .with_timeout(deadline)
            .exchange(seed, data.into(), reply_len);
        let result = tokio::time::timeout(deadline + drive.hang, call).await;
        let took = started.elapsed();
        let what = format!(
            "call {seed:#018x} ({req_len} B out, {reply_len} B back, deadline {deadline:?})"
        );
        let outcome = match result {
            Err(_) => {
                t.note(format!("HUNG: {what}: no outcome after {took:?}; dropped"));
                Outcome::Hung
            }
            Ok(Ok(a)) => {
                let mut bad = Vec::new();
                if a.request_len != req_len {
                    bad.push(format!("server got {} request bytes", a.request_len));
                }
                if let Some(at) = a.request_mismatch {
                    bad.push(format!("server found a wrong request byte at {at}"));
                }
                if a.data.len() as u64 != reply_len {
                    bad.push(format!("reply has {} bytes", a.data.len()));
                } else if let Some(at) = first_mismatch(reply_seed(seed), &a.data) {
                    bad.push(format!("reply byte {at} is wrong"));
                }
                if bad.is_empty() {
                    Outcome::Ok
                } else {
                    t.note(format!("WRONG DATA: {what}: {}", bad.join("; ")));
                    Outcome::Wrong
                }
            }
            Ok(Err(RpcError::DeadlineExceeded)) => Outcome::Deadline,
            Ok(Err(
                e @ (RpcError::ConnectionClosed | RpcError::Unavailable(_) | RpcError::Io(_)),
            )) => {
                t.note(format!("connection error after {took:?}: {what}: {e}"));
                Outcome::Connection
            }
            Ok(Err(e)) => {
                t.note(format!("OTHER ERROR after {took:?}: {what}: {e}"));
                Outcome::Other
            }
        };
        let past = took.saturating_sub(deadline);
        t.max_past_deadline = t.max_past_deadline.max(past);
        if outcome != Outcome::Hung && past > drive.margin {
            t.late += 1;
            t.note(format!(
                "LATE: {what}: outcome {outcome:?} after {took:?}, {past:?} past the deadline"
            ));
        }
        match outcome {
            Outcome::Ok => {
                t.ok += 1;
                t.tight_ok += tight as u64;
                t.bytes_ok += req_len + reply_len;
                t.ok_latency.push(took);
                if req_len.max(reply_len) >= 1 << 20 {
                    t.ok_large_latency.push(took);
                }
            }
            Outcome::Deadline => {
                t.deadline += 1;
                t.deadline_overshoot.push(past);
            }
            Outcome::Connection => t.connection += 1,
            Outcome::Other => t.other += 1,
            Outcome::Wrong => t.wrong += 1,
            Outcome::Hung => t.hung += 1,
        }
    }
    t
}

/// Percentile `p` (0..=100) of sorted `v`.
fn pct(v: &[Duration], p: usize) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v[((v.len() - 1) * p) / 100]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// Runs the driver against `endpoint`; returns whether it passed.
async fn drive(endpoint: Endpoint, drive: Drive) -> Result<bool, RpcError> {
    println!(
        "lossy-link: driving {endpoint} for {:?}, {} callers, deadlines {:?} + bytes at {:.2} MB/s \
         (at most {:?}), {}‰ tight (1 ms..={:?}), margin {:?}",
        drive.duration,
        drive.concurrency,
        drive.deadline_base,
        drive.deadline_rate / 1e6,
        drive.deadline_max,
        drive.tight_permille,
        drive.tight,
        drive.margin
    );
    let connecting = Instant::now();
    let client = LossyClient::connect(&endpoint).await?;
    println!("lossy-link: connected in {:?}", connecting.elapsed());

    let started = Instant::now();
    let end = started + drive.duration;
    let issued = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..drive.concurrency as u64)
        .map(|id| {
            tokio::spawn(caller(
                id,
                client.clone(),
                drive.clone(),
                end,
                issued.clone(),
            ))
        })
        .collect();
    let mut t = Tally::default();
    for task in tasks {
        match task.await {
            Ok(part) => t.merge(part),
            Err(e) => {
                t.other += 1;
                t.note(format!("a caller task failed: {e}"));
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    t.ok_latency.sort();
    t.ok_large_latency.sort();
    t.deadline_overshoot.sort();

    println!(
        "lossy-link: {} calls in {secs:.1} s: {} ok, {} deadline exceeded, {} connection errors, \
         {} other errors, {} wrong data, {} late, {} hung",
        t.calls, t.ok, t.deadline, t.connection, t.other, t.wrong, t.late, t.hung
    );
    println!(
        "lossy-link: tight deadlines: {} calls, {} of them ok; checked {:.1} MB in ok calls ({:.2} MB/s)",
        t.tight_calls,
        t.tight_ok,
        t.bytes_ok as f64 / 1e6,
        t.bytes_ok as f64 / 1e6 / secs
    );
    println!(
        "lossy-link: ok latency p50 {}, p99 {}, max {}; with >= 1 MiB: {} calls, p50 {}, max {}",
        ms(pct(&t.ok_latency, 50)),
        ms(pct(&t.ok_latency, 99)),
        ms(t.ok_latency.last().copied().unwrap_or_default()),
        t.ok_large_latency.len(),
        ms(pct(&t.ok_large_latency, 50)),
        ms(t.ok_large_latency.last().copied().unwrap_or_default()),
    );
    println!(
        "lossy-link: deadline exceeded came after the deadline by p50 {}, max {}; \
         largest time past any deadline {} (allowed {})",
        ms(pct(&t.deadline_overshoot, 50)),
        ms(t.deadline_overshoot.last().copied().unwrap_or_default()),
        ms(t.max_past_deadline),
        ms(drive.margin),
    );
    for n in &t.notes {
        println!("lossy-link:   {n}");
    }
    let passed = t.passed();
    println!(
        "LOSSY-SUMMARY endpoint={endpoint} calls={} ok={} deadline={} connection={} other={} \
         wrong={} late={} hung={} secs={secs:.1} result={}",
        t.calls,
        t.ok,
        t.deadline,
        t.connection,
        t.other,
        t.wrong,
        t.late,
        t.hung,
        if passed { "PASS" } else { "FAIL" }
    );
    Ok(passed)
}

// ---------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------

/// Serves until SIGTERM or Ctrl-C, then prints what it saw.
async fn serve(endpoint: Endpoint) -> Result<bool, RpcError> {
    let server = Server::bind(&endpoint).await?;
    let checker = Arc::new(Checker::default());
    // The line scripts wait for.
    println!("lossy-link: serving on {}", server.local_endpoint());
    let serving = tokio::spawn(server.serve(LossyServer::new(checker.clone())));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(RpcError::Io)?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
        r = serving => {
            println!("lossy-link: server stopped: {r:?}");
            return Ok(false);
        }
    }
    let bad = checker.bad_requests.load(Ordering::Relaxed);
    println!(
        "LOSSY-SERVER calls={} bad_requests={bad}",
        checker.calls.load(Ordering::Relaxed)
    );
    Ok(bad == 0)
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

const USAGE: &str = "\
lossy-link: calls over a slow, lossy link complete right, or fail by their deadline, or fail
clearly; never hang, never return wrong bytes

USAGE:
    lossy-link [--serve | --connect] [OPTIONS]

With neither --serve nor --connect, runs the server and the driver in this process.

OPTIONS:
    --serve               run only the server, until SIGTERM or Ctrl-C
    --connect             run only the driver, against a server at --endpoint
    --endpoint URL        tcp://HOST:PORT or rdma://HOST:PORT[?device=NAME]
                          (default: $RDMA_RPC_ENDPOINT, else tcp://127.0.0.1:0 in one process
                          and tcp://127.0.0.1:7600 with --serve or --connect)
    --duration SECS       how long new calls start (default 10)
    --concurrency N       concurrent callers on the one connection (default 8)
    --calls N             at most N calls (default unlimited)
    --deadline-ms MS      generous deadline: MS plus the bytes' time at --deadline-rate
                          (default 2000)
    --deadline-rate MB/S  (default 0.5)
    --deadline-max-ms MS  longest generous deadline (default 20000)
    --tight-ms MS         tight deadlines are 1..=MS ms (default 30)
    --tight-permille N    calls per thousand with a tight deadline (default 100)
    --margin-ms MS        an outcome more than MS after the deadline is late (default 1000)
    --hang-ms MS          no outcome MS after the deadline: hung, dropped (default 10000)
    --seed N              workload seed (default: from the clock)
    -h, --help            print this help

The last line is LOSSY-SUMMARY ... result=PASS|FAIL; the exit status is 0 on PASS, 1 on FAIL,
2 on bad arguments, 3 if the watchdog ended a run that overstayed its bound.
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Both,
    Serve,
    Connect,
}

fn parse_args(
    mut args: impl Iterator<Item = String>,
) -> Result<Option<(Mode, Endpoint, Drive)>, String> {
    let mut mode = Mode::Both;
    let mut endpoint = None;
    let mut d = Drive {
        duration: Duration::from_secs(10),
        concurrency: 8,
        max_calls: u64::MAX,
        deadline_base: Duration::from_millis(2000),
        deadline_rate: 0.5e6,
        deadline_max: Duration::from_millis(20_000),
        tight: Duration::from_millis(30),
        tight_permille: 100,
        margin: Duration::from_millis(1000),
        hang: Duration::from_millis(10_000),
        seed: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
    };
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg, None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let num = |v: String| -> Result<f64, String> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| format!("{flag}: {v:?} is not a non-negative number"))
        };
        let millis = |v: String| num(v).map(|x| Duration::from_secs_f64(x / 1e3));
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--serve" | "--connect" => {
                let wanted = if flag == "--serve" {
                    Mode::Serve
                } else {
                    Mode::Connect
                };
                if mode != Mode::Both && mode != wanted {
                    return Err("--serve and --connect exclude each other".into());
                }
                mode = wanted;
            }
            "--endpoint" => endpoint = Some(value()?),
            "--duration" => d.duration = Duration::from_secs_f64(num(value()?)?),
            "--concurrency" => d.concurrency = (num(value()?)? as usize).max(1),
            "--calls" => d.max_calls = num(value()?)? as u64,
            "--deadline-ms" => d.deadline_base = millis(value()?)?,
            "--deadline-rate" => d.deadline_rate = (num(value()?)? * 1e6).max(1.0),
            "--deadline-max-ms" => d.deadline_max = millis(value()?)?,
            "--tight-ms" => d.tight = millis(value()?)?,
            "--tight-permille" => d.tight_permille = (num(value()?)? as u64).min(1000),
            "--margin-ms" => d.margin = millis(value()?)?,
            "--hang-ms" => d.hang = millis(value()?)?,
            "--seed" => d.seed = num(value()?)? as u64,
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    let endpoint = endpoint
        .or_else(|| std::env::var("RDMA_RPC_ENDPOINT").ok())
        .unwrap_or_else(|| match mode {
            Mode::Both => "tcp://127.0.0.1:0".to_owned(),
            Mode::Serve | Mode::Connect => "tcp://127.0.0.1:7600".to_owned(),
        });
    let endpoint = endpoint.parse().map_err(|e| format!("{e}"))?;
    Ok(Some((mode, endpoint, d)))
}

/// Ends the process if the run overstays `bound`, whatever the async runtime is doing.
fn watchdog(bound: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(bound);
        println!("LOSSY-SUMMARY result=FAIL watchdog: the run did not end within {bound:?}");
        std::process::exit(3);
    });
}

#[tokio::main]
async fn main() -> ExitCode {
    let (mode, endpoint, d) = match parse_args(std::env::args().skip(1)) {
        Ok(Some(x)) => x,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("lossy-link: {e}\n(see --help)");
            return ExitCode::from(2);
        }
    };
    // The library's warnings (why a connection closed, ...) on stderr; RUST_LOG overrides.
    log::warnings_to_stderr();
    let bound = Duration::from_secs(60) + d.duration + d.deadline_max.max(d.tight) + d.hang;
    let result = match mode {
        Mode::Serve => serve(endpoint).await,
        Mode::Connect => {
            watchdog(bound);
            drive(endpoint, d).await
        }
        Mode::Both => {
            watchdog(bound);
            async {
                let server = Server::bind(&endpoint).await?;
                let ep = server.local_endpoint();
                tokio::spawn(server.serve(LossyServer::new(Arc::new(Checker::default()))));
                drive(ep, d).await
            }
            .await
        }
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            println!("LOSSY-SUMMARY result=FAIL error: {e}");
            ExitCode::FAILURE
        }
    }
}
