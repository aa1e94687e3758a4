//! `rpc-perf`: latency and bandwidth of rdma-rpc calls by payload size, in the spirit of
//! perftest's `ib_send_lat` / `ib_write_bw`.
//!
//! ```text
//! cargo run --release --example rpc-perf -- [--server | --client] [--endpoint URL]
//!     [--op put|get|echo|ping] [--sizes 0,64,4k,1m,16m] [--concurrency N] [--connections N]
//!     [--duration SECS] [--warmup SECS] [--threads N] [--runtime multi|current] [--heap]
//!     [--json FILE] [--svg FILE]
//! ```
//!
//! - Both sides in one process by default (`--endpoint`, default `tcp://127.0.0.1:0`).
//! - `--server`: serve on `--endpoint` (default `tcp://0.0.0.0:18515`) until killed.
//! - `--client`: measure against a server at `--endpoint` (default `tcp://127.0.0.1:18515`).
//! - `--threads N`: worker threads of tokio's multi-thread runtime (default 2);
//!   `--runtime current` runs everything on one thread instead (tokio's current-thread
//!   runtime: no cross-thread wake-ups and none of the multi-thread scheduler's bookkeeping,
//!   like a thread-per-core service; `--threads` is then ignored).
//! - `rdma://HOST:PORT?device=NAME` endpoints need `--features rdma` and a device; without
//!   them the run stops with the transport's reason.
//!
//! For each size, `--concurrency` tasks (spread over `--connections` connections) call in a
//! closed loop for `--duration` seconds after `--warmup`; every call's round trip goes into a
//! histogram. `put` sends the payload and gets its length back, `get` asks for it and
//! receives it, `echo` does both (its GB/s counts both directions); `ping` sends a `u64` and
//! gets it back, a small call with no payload at all (`--sizes` only labels it). The client sends from a
//! buffer its connection lends (`Client::payload_mut`: over RDMA a registered buffer, which the
//! server reads without a copy on our side); `--heap` sends from heap memory instead, which
//! the RDMA transport copies into registered memory for each call.
//!
//! Prints per size: p50/p99/p99.9 round trip, calls/s and GB/s (1 GB = 1e9 bytes);
//! `--json FILE` writes the same numbers, `--svg FILE` draws latency and bandwidth by size.

#[path = "common/log.rs"]
mod log;

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rdma_rpc::{rdma_service, Endpoint, Payload, RpcError, Server};

/// The calls measured.
#[rdma_service]
pub trait Perf {
    /// Length of what came.
    async fn put(&self, data: Payload) -> u64;
    /// `len` bytes (from one buffer the server keeps, grown on demand).
    async fn get(&self, len: u64) -> Payload;
    /// What came.
    async fn echo(&self, data: Payload) -> Payload;
    /// `x`: a small call with no payload.
    async fn ping(&self, x: u64) -> u64;
}

#[derive(Default)]
struct PerfImpl {
    source: Mutex<Payload>,
}

impl Perf for PerfImpl {
    async fn put(&self, data: Payload) -> u64 {
        data.len() as u64
    }

    async fn get(&self, len: u64) -> Payload {
        let len = len as usize;
        let mut src = self.source.lock().unwrap();
        if src.len() < len {
            *src = Payload::from(pattern(len));
        }
        src.slice(..len)
    }

    async fn echo(&self, data: Payload) -> Payload {
        data
    }

    async fn ping(&self, x: u64) -> u64 {
        x
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Options.

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    Both,
    Server,
    Client,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Put,
    Get,
    Echo,
    Ping,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::Echo => "echo",
            Op::Ping => "ping",
        }
    }

    /// Payload bytes one call moves (both directions for echo).
    fn bytes(self, size: usize) -> u64 {
        match self {
            Op::Echo => 2 * size as u64,
            Op::Ping => 0,
            _ => size as u64,
        }
    }
}

