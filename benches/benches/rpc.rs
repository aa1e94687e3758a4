//! Criterion curves for rdma-rpc and its peers (see the crate docs for the workloads):
//!
//! - `latency/<system>`: one small call, one in flight;
//! - `calls_1conn/<system>/<N>` and `calls_8conn/<system>/<N>`: small calls with N in flight
//!   (reported per call, with calls/s as throughput);
//! - `put/<system>/<bytes>` and `get/<system>/<bytes>`: one bulk call, 4 KiB to 64 MiB.
//!
//! Kept quick: 10 samples, 0.3 s warm-up, 1 s measurement per point (3 to 6 minutes for
//! everything on a shared 2-core machine). Filter as usual: `cargo bench -p rdma-rpc-benches --bench rpc -- rdma-rpc`.
//! With `--features rdma`, rdma-rpc also runs over `RDMA_RPC_BENCH_RDMA`
//! (default `rdma://127.0.0.1:0`).
//!
//! After the curves it runs `compare` (this package's ratio table: every system in one run,
//! medians of 3 rounds, each issue-4 target as a ratio with its verdict), so that one
//! `cargo bench` prints the ratios; `RDMA_RPC_BENCH_COMPARE_ARGS` replaces its arguments
//! (default `--secs 0.8 --rounds 3`), `RDMA_RPC_BENCH_COMPARE=0` skips it.
#![allow(missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use rdma_rpc_benches::raw::Raw;
use rdma_rpc_benches::rdma_rpc_sys::RdmaRpc;
use rdma_rpc_benches::ruapc_sys::Ruapc;
use rdma_rpc_benches::tarpc_sys::Tarpc;
use rdma_rpc_benches::{
    connect_n, fmt_size, payload_source, run_bulk, runtime, Dir, Error, System, BANDWIDTH_SIZES,
    IN_FLIGHT,
};
use tokio::runtime::Runtime;

fn bench_system<S: System>(c: &mut Criterion, rt: &Runtime, sys: S, src: &Bytes) {
    let name = sys.name();
    let conns = rt.block_on(connect_n(&sys, 8)).expect("connect");
    if sys.does_small_calls() {
        let mut g = c.benchmark_group("latency");
        g.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(sys.run_calls(&conns[..1], 1, iters))
                    .expect("calls")
            })
        });
        g.finish();
        for (group, used, counts) in [
            ("calls_1conn", 1, &IN_FLIGHT[..]),
            ("calls_8conn", 8, &IN_FLIGHT[1..]),
        ] {
            let mut g = c.benchmark_group(group);
            g.throughput(Throughput::Elements(1));
            for &n in counts {
                g.bench_with_input(BenchmarkId::new(&name, n), &n, |b, &n| {
                    b.iter_custom(|iters| {
                        // Below ~n calls a sample would measure start-up, not steady state.
                        // (scaled back to the calls asked for).
                        let run = iters.max(n as u64 * 4);
                        let t = rt
                            .block_on(sys.run_calls(&conns[..used], n, run))
                            .expect("calls");
                        t.mul_f64(iters as f64 / run as f64)
                    })
                });
            }
            g.finish();
        }
    }
    for dir in [Dir::Put, Dir::Get] {
        let mut g = c.benchmark_group(dir.name());
        g.sampling_mode(SamplingMode::Flat);
        for &size in BANDWIDTH_SIZES.iter().filter(|&&s| s <= sys.max_payload()) {
            g.throughput(Throughput::Bytes(size as u64));
            g.bench_with_input(
                BenchmarkId::new(&name, fmt_size(size)),
                &size,
                |b, &size| {
                    b.iter_custom(|iters| {
                        rt.block_on(run_bulk(&conns[0], dir, src, size, iters))
                            .expect("bulk calls")
                    })
                },
            );
        }
        g.finish();
    }
    drop(conns);
    rt.block_on(sys.stop());
}

fn with_system<S: System>(
    c: &mut Criterion,
    src: &Bytes,
    start: impl FnOnce(Bytes) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<S, Error>>>>,
) {
    let rt = runtime();
    match rt.block_on(start(src.clone())) {
        Ok(sys) => bench_system(c, &rt, sys, src),
        Err(e) => eprintln!("skipped: {e}"),
    }
    rt.shutdown_timeout(Duration::from_secs(2));
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .configure_from_args();
    let src = payload_source();
    with_system(&mut c, &src, |s| Box::pin(Raw::start(s)));
    with_system(&mut c, &src, |s| {
        Box::pin(async move { RdmaRpc::start("tcp://127.0.0.1:0", s).await })
    });
    #[cfg(feature = "rdma")]
    with_system(&mut c, &src, |s| {
        Box::pin(async move {
            let ep = std::env::var("RDMA_RPC_BENCH_RDMA")
                .unwrap_or_else(|_| "rdma://127.0.0.1:0".to_owned());
            RdmaRpc::start(&ep, s).await
        })
    });
    with_system(&mut c, &src, |s| Box::pin(Tarpc::start(s)));
    with_system(&mut c, &src, |s| Box::pin(Ruapc::start(s, false)));
    with_system(&mut c, &src, |s| Box::pin(Ruapc::start(s, true)));
    c.final_summary();
    compare();
}

/// Runs the `compare` binary (built by cargo for this bench) and fails the bench if it fails.
fn compare() {
    if std::env::var("RDMA_RPC_BENCH_COMPARE").is_ok_and(|v| v == "0") {
        return;
    }
    let args = std::env::var("RDMA_RPC_BENCH_COMPARE_ARGS")
        .unwrap_or_else(|_| "--secs 0.8 --rounds 3".to_owned());
    println!("\nThe ratios (compare {args}):");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_compare"))
        .args(args.split_whitespace())
        .status()
        .expect("run compare");
    assert!(status.success(), "compare failed: {status}");
}
