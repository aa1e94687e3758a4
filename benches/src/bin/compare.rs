//! Measures rdma-rpc and its peers on the same workloads in one run (about a minute) and prints
//! the table of ratios the performance targets are stated in.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin compare -- [--secs 0.8] [--rounds 3]
//!     [--only rdma-rpc,tarpc] [--bw-size 16m] [--json FILE]
//!     [--rdma-ip IP [--rdma-device rxe0] [--rdma-spin-us N] [--rdma-opts K=V&K=V]]
//! ```
//!
//! Every system runs its server and clients in this process on its own tokio multi-thread
//! runtime of 2 workers (started once, idle while the others are measured). Each round
//! measures every system in turn, for `--secs` per workload:
//! - small-call round trip (one in flight): p50 and p99;
//! - small calls/s with 64 in flight on 1 connection, and spread over 8 connections;
//! - bandwidth, put (upload) and get (download) of `--bw-size` (16 MiB; 1 MiB over RDMA), one
//!   call in flight.
//!
//! The table shows the median over `--rounds` rounds: interleaving the systems and taking
//! medians keeps a burst of load from elsewhere on the machine from landing on one system
//! only. The load average before and after is printed, since a shared 2-core machine skews
//! everything.
//!
//! Systems: `raw-tcp` (the floor), `rdma-rpc`, `tarpc`, `ruapc` (inline payloads) and
//! `ruapc-bulk` (its remote-memory API; bandwidth only). The ruapc target compares against
//! the better of its two variants.
//!
//! **RDMA mode** (`--rdma-ip IP`, for the guest with a software RDMA device; see
//! scripts/ruapc-rdma-compare.sh): rdma-rpc serves `rdma://IP:0?device=DEV` (plus
//! `--rdma-opts`), and ruapc and ruapc-bulk use ruapc's RDMA transport (`tcp+rdma://IP:PORT`,
//! bootstrap over TCP, then the queue pair, on DEV only) when built with the `ruapc-rdma`
//! feature (without it their rows say so). `--rdma-spin-us N` sets how long each side polls
//! its completion queue after the last completion: rdma-rpc's `busy_poll_us`, ruapc's
//! `rdma.polling.poll_spin_us` (default: each one's own, 50 µs for both). tarpc and raw-tcp
//! (TCP only) run only if named in `--only`; the table then says which rows are TCP. Only the
//! targets against ruapc are printed, as ratios of the RDMA rows.
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdma_rpc_benches::raw::Raw;
use rdma_rpc_benches::rdma_rpc_sys::RdmaRpc;
use rdma_rpc_benches::ruapc_sys::{Ruapc, RuapcNet};
use rdma_rpc_benches::tarpc_sys::Tarpc;
use rdma_rpc_benches::{
    bandwidth, connect_n, fmt_size, latency, parse_size, payload_source_of, runtime, Dir, Error,
    System, MAX_PAYLOAD,
};

/// Bandwidth payload on TCP, and over RDMA (where software RDMA under emulation moves tens of
/// MB/s).
const BW_SIZE: usize = 16 << 20;
const BW_SIZE_RDMA: usize = 1 << 20;
const IN_FLIGHT: usize = 64;
const CONNS: usize = 8;

/// RDMA mode: where rdma-rpc and ruapc listen.
struct RdmaOpts {
    ip: IpAddr,
    device: String,
    spin_us: Option<u64>,
    /// Extra rdma-rpc endpoint options (`k=v&k=v`).
    extra: String,
}

impl RdmaOpts {
    /// rdma-rpc's bind endpoint.
    fn rdma_rpc_endpoint(&self) -> String {
        let host = match self.ip {
            IpAddr::V4(ip) => ip.to_string(),
            IpAddr::V6(ip) => format!("[{ip}]"),
        };
        let mut ep = format!("rdma://{host}:0?device={}", self.device);
        if let Some(us) = self.spin_us {
            let _ = write!(ep, "&busy_poll_us={us}");
        }
        let extra = self.extra.trim_start_matches(['&', '?']);
        if !extra.is_empty() {
            let _ = write!(ep, "&{extra}");
        }
        ep
    }

    fn ruapc_net(&self) -> RuapcNet {
        RuapcNet::rdma(self.ip, &self.device, self.spin_us)
    }
}