struct Opts {
    role: Role,
    endpoint: Option<String>,
    op: Op,
    sizes: Vec<usize>,
    concurrency: usize,
    connections: usize,
    duration: Duration,
    warmup: Duration,
    threads: usize,
    /// tokio's current-thread runtime instead of the multi-thread one
    current: bool,
    json: Option<String>,
    svg: Option<String>,
    /// send from heap memory rather than from buffers the connection lends
    heap: bool,
}

const USAGE: &str = "rpc-perf [--server | --client] [--endpoint URL] [--op put|get|echo|ping] \
[--sizes 0,64,4k,1m,16m] [--concurrency N] [--connections N] [--duration SECS] \
[--warmup SECS] [--threads N] [--runtime multi|current] [--heap] [--json FILE] [--svg FILE]";

fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("ib")
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(&t);
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1usize << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("bad size {s:?} (like 0, 64, 4k, 1m, 16m)"))
}

fn parse_args<I: Iterator<Item = String>>(args: I) -> Result<Opts, String> {
    let mut o = Opts {
        role: Role::Both,
        endpoint: None,
        op: Op::Put,
        sizes: vec![0, 64, 4 << 10, 1 << 20, 16 << 20],
        concurrency: 1,
        connections: 1,
        duration: Duration::from_secs(2),
        warmup: Duration::from_millis(200),
        threads: 2,
        current: false,
        json: None,
        svg: None,
        heap: false,
    };
    let mut args = args;
    fn value(args: &mut impl Iterator<Item = String>, flag: &str) -> Result<String, String> {
        args.next().ok_or_else(|| format!("{flag} needs a value"))
    }
    let secs = |v: String, flag: &str| -> Result<Duration, String> {
        v.parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| format!("{flag}: expected seconds, got {v:?}"))
    };
    let count = |v: String, flag: &str| -> Result<usize, String> {
        v.parse::<usize>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| format!("{flag}: expected a number >= 1, got {v:?}"))
    };
    while let Some(a) = args.next() {
        // `--flag=value` as well as `--flag value`.
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (a.clone(), None),
        };
        let val = |args: &mut I| match inline.clone() {
            Some(v) => Ok(v),
            None => value(args, &flag),
        };
        match flag.as_str() {
            "--server" => o.role = Role::Server,
            "--client" => o.role = Role::Client,
            "--endpoint" => o.endpoint = Some(val(&mut args)?),
            "--op" => {
                o.op = match val(&mut args)?.as_str() {
                    "put" => Op::Put,
                    "get" => Op::Get,
                    "echo" => Op::Echo,
                    "ping" => Op::Ping,
                    other => return Err(format!("--op: put, get, echo or ping, not {other:?}")),
                }
            }
            "--sizes" => {
                o.sizes = val(&mut args)?
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(parse_size)
                    .collect::<Result<_, _>>()?;
                if o.sizes.is_empty() {
                    return Err("--sizes: give at least one size".into());
                }
            }
            "--concurrency" => o.concurrency = count(val(&mut args)?, "--concurrency")?,
            "--connections" => o.connections = count(val(&mut args)?, "--connections")?,
            "--duration" => o.duration = secs(val(&mut args)?, "--duration")?,
            "--warmup" => o.warmup = secs(val(&mut args)?, "--warmup")?,
            "--threads" => o.threads = count(val(&mut args)?, "--threads")?,
            "--runtime" => {
                o.current = match val(&mut args)?.as_str() {
                    "multi" => false,
                    "current" => true,
                    other => return Err(format!("--runtime: multi or current, not {other:?}")),
                }
            }
            "--json" => o.json = Some(val(&mut args)?),
            "--svg" => o.svg = Some(val(&mut args)?),
            "--heap" => o.heap = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(o)
}

// ---------------------------------------------------------------------------------------------
// Measuring.

