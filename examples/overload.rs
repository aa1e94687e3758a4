//! `overload`: latency of accepted calls on a server held at its concurrency limit, checked
//! against a bound derived from the configuration.
//!
//! ```text
//! cargo run --release --example overload -- [--limit 8] [--callers 80] [--connections 8]
//!     [--handler-ms 5] [--payload 4096] [--secs 5] [--warmup 1] [--calibrate 2]
//!     [--factor 1.5] [--slack-ms 10] [--attempts 3] [--deadline-ms D]
//!     [--endpoint tcp://127.0.0.1:0]
//! ```
//!
//! A server with `max_concurrent_handlers = L` (`--limit`) whose handler takes `h`
//! (`--handler-ms`, simulated with a timer) is called in a closed loop by `N` callers
//! (`--callers`, default `10 L`) spread over `--connections` client connections. At the limit
//! the server stops reading the connection whose request found no free slot, so callers wait
//! (the server sends no "overloaded" error); with `--deadline-ms` callers give up after that
//! long and count as refused with `DeadlineExceeded`.
//!
//! The bound. Saturated, the server completes `L / h` calls a second; by Little's law a caller
//! in a closed loop of `N` then spends `W = N h / L` per call, most of it queued, and with a
//! fair (FIFO) queue nearly every call takes about `W`. What one call really takes here (a
//! 5 ms timer sleeps about 6 ms; a shared machine adds its own stalls) is measured first:
//! `L` callers for `--calibrate` seconds keep the server busy without a queue, and their p99
//! is `h_obs`. The run fails unless p99 under overload is at most
//! `factor * N * h_obs / L + slack` (defaults 1.5 and 10 ms), every answer is right, no call
//! failed other than by its own deadline, and no more than `L` handlers ever ran at once.
//! Correctness must hold in every attempt; the latency bound in one of `--attempts` (default
//! 3), so that one burst of unrelated load does not fail the run while a real regression
//! (every attempt over) does. It prints the calibration, p50/p90/p99/max, `W` from the
//! configuration and from `h_obs`, the bound, throughput against `L / h`, and RSS.
//!
//! Measured with the defaults on 2 shared cores: `h_obs` about 6.5 ms, bound about 107 ms,
//! p99 66-76 ms (1.3-1.5 `W`). Before the server wrote finished answers while a connection
//! waited for a handler slot, p99 was 113 ms (2.3 `W`, bimodal at `W` and `2W`): at the edge
//! of this bound, which is set for robustness on shared machines; that regression is caught
//! exactly, without timing, by `tests/load_saturated_answers.rs`.
//!
//! `scripts/test.sh` runs it with the defaults (about 9 s an attempt).

mod common;

use common::{load_average, rss_kib};
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc::{rdma_service, Client, Config, Endpoint, Payload, RpcError, Server};

/// The call measured.
#[rdma_service]
pub trait Busy {
    /// Sleeps `micros`, then answers `key` and `data` with every byte xored with `key`.
    async fn work(&self, key: u64, micros: u64, data: Payload) -> (u64, Payload);
}

#[derive(Default)]
struct BusyImpl {
    running: AtomicUsize,
    max_running: AtomicUsize,
}

struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Busy for Arc<BusyImpl> {
    async fn work(&self, key: u64, micros: u64, data: Payload) -> (u64, Payload) {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_running.fetch_max(now, Ordering::SeqCst);
        let _running = Running(&self.running);
        tokio::time::sleep(Duration::from_micros(micros)).await;
        let k = key as u8;
        (
            key,
            Payload::from(data.iter().map(|b| b ^ k).collect::<Vec<u8>>()),
        )
    }
}

struct Opts {
    limit: usize,
    callers: usize,
    connections: usize,
    handler: Duration,
    payload: usize,
    secs: f64,
    warmup: f64,
    calibrate: f64,
    factor: f64,
    slack: Duration,
    attempts: usize,
    deadline: Option<Duration>,
    endpoint: String,
}

const USAGE: &str = "overload [--limit 8] [--callers 80] [--connections 8] [--handler-ms 5] \
[--payload 4096] [--secs 5] [--warmup 1] [--calibrate 2] [--factor 1.5] [--slack-ms 10] \
[--attempts 3] [--deadline-ms D] [--endpoint tcp://127.0.0.1:0]";

