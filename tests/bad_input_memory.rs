//! Bad input does not grow the server's memory. Alone in its own test binary, so that no other
//! test's allocations run in the same process while RSS is measured.

mod suite;

use rdma_rpc::core::wire::Kind;
use rdma_rpc::{Config, Endpoint};
use tokio::io::AsyncWriteExt;

use suite::raw::{connect as raw, frame, read_to_close};

fn ep() -> Endpoint {
    "tcp://127.0.0.1:0".parse().unwrap()
}

/// Feeding the server hundreds of bad connections does not grow its memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_does_not_grow_memory() {
    let srv = suite::start(&ep(), Config::default()).await;
    let good = suite::connect(&srv.endpoint).await;
    let add = rdma_rpc::__private::method_id("Probe.add");
    let bad_inputs: Vec<Vec<u8>> = vec![
        b"garbage garbage garbage garbage garbage".to_vec(),
        {
            let mut f = frame(Kind::Request, 9, add, &[]);
            f[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
            f
        },
        {
            let mut f = frame(Kind::Request, 9, add, &[1, 2, 3]);
            f[6] = 0xff; // 255 attachments claimed
            f
        },
        frame(Kind::Request, 9, add, &[0xff; 64])[..50].to_vec(),
    ];
    let round = |n: usize| {
        let bad_inputs = bad_inputs.clone();
        let ep = srv.endpoint.clone();
        async move {
            for i in 0..n {
                let mut s = raw(&ep).await;
                s.write_all(&bad_inputs[i % bad_inputs.len()])
                    .await
                    .unwrap();
                s.shutdown().await.ok();
                read_to_close(&mut s).await;
            }
        }
    };
    round(100).await;
    let before = rss_bytes();
    round(400).await;
    let after = rss_bytes();
    assert!(
        after < before + (16 << 20),
        "RSS grew from {before} to {after} bytes over 400 bad connections"
    );
    assert_eq!(good.add(1, 1).await.unwrap(), 2);
    srv.shutdown.shutdown();
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}
