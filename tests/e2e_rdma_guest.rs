//! The end-to-end suite over the RDMA transport, on a real device. Built only with the
//! `guest-tests` feature, by scripts/rdma-test.sh, which runs it in the QEMU guest on rxe0 and
//! siw0 (RDMA_RPC_TEST_DEVICE, RDMA_RPC_TEST_IP). Fails when the named device is missing.

mod suite;

use rdma_rpc::Endpoint;

fn ep() -> Endpoint {
    let dev = std::env::var("RDMA_RPC_TEST_DEVICE")
        .expect("RDMA_RPC_TEST_DEVICE must name the RDMA device (run scripts/rdma-test.sh)");
    let ip = std::env::var("RDMA_RPC_TEST_IP").expect("RDMA_RPC_TEST_IP must be set");
    format!("rdma://{ip}:0?device={dev}").parse().unwrap()
}

transport_suite!(ep);

/// The same suite with every rendezvous by sender-push (RDMA WRITE into granted buffers)
/// instead of the default direction.
mod push {
    use super::suite;
    use crate::transport_suite;
    use rdma_rpc::Endpoint;

    fn ep_push() -> Endpoint {
        let ep = super::ep().to_string();
        format!("{ep}&rendezvous=push").parse().unwrap()
    }

    transport_suite!(ep_push);
}

/// The same suite against servers whose connections share one receive queue
/// (`srq_slots`, see transport-rdma's docs): windows lent from one queue of 256 slots.
mod srq {
    use super::suite;
    use crate::transport_suite;
    use rdma_rpc::Endpoint;

    fn ep_srq() -> Endpoint {
        let ep = super::ep().to_string();
        format!("{ep}&srq_slots=256").parse().unwrap()
    }

    transport_suite!(ep_srq);
}

/// The same suite with both ends polling in bursts of 200 µs (`poll_burst_us`, see
/// transport-rdma's `RdmaOptions::poll_burst`) within a fixed 2 ms spin window, as the
/// busy-poll latency figures run: deadlines, cancellation, flow control, shutdown and a
/// server killed mid-call all hold while the server's driver, and a client's caller waiting
/// alone for its answer, hand back to their runtime only every 200 µs.
mod burst {
    use super::suite;
    use crate::transport_suite;
    use rdma_rpc::Endpoint;

    fn ep_burst() -> Endpoint {
        let ep = super::ep().to_string();
        format!("{ep}&busy_poll_us=2000&poll_burst_us=200")
            .parse()
            .unwrap()
    }

    transport_suite!(ep_burst);
}

/// The facade's pool counters on the client side ([`rdma_rpc::Client::rdma_pools`]): they
/// follow the client across a reconnection, and once the client is dropped and its server gone,
/// every buffer of both connections is back and every region freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_pools_through_the_facade() {
    use rdma_rpc::{Config, Payload};
    suite::log_from_env();
    let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let first = suite::Doomed::start(&ep(), Config::default());
    let endpoint = first.endpoint.clone();
    let client = suite::connect(&endpoint).await;
    let pools = client
        .client()
        .rdma_pools()
        .expect("a client over RDMA counts its pools");
    let back = client.echo(Payload::from(data.clone())).await.unwrap();
    assert!(back == data, "1 MiB echo by rendezvous");
    let one = pools.counts();
    assert!(
        one.leased > 0 && one.live_regions >= 2,
        "receive slots and the rendezvous pool registered: {one:?}"
    );

    drop(back);
    first.kill();
    tokio::time::timeout(suite::EVENTUALLY, client.client().closed())
        .await
        .expect("the client sees its server die");
    // the dead connection gives everything back while the client lives on
    returned(&pools, "after the first server died").await;
    let second = suite::Doomed::start(&endpoint, Config::default());
    let back = client.echo(Payload::from(data.clone())).await.unwrap();
    assert!(back == data, "1 MiB echo after reconnecting");
    let two = pools.counts();
    assert!(
        two.leased > one.leased && two.live_regions >= 2,
        "the new connection's pools are counted by the same monitor: {one:?} then {two:?}"
    );

    drop(back);
    drop(client);
    second.kill();
    let end = returned(&pools, "after the client was dropped").await;
    eprintln!(
        "device {}: client pools over two connections, after the client was dropped: {end:?}",
        std::env::var("RDMA_RPC_TEST_DEVICE").unwrap_or_default()
    );
}

/// Waits until every buffer counted by `pools` is back and every region freed.
async fn returned(pools: &rdma_rpc::PoolMonitor, when: &str) -> rdma_rpc::PoolCounts {
    tokio::time::timeout(suite::EVENTUALLY, async {
        loop {
            let c = pools.counts();
            if c.outstanding() == 0 && c.live_regions == 0 {
                return c;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("client pools not returned {when}: {:?}", pools.counts()))
}