fn parse_args() -> Result<Opts, String> {
    let mut kv = HashMap::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--help" || a == "-h" {
            return Err(USAGE.to_owned());
        }
        let Some(flag) = a.strip_prefix("--") else {
            return Err(format!("unexpected argument {a:?}\nusage: {USAGE}"));
        };
        let (k, v) = match flag.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => {
                let v = args
                    .next()
                    .ok_or_else(|| format!("--{flag} needs a value"))?;
                (flag.to_owned(), v)
            }
        };
        kv.insert(k, v);
    }
    fn num<T: std::str::FromStr>(
        kv: &mut HashMap<String, String>,
        k: &str,
        default: T,
    ) -> Result<T, String> {
        match kv.remove(k) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("--{k}: not a valid number: {v:?}")),
        }
    }
    let limit: usize = num(&mut kv, "limit", 8)?;
    let o = Opts {
        limit,
        callers: num(&mut kv, "callers", 10 * limit)?,
        connections: num(&mut kv, "connections", 8)?,
        handler: Duration::from_secs_f64(num::<f64>(&mut kv, "handler-ms", 5.0)? / 1e3),
        payload: num(&mut kv, "payload", 4096)?,
        secs: num(&mut kv, "secs", 5.0)?,
        warmup: num(&mut kv, "warmup", 1.0)?,
        calibrate: num(&mut kv, "calibrate", 2.0)?,
        factor: num(&mut kv, "factor", 1.5)?,
        slack: Duration::from_secs_f64(num::<f64>(&mut kv, "slack-ms", 10.0)? / 1e3),
        attempts: num(&mut kv, "attempts", 3)?,
        deadline: match kv.remove("deadline-ms") {
            None => None,
            Some(v) => Some(Duration::from_millis(
                v.parse().map_err(|_| format!("--deadline-ms: {v:?}"))?,
            )),
        },
        endpoint: kv
            .remove("endpoint")
            .unwrap_or_else(|| "tcp://127.0.0.1:0".to_owned()),
    };
    if let Some(k) = kv.keys().next() {
        return Err(format!("unknown option --{k}\nusage: {USAGE}"));
    }
    if o.limit == 0 || o.callers == 0 || o.connections == 0 || o.secs <= 0.0 || o.attempts == 0 {
        return Err(
            "--limit, --callers, --connections, --secs and --attempts must be positive".into(),
        );
    }
    Ok(o)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    refused: AtomicU64,
    wrong: AtomicU64,
    failed: AtomicU64,
}

