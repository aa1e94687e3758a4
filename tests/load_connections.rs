//! Many connections: 1,000 client connections to one TCP server, all idle, then each makes one
//! call. Every call is answered correctly, and the memory an idle connection costs (client and
//! server side together, both in this process) stays under a bound, so that a regression in
//! per-connection buffers or tasks fails here.
//!
//! Alone in its own test binary, so that no other test allocates while RSS is measured.
#![allow(missing_docs)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::join_all;
use rdma_rpc::{rdma_service, Endpoint, Server};

const CONNECTIONS: usize = 1000;
/// File descriptors this test needs: two sockets a connection, plus the runtime's and
/// the test harness's own.
const FDS_NEEDED: u64 = 2 * CONNECTIONS as u64 + 100;
/// Resident memory one idle connection may cost, both ends together. Measured (debug build,
/// three runs) at 29.8 KiB after connecting and 30-33 KiB after one call each (the 64 KiB
/// read buffers are reserved but only partly touched); the bound is ~3x, so that a
/// regression fails and noise does not.
const IDLE_BOUND: u64 = 96 * 1024;
/// The same after each connection made one call (the buffers it touched stay resident).
const USED_BOUND: u64 = 100 * 1024;
/// Bound for waiting on something that must happen; a failure, not a pacing device.
const EVENTUALLY: Duration = Duration::from_secs(60);

#[rdma_service]
pub trait Count {
    /// `n + 1`.
    async fn next(&self, n: u64) -> u64;
}

struct CountImpl;

impl Count for CountImpl {
    async fn next(&self, n: u64) -> u64 {
        n + 1
    }
}

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

/// The soft limit on open files, from `/proc/self/limits` (`None`: unlimited).
fn open_files_soft_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("'Max open files' in /proc/self/limits");
    let soft = line["Max open files".len()..]
        .split_whitespace()
        .next()
        .expect("a soft limit");
    match soft {
        "unlimited" => None,
        n => Some(n.parse().expect("a number")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_idle_connections_then_one_call_each() {
    if let Some(soft) = open_files_soft_limit() {
        assert!(
            soft >= FDS_NEEDED,
            "this test opens {CONNECTIONS} connections (both ends in this process) and needs \
             {FDS_NEEDED} file descriptors, but the soft limit is {soft}: raise it with \
             `ulimit -n {FDS_NEEDED}` (or more) and run it again"
        );
    }
    let bind: Endpoint = "tcp://127.0.0.1:0".parse().unwrap();
    let server = Server::bind(&bind).await.expect("bind");
    let ep = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let stats = server.stats();
    let serving = tokio::spawn(server.serve(CountServer::new(CountImpl)));

    // Warm-up: a few connections that call and go away, so that the runtime, the allocator
    // and the code paths are at their working size before measuring.
    for i in 0..20 {
        let c = CountClient::connect(&ep).await.expect("connect");
        assert_eq!(c.next(i).await.unwrap(), i + 1);
    }
    let before = rss_bytes();

    // Connect 1,000 clients, 100 at a time. A client is back from `connect` once the server
    // answered its greeting, so the server side of every connection is set up by then.
    let mut clients = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS / 100 {
        let batch = join_all((0..100).map(|_| CountClient::connect(&ep))).await;
        for c in batch {
            clients.push(c.expect("connect"));
        }
    }
    let connections = stats.connections.load(Ordering::SeqCst);
    assert!(
        connections >= CONNECTIONS,
        "the server serves {connections} connections, expected at least {CONNECTIONS}"
    );
    let idle = rss_bytes();

    // Each makes one call, all at once.
    let answers = tokio::time::timeout(
        EVENTUALLY,
        join_all(
            clients
                .iter()
                .enumerate()
                .map(|(i, c)| async move { (i as u64, c.next(i as u64 * 7).await) }),
        ),
    )
    .await
    .expect("1,000 calls are answered");
    for (i, r) in answers {
        let n = r.unwrap_or_else(|e| panic!("call on connection {i} failed: {e}"));
        assert_eq!(n, i * 7 + 1, "connection {i}: wrong answer");
    }
    let used = rss_bytes();

    let per_idle = idle.saturating_sub(before) / CONNECTIONS as u64;
    let per_used = used.saturating_sub(before) / CONNECTIONS as u64;
    println!(
        "{CONNECTIONS} connections (both ends in this process): RSS {} KiB before, {} KiB idle, \
         {} KiB after one call each: {:.1} KiB a connection idle (bound {} KiB), {:.1} KiB after \
         a call (bound {} KiB)",
        before >> 10,
        idle >> 10,
        used >> 10,
        per_idle as f64 / 1024.0,
        IDLE_BOUND >> 10,
        per_used as f64 / 1024.0,
        USED_BOUND >> 10,
    );
    assert!(
        per_idle < IDLE_BOUND,
        "an idle connection costs {per_idle} bytes of RSS; the bound is {IDLE_BOUND}"
    );
    assert!(
        per_used < USED_BOUND,
        "a connection that made one call costs {per_used} bytes of RSS; the bound is \
         {USED_BOUND}"
    );

    // A graceful shutdown closes all of them and returns.
    shutdown.shutdown();
    tokio::time::timeout(EVENTUALLY, serving)
        .await
        .expect("the server drains 1,000 connections")
        .expect("serve task")
        .expect("serve");
    for c in &clients {
        tokio::time::timeout(EVENTUALLY, c.client().closed())
            .await
            .expect("every client sees its connection close");
    }
}