/// Results for one payload size.
struct SizeResult {
    size: usize,
    calls: u64,
    secs: f64,
    hist: Histogram<u64>,
}

impl SizeResult {
    fn calls_per_sec(&self) -> f64 {
        self.calls as f64 / self.secs
    }
    fn gb_per_sec(&self, op: Op) -> f64 {
        (self.calls * op.bytes(self.size)) as f64 / self.secs / 1e9
    }
    /// Quantile `q` of the round trip, in microseconds.
    fn us(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1e3
    }
}

async fn one_call(client: &PerfClient, op: Op, src: &Payload, size: usize) -> Result<(), RpcError> {
    let got = match op {
        Op::Put => client.put(src.slice(..size)).await? as usize,
        Op::Get => client.get(size as u64).await?.len(),
        Op::Echo => client.echo(src.slice(..size)).await?.len(),
        Op::Ping => {
            let x = size as u64 ^ 0x5eed;
            if client.ping(x).await? != x {
                return Err(RpcError::Unavailable("ping came back changed".into()));
            }
            size
        }
    };
    if got != size {
        return Err(RpcError::Unavailable(format!(
            "{} of {size} bytes came back as {got}",
            op.name()
        )));
    }
    Ok(())
}

async fn measure_size(
    clients: &[PerfClient],
    o: &Opts,
    srcs: &[Payload],
    size: usize,
) -> Result<SizeResult, RpcError> {
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(o.concurrency);
    for i in 0..o.concurrency {
        let client = clients[i % clients.len()].clone();
        let src = srcs[i % clients.len()].clone();
        let (measuring, stop, op) = (measuring.clone(), stop.clone(), o.op);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)
                .expect("histogram bounds");
            let mut calls = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                one_call(&client, op, &src, size).await?;
                // only calls that end inside the window: one that ends after it would add its
                // bytes but not its time (a large bias when few long calls fit the window)
                if measuring.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
                    hist.saturating_record(t.elapsed().as_nanos() as u64);
                    calls += 1;
                }
            }
            Ok::<_, RpcError>((hist, calls))
        }));
    }
    tokio::time::sleep(o.warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let start = Instant::now();
    tokio::time::sleep(o.duration).await;
    stop.store(true, Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("bounds");
    let mut calls = 0;
    for t in tasks {
        let (h, n) = t.await.expect("measuring task")?;
        hist.add(h).expect("same bounds");
        calls += n;
    }
    Ok(SizeResult {
        size,
        calls,
        secs,
        hist,
    })
}

// ---------------------------------------------------------------------------------------------
// Output.

fn fmt_size(n: usize) -> String {
    if n >= 1 << 30 && n % (1 << 30) == 0 {
        format!("{}G", n >> 30)
    } else if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n % (1 << 10) == 0 {
        format!("{}K", n >> 10)
    } else {
        format!("{n}")
    }
}

fn print_table(o: &Opts, endpoint: &Endpoint, results: &[SizeResult]) {
    println!(
        "rpc-perf: {} over {endpoint}, {} in flight on {} connection(s), {:.1} s per size",
        o.op.name(),
        o.concurrency,
        o.connections,
        o.duration.as_secs_f64()
    );
    println!(
        "{:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "bytes", "calls", "calls/s", "GB/s", "p50 us", "p99 us", "p99.9 us"
    );
    for r in results {
        println!(
            "{:>8} {:>12} {:>10.0} {:>10.3} {:>10.1} {:>10.1} {:>10.1}",
            fmt_size(r.size),
            r.calls,
            r.calls_per_sec(),
            r.gb_per_sec(o.op),
            r.us(0.5),
            r.us(0.99),
            r.us(0.999)
        );
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn to_json(o: &Opts, endpoint: &Endpoint, results: &[SizeResult]) -> String {
    let mut j = String::new();
    let _ = writeln!(j, "{{");
    let _ = writeln!(j, "  \"endpoint\": {},", json_string(&endpoint.to_string()));
    let _ = writeln!(j, "  \"op\": {},", json_string(o.op.name()));
    let _ = writeln!(j, "  \"concurrency\": {},", o.concurrency);
    let _ = writeln!(j, "  \"connections\": {},", o.connections);
    let _ = writeln!(j, "  \"duration_s\": {},", o.duration.as_secs_f64());
    let _ = writeln!(j, "  \"results\": [");
    for (i, r) in results.iter().enumerate() {
        let _ = writeln!(
            j,
            "    {{\"size\": {}, \"calls\": {}, \"seconds\": {:.6}, \"calls_per_sec\": {:.1}, \
             \"gb_per_sec\": {:.6}, \"p50_us\": {:.3}, \"p99_us\": {:.3}, \"p999_us\": {:.3}, \
             \"min_us\": {:.3}, \"max_us\": {:.3}}}{}",
            r.size,
            r.calls,
            r.secs,
            r.calls_per_sec(),
            r.gb_per_sec(o.op),
            r.us(0.5),
            r.us(0.99),
            r.us(0.999),
            r.hist.min() as f64 / 1e3,
            r.hist.max() as f64 / 1e3,
            if i + 1 < results.len() { "," } else { "" }
        );
    }
    let _ = writeln!(j, "  ]");
    let _ = writeln!(j, "}}");
    j
}

fn xml_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Round `v` up to 1, 2 or 5 times a power of ten.
fn nice_ceil(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let p = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= v {
            return m * p;
        }
    }
    10.0 * p
}

/// Two panels sharing a log2 size axis: round-trip latency (p50, p99, p99.9; log scale) on
/// top, bandwidth (GB/s, linear) below.
fn to_svg(o: &Opts, endpoint: &Endpoint, results: &[SizeResult]) -> String {
    const W: f64 = 820.0;
    const LEFT: f64 = 80.0;
    const RIGHT: f64 = 150.0;
    const PANEL_H: f64 = 250.0;
    const TOP1: f64 = 60.0;
    const TOP2: f64 = TOP1 + PANEL_H + 70.0;
    const H: f64 = TOP2 + PANEL_H + 60.0;
    let plot_w = W - LEFT - RIGHT;

    // x: log2 of the size; a 0-byte size sits one step left of 1 byte.
    let xv = |size: usize| {
        if size == 0 {
            -1.0
        } else {
            (size as f64).log2()
        }
    };
    let xs: Vec<f64> = results.iter().map(|r| xv(r.size)).collect();
    let (xmin, xmax) = xs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    let (xmin, xmax) = if xmax - xmin < 1.0 {
        (xmin - 1.0, xmax + 1.0)
    } else {
        (xmin, xmax)
    };
    let px = |x: f64| LEFT + (x - xmin) / (xmax - xmin) * plot_w;

    // Latency panel: log10 microseconds.
    let lat: Vec<[f64; 3]> = results
        .iter()
        .map(|r| [r.us(0.5), r.us(0.99), r.us(0.999)].map(|v| v.max(0.1)))
        .collect();
    let lmin = lat.iter().flatten().cloned().fold(f64::INFINITY, f64::min);
    let lmax = lat.iter().flatten().cloned().fold(0.0, f64::max);
    let (ly0, ly1) = (
        lmin.log10().floor(),
        lmax.log10().ceil().max(lmin.log10().floor() + 1.0),
    );
    let py_lat = |us: f64| TOP1 + PANEL_H - (us.log10() - ly0) / (ly1 - ly0) * PANEL_H;

    // Bandwidth panel: linear GB/s.
    let bw: Vec<f64> = results.iter().map(|r| r.gb_per_sec(o.op)).collect();
    let bmax = nice_ceil(bw.iter().cloned().fold(0.0, f64::max) * 1.05);
    let py_bw = |g: f64| TOP2 + PANEL_H - g / bmax * PANEL_H;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let title = format!(
        "rdma-rpc {} over {endpoint}: {} in flight, {} connection(s)",
        o.op.name(),
        o.concurrency,
        o.connections
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="28" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        W / 2.0,
        xml_escape(&title)
    );

    // Frames, x ticks (every size measured) and panel titles.
    for (top, label) in [
        (TOP1, "round trip (µs, log scale)"),
        (TOP2, "bandwidth (GB/s)"),
    ] {
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{top}" width="{plot_w}" height="{PANEL_H}" fill="none" stroke="#444"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" font-weight="bold">{}</text>"#,
            LEFT,
            top - 8.0,
            xml_escape(label)
        );
        for r in results {
            let x = px(xv(r.size));
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{}" stroke="#ddd"/>"##,
                top + PANEL_H
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
                top + PANEL_H + 16.0,
                fmt_size(r.size)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">payload bytes</text>"#,
            LEFT + plot_w / 2.0,
            top + PANEL_H + 34.0
        );
    }

    // Latency y ticks: powers of ten.
    let mut e = ly0;
    while e <= ly1 + 1e-9 {
        let v = 10f64.powf(e);
        let y = py_lat(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/>"##,
            LEFT + plot_w
        );
        let label = if v >= 1.0 {
            format!("{v:.0}")
        } else {
            format!("{v}")
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{label}</text>"#,
            LEFT - 6.0,
            y + 4.0
        );
        e += 1.0;
    }
    // Bandwidth y ticks: five steps.
    for i in 0..=5 {
        let v = bmax * i as f64 / 5.0;
        let y = py_bw(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#eee"/>"##,
            LEFT + plot_w
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            y + 4.0,
            if bmax < 1.0 {
                format!("{v:.3}")
            } else {
                format!("{v:.2}")
            }
        );
    }

    let series = |s: &mut String, points: Vec<(f64, f64)>, color: &str, dash: &str| {
        let pts: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>"#,
            pts.join(" ")
        );
        for (x, y) in points {
            let _ = writeln!(
                s,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#
            );
        }
    };
    let colors = ["#1f77b4", "#ff7f0e", "#d62728"];
    let names = ["p50", "p99", "p99.9"];
    let dashes = ["", "6,3", "2,3"];
    for k in 0..3 {
        let pts = results
            .iter()
            .zip(&lat)
            .map(|(r, l)| (px(xv(r.size)), py_lat(l[k])))
            .collect();
        series(&mut s, pts, colors[k], dashes[k]);
        let ly = TOP1 + 20.0 + 18.0 * k as f64;
        let lx = LEFT + plot_w + 16.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="2" stroke-dasharray="{}"/>"#,
            lx + 24.0,
            colors[k],
            dashes[k]
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 30.0,
            ly + 4.0,
            names[k]
        );
    }
    let pts = results
        .iter()
        .zip(&bw)
        .map(|(r, g)| (px(xv(r.size)), py_bw(*g)))
        .collect();
    series(&mut s, pts, "#2ca02c", "");
    let (lx, ly) = (LEFT + plot_w + 16.0, TOP2 + 20.0);
    let _ = writeln!(
        s,
        r##"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="#2ca02c" stroke-width="2"/>"##,
        lx + 24.0
    );
    let _ = writeln!(s, r#"<text x="{}" y="{}">GB/s</text>"#, lx + 30.0, ly + 4.0);
    let _ = writeln!(
        s,
        r##"<text x="{lx}" y="{}" fill="#555">calls/s:</text>"##,
        ly + 26.0
    );
    for (i, r) in results.iter().enumerate() {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#555">{}: {:.0}</text>"##,
            lx,
            ly + 42.0 + 16.0 * i as f64,
            fmt_size(r.size),
            r.calls_per_sec()
        );
    }
    let _ = writeln!(s, "</svg>");
    s
}