fn main() -> ExitCode {
    let opts = match parse_args() {
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
    for attempt in 1..=opts.attempts {
        match rt.block_on(run(&opts)) {
            Ok(true) => {
                println!("overload: OK (p99 within the bound, attempt {attempt})");
                return ExitCode::SUCCESS;
            }
            Ok(false) if attempt < opts.attempts => {
                println!("overload: p99 over the bound in attempt {attempt}; again");
            }
            Ok(false) => {
                eprintln!(
                    "overload: FAILED: p99 over the bound in all {} attempts",
                    opts.attempts
                );
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("overload: FAILED: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    unreachable!("at least one attempt")
}

/// One measurement: `Err` if something was wrong, else whether p99 met the bound.
async fn run(o: &Opts) -> Result<bool, String> {
    let bind: Endpoint = o.endpoint.parse().map_err(|e| format!("--endpoint: {e}"))?;
    let mut config = Config::default();
    config.max_concurrent_handlers = o.limit;
    let server = Server::bind_with(&bind, config)
        .await
        .map_err(|e| format!("bind: {e}"))?;
    let ep = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let imp = Arc::new(BusyImpl::default());
    let serving = tokio::spawn(server.serve(BusyServer::new(imp.clone())));

    let mut clients = Vec::new();
    for _ in 0..o.connections {
        let c = Client::connect(&ep)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        clients.push(c);
    }
    let rss_start = rss_kib();
    println!(
        "overload: limit L={} handlers, N={} callers on {} connections, handler h={:?}, \
         payload {} B each way, {} s after {} s warm-up (load average {})",
        o.limit,
        o.callers,
        o.connections,
        o.handler,
        o.payload,
        o.secs,
        o.warmup,
        load_average()
    );

    // Calibration: L callers keep the server busy without queueing; their p99 is what one call
    // costs on this machine now (timer granularity and scheduling included).
    let tally = Arc::new(Tally::default());
    let first_error = Arc::new(Mutex::new(None::<String>));
    let base = drive(&clients, o.limit, o, 0.3, o.calibrate, &tally, &first_error).await?;
    let base_calls = tally.ok.swap(0, Ordering::Relaxed);
    let h_obs = Duration::from_micros(base.value_at_quantile(0.99));
    // Overload: N callers.
    let hist = drive(
        &clients,
        o.callers,
        o,
        o.warmup,
        o.secs,
        &tally,
        &first_error,
    )
    .await?;
    let rss_end = rss_kib();
    shutdown.shutdown();
    let _ = tokio::time::timeout(Duration::from_secs(30), serving).await;

    let queue = o.callers as f64 / o.limit as f64;
    let wait = o.handler.mul_f64(queue);
    let wait_obs = h_obs.mul_f64(queue);
    let bound = wait_obs.mul_f64(o.factor) + o.slack;
    let ms = |us: u64| us as f64 / 1e3;
    let ok = tally.ok.load(Ordering::Relaxed);
    let max_running = imp.max_running.load(Ordering::SeqCst);
    println!(
        "calibration, {} callers (no queue): {base_calls} calls, p50 {:.2} ms, p99 {:.2} ms = h_obs",
        o.limit,
        ms(base.value_at_quantile(0.50)),
        ms(base.value_at_quantile(0.99)),
    );
    println!(
        "accepted calls under overload: {ok} in {:.1} s = {:.0}/s (saturated ideal L/h = {:.0}/s)",
        o.secs,
        ok as f64 / o.secs,
        o.limit as f64 / o.handler.as_secs_f64()
    );
    println!(
        "latency ms: p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}",
        ms(hist.value_at_quantile(0.50)),
        ms(hist.value_at_quantile(0.90)),
        ms(hist.value_at_quantile(0.99)),
        ms(hist.max())
    );
    let p99 = Duration::from_micros(hist.value_at_quantile(0.99));
    println!(
        "expected wait W = N*h/L = {:.2} ms (configured h), N*h_obs/L = {:.2} ms; bound on p99 = \
         {} * N*h_obs/L + {:?} = {:.2} ms; p99 = {:.2} W = {:.2} of the bound",
        wait.as_secs_f64() * 1e3,
        wait_obs.as_secs_f64() * 1e3,
        o.factor,
        o.slack,
        bound.as_secs_f64() * 1e3,
        p99.as_secs_f64() / wait.as_secs_f64(),
        p99.as_secs_f64() / bound.as_secs_f64()
    );
    println!(
        "refused by deadline: {}; other errors: {}; wrong answers: {}; most handlers at once: \
         {max_running} (limit {}); RSS {} KiB at start, {} KiB at end",
        tally.refused.load(Ordering::Relaxed),
        tally.failed.load(Ordering::Relaxed),
        tally.wrong.load(Ordering::Relaxed),
        o.limit,
        rss_start,
        rss_end
    );

    let mut problems = Vec::new();
    if tally.wrong.load(Ordering::Relaxed) > 0 {
        problems.push("wrong answers".to_owned());
    }
    if tally.failed.load(Ordering::Relaxed) > 0 {
        let e = first_error.lock().unwrap().clone().unwrap_or_default();
        problems.push(format!("calls failed other than by deadline (first: {e})"));
    }
    if o.deadline.is_none() && tally.refused.load(Ordering::Relaxed) > 0 {
        problems.push("calls without a deadline were refused".into());
    }
    if max_running > o.limit {
        problems.push(format!("{max_running} handlers ran at once"));
    }
    if ok == 0 || base_calls == 0 {
        problems.push("no call was accepted".into());
    }
    if problems.is_empty() {
        Ok(p99 <= bound)
    } else {
        Err(problems.join("; "))
    }
}

/// `callers` tasks over `clients` in a closed loop for `warmup + secs` seconds; returns the
/// latency histogram (µs) of the calls started after the warm-up. Answers are checked into
/// `tally`.
async fn drive(
    clients: &[Client],
    callers: usize,
    o: &Opts,
    warmup: f64,
    secs: f64,
    tally: &Arc<Tally>,
    first_error: &Arc<Mutex<Option<String>>>,
) -> Result<Histogram<u64>, String> {
    let t0 = Instant::now();
    let measure_from = t0 + Duration::from_secs_f64(warmup);
    let stop = measure_from + Duration::from_secs_f64(secs);
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let client = clients[caller % clients.len()].clone();
            let client = BusyClient::from_client(match o.deadline {
                Some(d) => client.with_timeout(d),
                None => client,
            });
            let (tally, first_error) = (tally.clone(), first_error.clone());
            let (payload, micros) = (o.payload, o.handler.as_micros() as u64);
            tokio::spawn(async move {
                // Latencies in µs (a histogram each would cost 80 x 300 KiB of RSS).
                let mut local = Vec::<u64>::new();
                let mut i = 0u64;
                while Instant::now() < stop {
                    let key = ((caller as u64) << 32) | i;
                    i += 1;
                    let data = pattern(payload, key);
                    let start = Instant::now();
                    let r = client.work(key, micros, data.clone().into()).await;
                    let took = start.elapsed();
                    match r {
                        Ok((k, back)) => {
                            let want: Vec<u8> = data.iter().map(|b| b ^ key as u8).collect();
                            if k != key || back != want {
                                tally.wrong.fetch_add(1, Ordering::Relaxed);
                            } else if start >= measure_from {
                                tally.ok.fetch_add(1, Ordering::Relaxed);
                                local.push(took.as_micros() as u64);
                            }
                        }
                        Err(RpcError::DeadlineExceeded) => {
                            tally.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            tally.failed.fetch_add(1, Ordering::Relaxed);
                            first_error.lock().unwrap().get_or_insert(e.to_string());
                        }
                    }
                }
                local
            })
        })
        .collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("histogram");
    for t in tasks {
        for us in t.await.map_err(|e| format!("caller task: {e}"))? {
            hist.saturating_record(us.max(1));
        }
    }
    Ok(hist)
}
