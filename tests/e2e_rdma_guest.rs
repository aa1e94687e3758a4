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