// ---------------------------------------------------------------------------------------------

async fn serve(endpoint: &Endpoint) -> Result<(Endpoint, tokio::task::JoinHandle<()>), RpcError> {
    let server = Server::bind(endpoint).await?;
    let local = server.local_endpoint();
    let task = tokio::spawn(async move {
        if let Err(e) = server.serve(PerfServer::new(PerfImpl::default())).await {
            eprintln!("rpc-perf: server stopped: {e}");
        }
    });
    Ok((local, task))
}

async fn run_client(o: &Opts, endpoint: &Endpoint) -> Result<Vec<SizeResult>, RpcError> {
    let mut clients = Vec::with_capacity(o.connections);
    for _ in 0..o.connections {
        clients.push(PerfClient::connect(endpoint).await?);
    }
    let max = o.sizes.iter().copied().max().unwrap_or(0);
    // one source per connection, lent by it: a payload is sent without a copy only on the
    // connection whose memory holds it
    let data = Payload::from(pattern(max));
    let srcs: Vec<Payload> = clients
        .iter()
        .map(|c| {
            if o.heap {
                return data.clone();
            }
            let mut buf = c.client().payload_mut(max);
            buf.copy_from_slice(&data);
            buf.freeze()
        })
        .collect();
    let mut results = Vec::new();
    for &size in &o.sizes {
        let r = measure_size(&clients, o, &srcs, size).await?;
        eprintln!(
            "  {:>6}: {:>9.0} calls/s {:>8.3} GB/s  p50 {:.1} us",
            fmt_size(size),
            r.calls_per_sec(),
            r.gb_per_sec(o.op),
            r.us(0.5)
        );
        results.push(r);
    }
    Ok(results)
}

