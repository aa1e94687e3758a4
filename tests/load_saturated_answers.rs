//! At its handler limit the server stops reading a connection whose next request finds no free
//! slot. The answers of that connection's calls that already finished must still go out: a
//! server that held them back until a slot freed added up to a whole queue's wait to calls
//! that were done (under overload, p99 doubled: `examples/overload.rs`). This shows it with
//! events, not timing: a finished call is answered while its connection waits for a slot that
//! another connection's handler holds.
#![allow(missing_docs)]

use std::collections::HashSet;
use std::time::Duration;

use rdma_rpc::{rdma_service, Client, Config, Endpoint, Server};
use tokio::sync::{mpsc, watch, Mutex};

/// Bound for waiting on something that must happen; a failure, not a pacing device.
const EVENTUALLY: Duration = Duration::from_secs(30);

#[rdma_service]
pub trait Gated {
    /// Reports its start, waits until the test releases `tag`, then works `micros` more.
    async fn hold(&self, tag: u64, micros: u64) -> u64;
}

struct GatedImpl {
    started: mpsc::UnboundedSender<u64>,
    released: watch::Receiver<HashSet<u64>>,
}

impl Gated for GatedImpl {
    async fn hold(&self, tag: u64, micros: u64) -> u64 {
        let _ = self.started.send(tag);
        let mut released = self.released.clone();
        // An error means the test is over (it dropped the gates): just finish.
        let _ = released.wait_for(|r| r.contains(&tag)).await;
        tokio::time::sleep(Duration::from_micros(micros)).await;
        tag
    }
}

struct Gates {
    started: Mutex<mpsc::UnboundedReceiver<u64>>,
    release: watch::Sender<HashSet<u64>>,
}

impl Gates {
    fn release(&self, tag: u64) {
        self.release.send_modify(|r| {
            r.insert(tag);
        });
    }

    async fn next_started(&self) -> u64 {
        tokio::time::timeout(EVENTUALLY, self.started.lock().await.recv())
            .await
            .expect("a handler starts")
            .expect("server alive")
    }
}

/// The answer of a call that finished: it must arrive even while its connection waits.
async fn answered(call: tokio::task::JoinHandle<Result<u64, rdma_rpc::RpcError>>, tag: u64) {
    match tokio::time::timeout(EVENTUALLY, call).await {
        Ok(Ok(Ok(t))) => assert_eq!(t, tag, "answer to another call"),
        Ok(Ok(Err(e))) => panic!(
            "call {tag} finished but failed with {e}: its answer was held back while its \
             connection waited for a handler slot (until keep-alive gave up on it?)"
        ),
        Ok(Err(e)) => panic!("task: {e}"),
        Err(_) => panic!(
            "call {tag} finished but its answer was held back while its connection waited \
             for a handler slot"
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_answers_go_out_while_the_connection_waits_for_a_slot() {
    let (started_tx, started_rx) = mpsc::unbounded_channel();
    let (release, released) = watch::channel(HashSet::new());
    let gates = Gates {
        started: Mutex::new(started_rx),
        release,
    };
    let mut config = Config::default();
    config.max_concurrent_handlers = 1;
    let bind: Endpoint = "tcp://127.0.0.1:0".parse().unwrap();
    let server = Server::bind_with(&bind, config).await.expect("bind");
    let ep = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let serving = tokio::spawn(server.serve(GatedServer::new(GatedImpl {
        started: started_tx,
        released,
    })));
    let a = GatedClient::from_client(Client::connect(&ep).await.expect("connect"));
    let b = GatedClient::from_client(Client::connect(&ep).await.expect("connect"));
    let call = |c: &GatedClient, tag: u64, micros: u64| {
        let c = c.clone();
        tokio::spawn(async move { c.hold(tag, micros).await })
    };

    // Which waiting connection gets a freed slot is the semaphore's (FIFO) business and not
    // observable in advance; each attempt sees, from the handlers that start, whether it set
    // up the case, and tries again if not. The case comes up on nearly every attempt.
    let mut reached = false;
    for attempt in 0..20u64 {
        let t = |i: u64| attempt * 10 + i;
        // B holds the only slot; then A and B each queue a call.
        let x1 = call(&b, t(1), 0);
        assert_eq!(gates.next_started().await, t(1));
        let a1 = call(&a, t(2), 20_000);
        let x2 = call(&b, t(3), 0);
        gates.release(t(1));
        // If A's call gets the slot, B's connection waits for one with x2 while x1 is done:
        // x1's answer must arrive all the same.
        answered(x1, t(1)).await;
        if gates.next_started().await != t(2) {
            // B's call got the slot first: not the case; clean up and try again.
            for i in 2..=3 {
                gates.release(t(i));
            }
            assert_eq!(gates.next_started().await, t(2));
            a1.await.unwrap().unwrap();
            x2.await.unwrap().unwrap();
            continue;
        }
        // a1 runs; B waits for the slot with x2. A sends a2, which must wait too.
        let a2 = call(&a, t(4), 0);
        gates.release(t(2));
        if gates.next_started().await != t(3) {
            for i in 3..=4 {
                gates.release(t(i));
            }
            assert_eq!(gates.next_started().await, t(3));
            a1.await.unwrap().unwrap();
            a2.await.unwrap().unwrap();
            x2.await.unwrap().unwrap();
            continue;
        }
        // x2 holds the slot until released; A's connection waits for it with a2. a1 is done,
        // and its answer must arrive now, not when x2 lets go.
        answered(a1, t(2)).await;
        gates.release(t(3));
        gates.release(t(4));
        assert_eq!(x2.await.unwrap().unwrap(), t(3));
        assert_eq!(a2.await.unwrap().unwrap(), t(4));
        reached = true;
        break;
    }
    assert!(reached, "20 attempts never set up the case under test");
    shutdown.shutdown();
    tokio::time::timeout(EVENTUALLY, serving)
        .await
        .expect("server drains")
        .unwrap()
        .unwrap();
}