struct Opts {
    secs: f64,
    rounds: usize,
    only: Option<Vec<String>>,
    json: Option<String>,
    bw_size: Option<usize>,
    rdma: Option<RdmaOpts>,
}

fn parse_args() -> Opts {
    let mut o = Opts {
        secs: 0.8,
        rounds: 3,
        only: None,
        json: None,
        bw_size: None,
        rdma: None,
    };
    let (mut rdma_ip, mut rdma_device, mut rdma_spin_us, mut rdma_opts) = (None, None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--secs" => o.secs = args.next().and_then(|v| v.parse().ok()).expect("--secs S"),
            "--rounds" => {
                o.rounds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&n| n >= 1)
                    .expect("--rounds N (>= 1)")
            }
            "--only" => {
                o.only = Some(
                    args.next()
                        .expect("--only a,b")
                        .split(',')
                        .map(str::to_owned)
                        .collect(),
                )
            }
            "--json" => o.json = Some(args.next().expect("--json FILE")),
            "--bw-size" => {
                o.bw_size = Some(
                    args.next()
                        .as_deref()
                        .and_then(parse_size)
                        .filter(|&n| (1..=MAX_PAYLOAD).contains(&n))
                        .expect("--bw-size SIZE (1 B to 64 MiB, e.g. 1m)"),
                )
            }
            "--rdma-ip" => {
                rdma_ip = Some(
                    args.next()
                        .and_then(|v| v.parse::<IpAddr>().ok())
                        .expect("--rdma-ip IP"),
                )
            }
            "--rdma-device" => rdma_device = Some(args.next().expect("--rdma-device NAME")),
            "--rdma-spin-us" => {
                rdma_spin_us = Some(
                    args.next()
                        .and_then(|v| v.parse::<u64>().ok())
                        .expect("--rdma-spin-us N"),
                )
            }
            "--rdma-opts" => rdma_opts = Some(args.next().expect("--rdma-opts K=V&K=V")),
            // `cargo bench` passes this to every target.
            "--bench" => {}
            "-h" | "--help" => {
                println!(
                    "compare [--secs S (per workload and round, default 0.8)] [--rounds N (default 3)] \
                     [--only raw-tcp,rdma-rpc,tarpc,ruapc,ruapc-bulk] \
                     [--bw-size SIZE (default 16m; 1m with --rdma-ip)] [--json FILE]\n\
                     RDMA mode: --rdma-ip IP [--rdma-device NAME (default rxe0)] \
                     [--rdma-spin-us N (rdma-rpc busy_poll_us, ruapc poll_spin_us)] \
                     [--rdma-opts K=V&K=V (more rdma-rpc endpoint options)]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?} (try --help)"),
        }
    }
    match rdma_ip {
        Some(ip) => {
            o.rdma = Some(RdmaOpts {
                ip,
                device: rdma_device.unwrap_or_else(|| "rxe0".to_owned()),
                spin_us: rdma_spin_us,
                extra: rdma_opts.unwrap_or_default(),
            })
        }
        None => assert!(
            rdma_device.is_none() && rdma_spin_us.is_none() && rdma_opts.is_none(),
            "--rdma-device, --rdma-spin-us and --rdma-opts need --rdma-ip"
        ),
    }
    o
}

/// What one system measured; `None` where it does not take part or failed (see `notes`).
#[derive(Default, Clone)]
struct Row {
    name: String,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
    cps_1: Option<f64>,
    cps_8: Option<f64>,
    put_gbs: Option<f64>,
    get_gbs: Option<f64>,
    notes: Vec<String>,
}

fn keep<T>(row: &mut Row, what: &str, r: Result<T, Error>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            row.notes.push(format!("{what}: {e}"));
            None
        }
    }
}

