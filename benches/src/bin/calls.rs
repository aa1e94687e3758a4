//! A fixed number of small calls of one system, for profilers (callgrind, perf, strace):
//! nothing else runs in the process, and the payload source is small, so setup costs little.
//!
//! ```text
//! cargo build --release -p rdma-rpc-benches --bin calls
//! valgrind --tool=callgrind --callgrind-out-file=cg.out \
//!     target/release/calls --system rdma-rpc --calls 20000
//! strace -f -c target/release/calls --system rdma-rpc --calls 20000
//! ```
//!
//! Options: `--system raw-tcp|rdma-rpc|tarpc|ruapc` (default rdma-rpc), `--calls N` (default
//! 20000, after 1000 warm-up calls), `--in-flight K` (default 1: sequential round trips;
//! more runs K tasks), `--connections C` (default 1; task i uses connection i % C),
//! `--runtime multi|current` (default multi: the
//! 2-worker runtime the benches use; `current` puts client and server on one thread),
//! `--put SIZE` / `--get SIZE` (bulk calls of SIZE bytes, one in flight, instead of small
//! calls; warm-up: 10 calls).
//! Prints the time per call; run it twice with different `--calls` and subtract to get the
//! profiler's cost per call without the setup.
#![allow(missing_docs)]

use std::time::Instant;

use bytes::Bytes;
use rdma_rpc_benches::raw::Raw;
use rdma_rpc_benches::rdma_rpc_sys::RdmaRpc;
use rdma_rpc_benches::ruapc_sys::Ruapc;
use rdma_rpc_benches::tarpc_sys::Tarpc;
use rdma_rpc_benches::{connect_n, parse_size, run_bulk, Conn, Dir, Error, System};

struct Opts {
    system: String,
    calls: u64,
    in_flight: usize,
    connections: usize,
    current: bool,
    bulk: Option<(Dir, usize)>,
}

fn parse() -> Opts {
    let mut o = Opts {
        system: "rdma-rpc".into(),
        calls: 20_000,
        in_flight: 1,
        connections: 1,
        current: false,
        bulk: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut v = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--system" => o.system = v(),
            "--calls" => o.calls = v().parse().expect("--calls N"),
            "--in-flight" => o.in_flight = v().parse().expect("--in-flight K"),
            "--connections" => o.connections = v().parse().expect("--connections C"),
            "--runtime" => o.current = v() == "current",
            "--put" => o.bulk = Some((Dir::Put, parse_size(&v()).expect("--put SIZE"))),
            "--get" => o.bulk = Some((Dir::Get, parse_size(&v()).expect("--get SIZE"))),
            "--bench" => {}
            other => panic!("unknown argument {other:?}"),
        }
    }
    o
}

async fn run<S: System>(sys: Result<S, Error>, o: &Opts, src: &Bytes) -> Result<(), Error> {
    let sys = sys?;
    let conns = connect_n(&sys, o.connections.max(1)).await?;
    // What every call moves around (a future is moved when it is awaited inside another).
    let future_bytes = std::mem::size_of_val(&conns[0].small());
    let t = Instant::now();
    let took = match o.bulk {
        None => {
            sys.run_calls(&conns, o.in_flight, 1_000).await?;
            sys.run_calls(&conns, o.in_flight, o.calls).await?
        }
        Some((dir, size)) => {
            run_bulk(&conns[0], dir, src, size, 10).await?;
            run_bulk(&conns[0], dir, src, size, o.calls).await?
        }
    };
    let what = match o.bulk {
        None => format!("{} in flight on {} connection(s)", o.in_flight, conns.len()),
        Some((dir, size)) => format!(
            "{} of {size} bytes: {:.3} GB/s",
            dir.name(),
            (o.calls * size as u64) as f64 / took.as_secs_f64() / 1e9
        ),
    };
    println!(
        "{}: {} calls, {what}: {:.2} us per call ({:.0} calls/s; {:.2} s wall; \
         a small-call future is {future_bytes} bytes)",
        sys.name(),
        o.calls,
        took.as_secs_f64() * 1e6 / o.calls as f64,
        o.calls as f64 / took.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    drop(conns);
    sys.stop().await;
    Ok(())
}

fn main() {
    let o = parse();
    let rt = if o.current {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    } else {
        rdma_rpc_benches::runtime()
    };
    let src = match o.bulk {
        Some((_, size)) => Bytes::from(vec![7u8; size.max(4096)]),
        None => Bytes::from(vec![7u8; 4096]),
    };
    let r = rt.block_on(async {
        match o.system.as_str() {
            "raw-tcp" => run(Raw::start(src.clone()).await, &o, &src).await,
            "rdma-rpc" => {
                run(
                    RdmaRpc::start("tcp://127.0.0.1:0", src.clone()).await,
                    &o,
                    &src,
                )
                .await
            }
            "tarpc" => run(Tarpc::start(src.clone()).await, &o, &src).await,
            "ruapc" => run(Ruapc::start(src.clone(), false).await, &o, &src).await,
            other => Err(format!("unknown system {other:?}")),
        }
    });
    if let Err(e) = r {
        eprintln!("calls: {e}");
        std::process::exit(1);
    }
}
