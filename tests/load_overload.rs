//! Overload: a server limited to `L` concurrent handlers, called by `10 L` callers over several
//! connections. What the server does at the limit today: it stops reading the connection whose
//! request found no free handler slot, so callers *wait* (TCP flow control pushes back to the
//! client's `max_in_flight` window); nobody gets an error. This test shows that every call is
//! answered correctly, that no more than `L` handlers ever run, and that the process's memory
//! does not grow with the amount of work queued. Latency under overload (p99 against a bound
//! derived from the configuration) is measured by `examples/overload.rs`, not here: timing
//! goals live in the load tool, never in a test.
//!
//! Alone in its own test binary, so that no other test allocates while RSS is measured.

#![allow(missing_docs)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdma_rpc::{rdma_service, Client, Config, Endpoint, Payload, RpcError, Server};
use tokio::sync::Semaphore;

/// Handler slots on the server.
const LIMIT: usize = 8;
/// Concurrent callers: ten times the limit.
const CALLERS: usize = 10 * LIMIT;
/// Client connections the callers are spread over.
const CONNECTIONS: usize = 8;
/// Bytes each call carries each way (above the eager threshold: the bulk path).
const PAYLOAD: usize = 16 * 1024;
/// Simulated work in each handler.
const HANDLER_TIME: Duration = Duration::from_millis(1);
/// Growth of the resident set allowed after warm-up while 64 MiB more pass each way.
const RSS_SLACK: u64 = 16 << 20;
/// Bound for waiting on something that must happen; a failure, not a pacing device.
const EVENTUALLY: Duration = Duration::from_secs(30);

#[rdma_service]
pub trait Work {
    /// Sleeps `micros`, then answers `key` and `data` with every byte xored with `key`.
    async fn work(&self, key: u64, micros: u64, data: Payload) -> (u64, Payload);
    /// Holds a handler slot until the test opens the gate.
    async fn hold(&self, tag: u64) -> u64;
}

struct Counters {
    running: AtomicUsize,
    max_running: AtomicUsize,
    /// One permit per `hold` handler that started.
    held: Semaphore,
    /// Opened by the test to let `hold` handlers finish.
    gate: Semaphore,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            running: AtomicUsize::new(0),
            max_running: AtomicUsize::new(0),
            held: Semaphore::new(0),
            gate: Semaphore::new(0),
        }
    }
}

struct WorkImpl(Arc<Counters>);

struct Running(Arc<Counters>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Work for WorkImpl {
    async fn work(&self, key: u64, micros: u64, data: Payload) -> (u64, Payload) {
        let now = self.0.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.0.max_running.fetch_max(now, Ordering::SeqCst);
        let _running = Running(self.0.clone());
        tokio::time::sleep(Duration::from_micros(micros)).await;
        let k = key as u8;
        (
            key,
            Payload::from(data.iter().map(|b| b ^ k).collect::<Vec<u8>>()),
        )
    }

    async fn hold(&self, tag: u64) -> u64 {
        self.0.held.add_permits(1);
        self.0.gate.acquire().await.expect("gate").forget();
        tag
    }
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

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

/// Every caller makes `calls` calls one after another; all must come back right.
async fn round(clients: &[WorkClient], calls: usize, round: u64) {
    let tasks: Vec<_> = (0..CALLERS)
        .map(|caller| {
            let client = clients[caller % clients.len()].clone();
            tokio::spawn(async move {
                for i in 0..calls {
                    let key = (round << 32) | ((caller as u64) << 16) | i as u64;
                    let data = pattern(PAYLOAD, key);
                    let (k, back) = client
                        .work(key, HANDLER_TIME.as_micros() as u64, data.clone().into())
                        .await
                        .unwrap_or_else(|e| panic!("call {key:#x} failed under overload: {e}"));
                    assert_eq!(k, key, "answer to another call");
                    let want: Vec<u8> = data.iter().map(|b| b ^ key as u8).collect();
                    assert!(back == want, "call {key:#x}: wrong bytes");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("caller");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_waits_answers_correctly_and_bounds_memory() {
    let counters = Arc::new(Counters::default());
    let mut config = Config::default();
    config.max_concurrent_handlers = LIMIT;
    let bind: Endpoint = "tcp://127.0.0.1:0".parse().unwrap();
    let server = Server::bind_with(&bind, config).await.expect("bind");
    let ep = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let stats = server.stats();
    let serving = tokio::spawn(server.serve(WorkServer::new(WorkImpl(counters.clone()))));

    let mut clients = Vec::new();
    for _ in 0..CONNECTIONS {
        let c = Client::connect(&ep).await.expect("connect");
        clients.push(WorkClient::from_client(c));
    }

    // Warm-up: allocator arenas, buffers and tasks reach their working size.
    round(&clients, 5, 0).await;
    let before = rss_bytes();
    // 80 callers x 50 calls x 16 KiB each way: 64 MiB through a server that runs 8 at once.
    for r in 1..=5 {
        round(&clients, 10, r).await;
    }
    let after = rss_bytes();
    let grown = after.saturating_sub(before);
    println!(
        "overload: {CALLERS} callers, limit {LIMIT}: RSS {} KiB after warm-up, {} KiB after \
         4000 more calls (+{} KiB); at most {} handlers ran at once",
        before >> 10,
        after >> 10,
        grown >> 10,
        counters.max_running.load(Ordering::SeqCst)
    );

    let max = counters.max_running.load(Ordering::SeqCst);
    assert!(
        max <= LIMIT,
        "{max} handlers ran at once; the limit is {LIMIT}"
    );
    assert_eq!(
        max, LIMIT,
        "the server was never saturated: the test tests nothing"
    );
    assert!(
        stats.handlers.load(Ordering::SeqCst) == 0,
        "handlers still counted as running after every call was answered"
    );
    assert!(
        grown < RSS_SLACK,
        "RSS grew by {grown} bytes (from {before} to {after}) under overload; allowed {RSS_SLACK}"
    );

    // A caller that cannot wait says so with a deadline, and gets a clear error (not a hang)
    // while every slot is taken; the server then carries on.
    let holders: Vec<_> = (0..LIMIT as u64)
        .map(|tag| {
            let c = clients[0].clone();
            tokio::spawn(async move { c.hold(tag).await })
        })
        .collect();
    let held = tokio::time::timeout(EVENTUALLY, counters.held.acquire_many(LIMIT as u32))
        .await
        .expect("every slot gets taken");
    held.expect("held").forget();
    let impatient = clients[1].client().with_timeout(Duration::from_millis(200));
    let e = tokio::time::timeout(
        EVENTUALLY,
        WorkClient::from_client(impatient).work(1, 0, Payload::from(vec![1u8; 16])),
    )
    .await
    .expect("a caller with a deadline does not hang on a saturated server")
    .unwrap_err();
    assert!(matches!(e, RpcError::DeadlineExceeded), "{e}");
    counters.gate.add_permits(LIMIT);
    for (tag, h) in holders.into_iter().enumerate() {
        assert_eq!(h.await.unwrap().unwrap(), tag as u64);
    }
    let (k, back) = clients[1]
        .work(7, 0, Payload::from(vec![3u8; 4]))
        .await
        .expect("the server serves on after the saturation");
    assert_eq!((k, back == vec![4u8; 4]), (7, true));

    shutdown.shutdown();
    tokio::time::timeout(EVENTUALLY, serving)
        .await
        .expect("server drains")
        .expect("serve task")
        .expect("serve");
}
