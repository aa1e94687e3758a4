//! Measures rdma-rpc and its peers on the same workloads in one run (about a minute) and prints
//! the table of ratios the performance targets are stated in.
//!
//! ```text
//! cargo run --release -p rdma-rpc-benches --bin compare -- [--secs 0.8] [--rounds 3]
//!     [--only rdma-rpc,tarpc] [--json FILE]
//! ```
//!
//! Every system runs its server and clients in this process on its own tokio multi-thread
//! runtime of 2 workers (started once, idle while the others are measured). Each round
//! measures every system in turn, for `--secs` per workload:
//! - small-call round trip (one in flight): p50 and p99;
//! - small calls/s with 64 in flight on 1 connection, and spread over 8 connections;
//! - 16 MiB bandwidth, put (upload) and get (download), one call in flight.
//!
//! The table shows the median over `--rounds` rounds: interleaving the systems and taking
//! medians keeps a burst of load from elsewhere on the machine from landing on one system
//! only. The load average before and after is printed, since a shared 2-core machine skews
//! everything.
//!
//! Systems: `raw-tcp` (the floor), `rdma-rpc`, `tarpc`, `ruapc` (inline payloads) and
//! `ruapc-bulk` (its remote-memory API; bandwidth only). The ruapc target compares against
//! the better of its two variants.
#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdma_rpc_benches::raw::Raw;
use rdma_rpc_benches::rdma_rpc_sys::RdmaRpc;
use rdma_rpc_benches::ruapc_sys::Ruapc;
use rdma_rpc_benches::tarpc_sys::Tarpc;
use rdma_rpc_benches::{
    bandwidth, connect_n, latency, payload_source, runtime, Dir, Error, System,
};

const BW_SIZE: usize = 16 << 20;
const IN_FLIGHT: usize = 64;
const CONNS: usize = 8;

struct Opts {
    secs: f64,
    rounds: usize,
    only: Option<Vec<String>>,
    json: Option<String>,
}