/// One round of every workload on a running system.
async fn measure<S: System>(sys: &S, conns: &[S::Conn], secs: f64, src: &Bytes, bw: usize) -> Row {
    let dur = Duration::from_secs_f64(secs);
    let warm = Duration::from_secs_f64((secs / 5.0).max(0.05));
    let mut row = Row {
        name: sys.name(),
        ..Row::default()
    };
    if sys.does_small_calls() {
        if let Some(h) = keep(&mut row, "latency", latency(&conns[0], warm, dur).await) {
            row.p50_us = Some(h.value_at_quantile(0.5) as f64 / 1e3);
            row.p99_us = Some(h.value_at_quantile(0.99) as f64 / 1e3);
        }
        let _ = sys.calls_per_sec(&conns[..1], IN_FLIGHT, warm).await;
        let r = sys.calls_per_sec(&conns[..1], IN_FLIGHT, dur).await;
        row.cps_1 = keep(&mut row, "calls/s 1 conn", r);
        let r = sys.calls_per_sec(conns, IN_FLIGHT, dur).await;
        row.cps_8 = keep(&mut row, "calls/s 8 conns", r);
    }
    if sys.max_payload() >= bw {
        let r = bandwidth(&conns[0], Dir::Put, src, bw, dur, 4).await;
        row.put_gbs = keep(&mut row, "put", r).map(|b| b / 1e9);
        let r = bandwidth(&conns[0], Dir::Get, src, bw, dur, 4).await;
        row.get_gbs = keep(&mut row, "get", r).map(|b| b / 1e9);
    } else {
        row.notes
            .push(format!("{} exceeds its message limit", fmt_size(bw)));
    }
    row
}

/// A system that is running, on its own runtime, with its connections open.
trait Live {
    fn round(&self, secs: f64, src: &Bytes, bw: usize) -> Row;
    fn stop(self: Box<Self>);
}

struct Running<S: System> {
    rt: tokio::runtime::Runtime,
    sys: S,
    conns: Vec<S::Conn>,
}

impl<S: System> Live for Running<S> {
    fn round(&self, secs: f64, src: &Bytes, bw: usize) -> Row {
        self.rt
            .block_on(measure(&self.sys, &self.conns, secs, src, bw))
    }

    fn stop(self: Box<Self>) {
        let Running { rt, sys, conns } = *self;
        drop(conns);
        rt.block_on(sys.stop());
        rt.shutdown_timeout(Duration::from_secs(2));
    }
}