async fn run(o: Opts) -> Result<(), String> {
    let default = match o.role {
        Role::Both => "tcp://127.0.0.1:0",
        Role::Server => "tcp://0.0.0.0:18515",
        Role::Client => "tcp://127.0.0.1:18515",
    };
    let endpoint: Endpoint = o
        .endpoint
        .as_deref()
        .unwrap_or(default)
        .parse()
        .map_err(|e| format!("--endpoint: {e}"))?;
    match o.role {
        Role::Server => {
            let (local, task) = serve(&endpoint).await.map_err(|e| e.to_string())?;
            println!("rpc-perf: serving on {local}; stop with Ctrl-C");
            task.await.map_err(|e| e.to_string())?;
            Ok(())
        }
        Role::Client | Role::Both => {
            let (target, server) = if o.role == Role::Both {
                let (local, task) = serve(&endpoint).await.map_err(|e| e.to_string())?;
                (local, Some(task))
            } else {
                (endpoint, None)
            };
            let results = run_client(&o, &target).await.map_err(|e| e.to_string())?;
            println!();
            print_table(&o, &target, &results);
            if let Some(path) = &o.json {
                std::fs::write(path, to_json(&o, &target, &results))
                    .map_err(|e| format!("{path}: {e}"))?;
                eprintln!("wrote {path}");
            }
            if let Some(path) = &o.svg {
                std::fs::write(path, to_svg(&o, &target, &results))
                    .map_err(|e| format!("{path}: {e}"))?;
                eprintln!("wrote {path}");
            }
            if let Some(task) = server {
                task.abort();
            }
            Ok(())
        }
    }
}

fn main() {
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            if e.is_empty() {
                println!("{USAGE}");
                return;
            }
            eprintln!("rpc-perf: {e}\nusage: {USAGE}");
            std::process::exit(2);
        }
    };
    // The library's warnings (why a connection closed, ...) on stderr; RUST_LOG overrides.
    log::warnings_to_stderr();
    let rt = if opts.current {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.threads)
            .enable_all()
            .build()
    }
    .expect("tokio runtime");
    if let Err(e) = rt.block_on(run(opts)) {
        eprintln!("rpc-perf: {e}");
        std::process::exit(1);
    }
}