fn parse_args() -> Opts {
    let mut o = Opts {
        secs: 0.8,
        rounds: 3,
        only: None,
        json: None,
    };
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
            // `cargo bench` passes this to every target.
            "--bench" => {}
            "-h" | "--help" => {
                println!(
                    "compare [--secs S (per workload and round, default 0.8)] [--rounds N (default 3)] \
                     [--only raw-tcp,rdma-rpc,tarpc,ruapc,ruapc-bulk] [--json FILE]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?} (try --help)"),
        }
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
async fn measure<S: System>(sys: &S, conns: &[S::Conn], secs: f64, src: &Bytes) -> Row {
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
    if sys.max_payload() >= BW_SIZE {
        let r = bandwidth(&conns[0], Dir::Put, src, BW_SIZE, dur, 4).await;
        row.put_gbs = keep(&mut row, "put", r).map(|b| b / 1e9);
        let r = bandwidth(&conns[0], Dir::Get, src, BW_SIZE, dur, 4).await;
        row.get_gbs = keep(&mut row, "get", r).map(|b| b / 1e9);
    } else {
        row.notes
            .push("16 MiB exceeds its message limit".to_owned());
    }
    row
}

/// A system that is running, on its own runtime, with its connections open.
trait Live {
    fn round(&self, secs: f64, src: &Bytes) -> Row;
    fn stop(self: Box<Self>);
}

struct Running<S: System> {
    rt: tokio::runtime::Runtime,
    sys: S,
    conns: Vec<S::Conn>,
}

impl<S: System> Live for Running<S> {
    fn round(&self, secs: f64, src: &Bytes) -> Row {
        self.rt.block_on(measure(&self.sys, &self.conns, secs, src))
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

fn main() {
    let opts = parse_args();
    let wanted = |name: &str| {
        opts.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|n| n == name))
    };
    let src = payload_source();
    let t0 = Instant::now();
    let load_before = loadavg();
    eprintln!(
        "compare: {} rounds of {} s per workload; each system on its own tokio runtime \
         (multi-thread, 2 workers); TCP loopback; load average {load_before}",
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
    if wanted("rdma-rpc") {
        add(start(
            "rdma-rpc",
            RdmaRpc::start("tcp://127.0.0.1:0", src.clone()),
        ));
    }
    #[cfg(feature = "rdma")]
    if wanted("rdma-rpc/rdma") {
        // The hook for the guest: the same workloads over rdma://.
        let ep = std::env::var("RDMA_RPC_BENCH_RDMA")
            .unwrap_or_else(|_| "rdma://127.0.0.1:0".to_owned());
        add(start("rdma-rpc/rdma", RdmaRpc::start(&ep, src.clone())));
    }
    if wanted("tarpc") {
        add(start("tarpc", Tarpc::start(src.clone())));
    }
    if wanted("ruapc") {
        add(start("ruapc", Ruapc::start(src.clone(), false)));
    }
    if wanted("ruapc-bulk") {
        add(start("ruapc-bulk", Ruapc::start(src.clone(), true)));
    }
    let mut per_system: Vec<Vec<Row>> = vec![Vec::new(); live.len()];
    for round in 0..opts.rounds {
        let t = Instant::now();
        for (l, rows) in live.iter().zip(&mut per_system) {
            let r = l.round(opts.secs, &src);
            eprintln!(
                "    {:<12} p50 {:>7} us  p99 {:>7} us  {:>9} calls/s (1c) {:>9} (8c)  put {:>5} get {:>5} GB/s",
                r.name,
                f(r.p50_us, 1),
                f(r.p99_us, 1),
                f(r.cps_1, 0),
                f(r.cps_8, 0),
                f(r.put_gbs, 2),
                f(r.get_gbs, 2)
            );
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
    println!(
        "{:<14} {:>9} {:>9} {:>14} {:>14} {:>11} {:>11}",
        "system", "p50 us", "p99 us", "calls/s 64x1c", "calls/s 64x8c", "put GB/s", "get GB/s"
    );
    println!("{}", "-".repeat(88));
    for r in &rows {
        println!(
            "{:<14} {:>9} {:>9} {:>14} {:>14} {:>11} {:>11}",
            r.name,
            f(r.p50_us, 1),
            f(r.p99_us, 1),
            f(r.cps_1, 0),
            f(r.cps_8, 0),
            f(r.put_gbs, 2),
            f(r.get_gbs, 2),
        );
    }
    for r in &rows {
        for n in &r.notes {
            println!("  note {}: {n}", r.name);
        }
    }
    println!(
        "(median of {} rounds; p50/p99: sequential small calls; calls/s: 64 in flight on 1 \
         connection / over 8; put/get: 16 MiB, one in flight; GB = 1e9 bytes)",
        opts.rounds
    );

    let by: BTreeMap<&str, &Row> = rows.iter().map(|r| (r.name.as_str(), r)).collect();
    let get = |n: &str| by.get(n).copied();
    let me = get("rdma-rpc");
    let raw = get("raw-tcp");
    let tarpc = get("tarpc");
    let ruapc = get("ruapc");
    let bulk = get("ruapc-bulk");
    let pick = |r: Option<&Row>, k: fn(&Row) -> Option<f64>| r.and_then(k);
    // ruapc's best variant per metric.
    let ruapc_put = max_opt(pick(ruapc, |r| r.put_gbs), pick(bulk, |r| r.put_gbs));
    let ruapc_get = max_opt(pick(ruapc, |r| r.get_gbs), pick(bulk, |r| r.get_gbs));

    struct Target {
        what: &'static str,
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
            what: "small-call p50",
            peer: "raw-tcp",
            ratio: ratio(p50(me), p50(raw)),
            goal: "<= 1.3x",
            ok: |x| x <= 1.3,
        },
        Target {
            what: "small-call p50",
            peer: "tarpc",
            ratio: ratio(p50(me), p50(tarpc)),
            goal: "<= 0.4x",
            ok: |x| x <= 0.4,
        },
        Target {
            what: "small-call p50",
            peer: "ruapc",
            ratio: ratio(p50(me), p50(ruapc)),
            goal: "<= 1.0x",
            ok: |x| x <= 1.0,
        },
        Target {
            what: "calls/s, 64 in flight",
            peer: "tarpc",
            ratio: ratio(cps(me), cps(tarpc)),
            goal: ">= 2x",
            ok: |x| x >= 2.0,
        },
        Target {
            what: "calls/s, 64 in flight",
            peer: "ruapc",
            ratio: ratio(cps(me), cps(ruapc)),
            goal: ">= 3x",
            ok: |x| x >= 3.0,
        },
        Target {
            what: "16 MiB put bandwidth",
            peer: "raw-tcp",
            ratio: ratio(put(me), put(raw)),
            goal: ">= 0.85x",
            ok: |x| x >= 0.85,
        },
        Target {
            what: "16 MiB get bandwidth",
            peer: "raw-tcp",
            ratio: ratio(getbw(me), getbw(raw)),
            goal: ">= 0.85x",
            ok: |x| x >= 0.85,
        },
        Target {
            what: "16 MiB put bandwidth",
            peer: "tarpc",
            ratio: ratio(put(me), put(tarpc)),
            goal: ">= 1.5x",
            ok: |x| x >= 1.5,
        },
        Target {
            what: "16 MiB get bandwidth",
            peer: "tarpc",
            ratio: ratio(getbw(me), getbw(tarpc)),
            goal: ">= 1.5x",
            ok: |x| x >= 1.5,
        },
        Target {
            what: "16 MiB put bandwidth",
            peer: "ruapc (best)",
            ratio: ratio(put(me), ruapc_put),
            goal: "> 1x",
            ok: |x| x > 1.0,
        },
        Target {
            what: "16 MiB get bandwidth",
            peer: "ruapc (best)",
            ratio: ratio(getbw(me), ruapc_get),
            goal: "> 1x",
            ok: |x| x > 1.0,
        },
    ];
    println!();
    println!(
        "{:<24} {:<14} {:>9} {:>9}  verdict",
        "rdma-rpc vs", "peer", "ratio", "target"
    );
    println!("{}", "-".repeat(68));
    let (mut met, mut missed) = (0, 0);
    for t in &targets {
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
            "{{\n  \"rounds\": {},\n  \"secs\": {},\n  \"load_before\": {},\n  \"load_after\": {},\n  \"systems\": [\n",
            opts.rounds,
            opts.secs,
            json_str(&load_before),
            json_str(&load_after)
        );
        for (i, r) in rows.iter().enumerate() {
            let notes: Vec<String> = r.notes.iter().map(|n| json_str(n)).collect();
            let _ = writeln!(
                j,
                "    {{\"name\": {}, \"p50_us\": {}, \"p99_us\": {}, \"calls_per_sec_64x1\": {}, \"calls_per_sec_64x8\": {}, \"put_16m_gbs\": {}, \"get_16m_gbs\": {}, \"notes\": [{}]}}{}",
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
        for (i, t) in targets.iter().enumerate() {
            let _ =
                writeln!(
                j,
                "    {{\"what\": {}, \"peer\": {}, \"ratio\": {}, \"goal\": {}, \"met\": {}}}{}",
                json_str(t.what),
                json_str(t.peer),
                json_num(t.ratio),
                json_str(t.goal),
                t.ratio.map(|x| (t.ok)(x).to_string()).unwrap_or("null".into()),
                if i + 1 < targets.len() { "," } else { "" }
            );
        }
        j.push_str("  ]\n}\n");
        std::fs::write(path, j).expect("write --json file");
        eprintln!("wrote {path}");
    }
}