/// Starts a system on a fresh runtime and connects to it; on failure, a row saying why.
fn start<S, F>(name: &str, start: F) -> Result<Box<dyn Live>, Box<Row>>
where
    S: System,
    F: std::future::Future<Output = Result<S, Error>>,
{
    let failed = |what: &str, e: Error| {
        Box::new(Row {
            name: name.to_owned(),
            notes: vec![format!("{what}: {e}")],
            ..Row::default()
        })
    };
    let rt = runtime();
    let sys = rt.block_on(start).map_err(|e| failed("start", e))?;
    match rt.block_on(connect_n(&sys, CONNS)) {
        Ok(conns) => Ok(Box::new(Running { rt, sys, conns })),
        Err(e) => {
            rt.block_on(sys.stop());
            Err(failed("connect", e))
        }
    }
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Per metric, the median of the rounds that measured it; notes of every round, once each.
fn merge(rounds: &[Row]) -> Row {
    let m = |k: fn(&Row) -> Option<f64>| median(rounds.iter().filter_map(k).collect());
    let mut notes: Vec<String> = Vec::new();
    for n in rounds.iter().flat_map(|r| &r.notes) {
        if !notes.contains(n) {
            notes.push(n.clone());
        }
    }
    Row {
        name: rounds[0].name.clone(),
        p50_us: m(|r| r.p50_us),
        p99_us: m(|r| r.p99_us),
        cps_1: m(|r| r.cps_1),
        cps_8: m(|r| r.cps_8),
        put_gbs: m(|r| r.put_gbs),
        get_gbs: m(|r| r.get_gbs),
        notes,
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn f(v: Option<f64>, digits: usize) -> String {
    match v {
        Some(v) => format!("{v:.digits$}"),
        None => "-".to_owned(),
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn max_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

fn min_opt(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}

fn json_num(v: Option<f64>) -> String {
    v.map(|v| format!("{v}")).unwrap_or_else(|| "null".into())
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// How bandwidth is shown: rows keep GB/s.
struct Unit {
    name: &'static str,
    scale: f64,
    digits: usize,
}

impl Unit {
    fn of(&self, gbs: Option<f64>) -> Option<f64> {
        gbs.map(|v| v * self.scale)
    }
}

fn main() {
    let opts = parse_args();
    let rdma = opts.rdma.as_ref();
    let wanted = |name: &str| match &opts.only {
        Some(o) => o.iter().any(|n| n == name),
        // Over RDMA, the systems that have an RDMA transport.
        None => rdma.is_none() || matches!(name, "rdma-rpc" | "ruapc" | "ruapc-bulk"),
    };
    let bw = opts.bw_size.unwrap_or(if rdma.is_some() {
        BW_SIZE_RDMA
    } else {
        BW_SIZE
    });
    let src = payload_source_of(bw);
    let t0 = Instant::now();
    let load_before = loadavg();
    let transport = match rdma {
        None => "TCP loopback".to_owned(),
        Some(r) => format!(
            "RDMA on {} ({}): rdma-rpc {}, ruapc tcp+rdma://{}:PORT (poll spin {})",
            r.device,
            r.ip,
            r.rdma_rpc_endpoint(),
            r.ip,
            r.spin_us
                .map(|us| format!("{us} us"))
                .unwrap_or_else(|| "defaults".to_owned())
        ),
    };
    eprintln!(
        "compare: {} rounds of {} s per workload; each system on its own tokio runtime \
         (multi-thread, 2 workers); {transport}; load average {load_before}",
        opts.rounds, opts.secs
    );
    let mut live: Vec<Box<dyn Live>> = Vec::new();
    let mut failed: Vec<Row> = Vec::new();
    let mut add = |r: Result<Box<dyn Live>, Box<Row>>| match r {
        Ok(l) => live.push(l),
        Err(row) => failed.push(*row),
    };
    if wanted("raw-tcp") {
        add(start("raw-tcp", Raw::start(src.clone())));
    }
    // Row names over RDMA get this suffix (rdma-rpc's comes from its endpoint's scheme).
    let sfx = if rdma.is_some() { "/rdma" } else { "" };
    if wanted("rdma-rpc") {
        let ep = rdma.map_or_else(
            || "tcp://127.0.0.1:0".to_owned(),
            RdmaOpts::rdma_rpc_endpoint,
        );
        add(start(
            &format!("rdma-rpc{sfx}"),
            RdmaRpc::start(&ep, src.clone()),
        ));
    }
    if wanted("tarpc") {
        add(start("tarpc", Tarpc::start(src.clone())));
    }
    let net = rdma.map_or_else(RuapcNet::default, RdmaOpts::ruapc_net);
    if wanted("ruapc") {
        add(start(
            &format!("ruapc{sfx}"),
            Ruapc::start_on(&net, src.clone(), false),
        ));
    }
    if wanted("ruapc-bulk") {
        add(start(
            &format!("ruapc-bulk{sfx}"),
            Ruapc::start_on(&net, src.clone(), true),
        ));
    }
    // Software RDMA under emulation moves tens of MB/s: show MB/s there.
    let unit = if rdma.is_some() {
        Unit {
            name: "MB/s",
            scale: 1e3,
            digits: 1,
        }
    } else {
        Unit {
            name: "GB/s",
            scale: 1.0,
            digits: 2,
        }
    };
    let mut per_system: Vec<Vec<Row>> = vec![Vec::new(); live.len()];
    for round in 0..opts.rounds {
        let t = Instant::now();
        for (l, rows) in live.iter().zip(&mut per_system) {
            let r = l.round(opts.secs, &src, bw);
            eprintln!(
                "    {:<16} p50 {:>7} us  p99 {:>7} us  {:>9} calls/s (1c) {:>9} (8c)  put {:>6} get {:>6} {}",
                r.name,
                f(r.p50_us, 1),
                f(r.p99_us, 1),
                f(r.cps_1, 0),
                f(r.cps_8, 0),
                f(unit.of(r.put_gbs), unit.digits),
                f(unit.of(r.get_gbs), unit.digits),
                unit.name
            );
            for n in &r.notes {
                eprintln!("      note: {n}");
            }
            rows.push(r);
        }
        eprintln!(
            "  round {}/{} in {:.1} s (load average {})",
            round + 1,
            opts.rounds,
            t.elapsed().as_secs_f64(),
            loadavg()
        );
    }
    let mut rows: Vec<Row> = per_system.iter().map(|r| merge(r)).collect();
    rows.extend(failed);
    for l in live {
        l.stop();
    }
    let wall = t0.elapsed();
    let load_after = loadavg();

    println!();
    if let Some(r) = rdma {
        println!(
            "=== over RDMA: device {} ({}); rows ending in /rdma ran over RDMA, others over TCP \
             loopback ===",
            r.device, r.ip
        );
    }
    let size = fmt_size(bw);
    let (put_h, get_h) = (format!("put {}", unit.name), format!("get {}", unit.name));
    println!(
        "{:<16} {:>9} {:>9} {:>14} {:>14} {:>11} {:>11}",
        "system", "p50 us", "p99 us", "calls/s 64x1c", "calls/s 64x8c", put_h, get_h
    );
    println!("{}", "-".repeat(90));
    for r in &rows {
        println!(
            "{:<16} {:>9} {:>9} {:>14} {:>14} {:>11} {:>11}",
            r.name,
            f(r.p50_us, 1),
            f(r.p99_us, 1),
            f(r.cps_1, 0),
            f(r.cps_8, 0),
            f(unit.of(r.put_gbs), unit.digits),
            f(unit.of(r.get_gbs), unit.digits),
        );
    }
    for r in &rows {
        for n in &r.notes {
            println!("  note {}: {n}", r.name);
        }
    }
    println!(
        "(median of {} rounds; p50/p99: sequential small calls; calls/s: 64 in flight on 1 \
         connection / over 8; put/get: {size}, one in flight; {} = 1e{} bytes/s)",
        opts.rounds,
        unit.name,
        if rdma.is_some() { 6 } else { 9 }
    );

    let by: BTreeMap<&str, &Row> = rows.iter().map(|r| (r.name.as_str(), r)).collect();
    let get = |n: &str| by.get(n).copied();
    let me = get(&format!("rdma-rpc{sfx}"));
    let raw = get("raw-tcp");
    let tarpc = get("tarpc");
    let ruapc = get(&format!("ruapc{sfx}"));
    let bulk = get(&format!("ruapc-bulk{sfx}"));
    let pick = |r: Option<&Row>, k: fn(&Row) -> Option<f64>| r.and_then(k);
    // ruapc's best variant per metric.
    let ruapc_put = max_opt(pick(ruapc, |r| r.put_gbs), pick(bulk, |r| r.put_gbs));
    let ruapc_get = max_opt(pick(ruapc, |r| r.get_gbs), pick(bulk, |r| r.get_gbs));

    struct Target {
        what: String,
        peer: &'static str,
        ratio: Option<f64>,
        goal: &'static str,
        ok: fn(f64) -> bool,
    }
    let p50 = |r: Option<&Row>| pick(r, |r| r.p50_us);
    let cps = |r: Option<&Row>| pick(r, |r| r.cps_1);
    let put = |r: Option<&Row>| pick(r, |r| r.put_gbs);
    let getbw = |r: Option<&Row>| pick(r, |r| r.get_gbs);
    let targets = [
        Target {
            what: "small-call p50".into(),
            peer: "raw-tcp",
            ratio: ratio(p50(me), p50(raw)),
            goal: "<= 1.3x",
            ok: |x| x <= 1.3,
        },
        Target {
            what: "small-call p50".into(),
            peer: "tarpc",
            ratio: ratio(p50(me), p50(tarpc)),
            goal: "<= 0.4x",
            ok: |x| x <= 0.4,
        },
        Target {
            what: "small-call p50".into(),
            peer: "ruapc",
            ratio: ratio(p50(me), p50(ruapc)),
            goal: "<= 1.0x",
            ok: |x| x <= 1.0,
        },
        Target {
            what: "calls/s, 64 in flight".into(),
            peer: "tarpc",
            ratio: ratio(cps(me), cps(tarpc)),
            goal: ">= 2x",
            ok: |x| x >= 2.0,
        },
        Target {
            what: "calls/s, 64 in flight".into(),
            peer: "ruapc",
            ratio: ratio(cps(me), cps(ruapc)),
            goal: ">= 3x",
            ok: |x| x >= 3.0,
        },
        Target {
            what: format!("{size} put bandwidth"),
            peer: "raw-tcp",
            ratio: ratio(put(me), put(raw)),
            goal: ">= 0.85x",
            ok: |x| x >= 0.85,
        },
        Target {
            what: format!("{size} get bandwidth"),
            peer: "raw-tcp",
            ratio: ratio(getbw(me), getbw(raw)),
            goal: ">= 0.85x",
            ok: |x| x >= 0.85,
        },
        Target {
            what: format!("{size} put bandwidth"),
            peer: "tarpc",
            ratio: ratio(put(me), put(tarpc)),
            goal: ">= 1.5x",
            ok: |x| x >= 1.5,
        },
        Target {
            what: format!("{size} get bandwidth"),
            peer: "tarpc",
            ratio: ratio(getbw(me), getbw(tarpc)),
            goal: ">= 1.5x",
            ok: |x| x >= 1.5,
        },
        Target {
            what: format!("{size} put bandwidth"),
            peer: "ruapc (best)",
            ratio: ratio(put(me), ruapc_put),
            goal: "> 1x",
            ok: |x| x > 1.0,
        },
        Target {
            what: format!("{size} get bandwidth"),
            peer: "ruapc (best)",
            ratio: ratio(getbw(me), ruapc_get),
            goal: "> 1x",
            ok: |x| x > 1.0,
        },
    ];
    // Over RDMA only the targets against ruapc apply (its rows are the RDMA ones).
    let shown: Vec<&Target> = targets
        .iter()
        .filter(|t| rdma.is_none() || t.peer.starts_with("ruapc"))
        .collect();
    println!();
    println!(
        "{:<24} {:<14} {:>9} {:>9}  verdict",
        if rdma.is_some() {
            "rdma-rpc vs (RDMA)"
        } else {
            "rdma-rpc vs"
        },
        "peer",
        "ratio",
        "target"
    );
    println!("{}", "-".repeat(68));
    let (mut met, mut missed) = (0, 0);
    for t in &shown {
        let verdict = match t.ratio {
            Some(x) if (t.ok)(x) => {
                met += 1;
                "met"
            }
            Some(_) => {
                missed += 1;
                "MISSED"
            }
            None => "n/a",
        };
        println!(
            "{:<24} {:<14} {:>9} {:>9}  {verdict}",
            t.what,
            t.peer,
            t.ratio.map(|x| format!("{x:.2}x")).unwrap_or("-".into()),
            t.goal
        );
    }
    // Context for the floor-relative numbers.
    let best_peer_p50 = min_opt(p50(tarpc), p50(ruapc));
    println!(
        "targets: {met} met, {missed} missed; rdma-rpc p50 {} us (raw floor {} us, best peer {} us)",
        f(p50(me), 1),
        f(p50(raw), 1),
        f(best_peer_p50, 1),
    );
    println!(
        "wall time {:.0} s; load average {load_before} before, {load_after} after (2 cores)",
        wall.as_secs_f64()
    );

    if let Some(path) = &opts.json {
        let mut j = format!(
            "{{\n  \"rounds\": {},\n  \"secs\": {},\n  \"transport\": {},\n  \"bw_bytes\": {bw},\n  \"load_before\": {},\n  \"load_after\": {},\n  \"systems\": [\n",
            opts.rounds,
            opts.secs,
            json_str(&transport),
            json_str(&load_before),
            json_str(&load_after)
        );
        // `put_16m_gbs` for the default 16 MiB, `put_1m_gbs` for 1 MiB, ...
        let key = fmt_size(bw)
            .replace(" MiB", "m")
            .replace(" KiB", "k")
            .replace(" GiB", "g")
            .replace(" B", "");
        for (i, r) in rows.iter().enumerate() {
            let notes: Vec<String> = r.notes.iter().map(|n| json_str(n)).collect();
            let _ = writeln!(
                j,
                "    {{\"name\": {}, \"p50_us\": {}, \"p99_us\": {}, \"calls_per_sec_64x1\": {}, \"calls_per_sec_64x8\": {}, \"put_{key}_gbs\": {}, \"get_{key}_gbs\": {}, \"notes\": [{}]}}{}",
                json_str(&r.name),
                json_num(r.p50_us),
                json_num(r.p99_us),
                json_num(r.cps_1),
                json_num(r.cps_8),
                json_num(r.put_gbs),
                json_num(r.get_gbs),
                notes.join(", "),
                if i + 1 < rows.len() { "," } else { "" }
            );
        }
        j.push_str("  ],\n  \"targets\": [\n");
        for (i, t) in shown.iter().enumerate() {
            let _ =
                writeln!(
                j,
                "    {{\"what\": {}, \"peer\": {}, \"ratio\": {}, \"goal\": {}, \"met\": {}}}{}",
                json_str(&t.what),
                json_str(t.peer),
                json_num(t.ratio),
                json_str(t.goal),
                t.ratio.map(|x| (t.ok)(x).to_string()).unwrap_or("null".into()),
                if i + 1 < shown.len() { "," } else { "" }
            );
        }
        j.push_str("  ]\n}\n");
        std::fs::write(path, j).expect("write --json file");
        eprintln!("wrote {path}");
    }
}
