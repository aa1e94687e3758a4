//! Where there is no RDMA (no rdma-core library, or no device), every entry point returns
//! `RdmaError::Unavailable`: no panic, no abort. Runs with plain `cargo test` on such machines
//! (the development and CI hosts); on a machine with RDMA devices it checks listing only.

use std::time::Duration;

use transport_rdma::{devices, is_available, RdmaConnection, RdmaListener, RdmaOptions};

#[tokio::test]
async fn no_rdma_is_an_error_value() {
    match devices() {
        Ok(list) => {
            assert!(!list.is_empty(), "Ok means at least one device");
            assert!(is_available());
            println!(
                "RDMA devices here: {list:?} (the no-RDMA path is not exercised on this machine)"
            );
        }
        Err(e) => {
            assert!(e.is_unavailable(), "expected Unavailable, got {e:?}");
            assert!(!is_available());
            println!("no RDMA here, as expected: {e}");
            let addr = "127.0.0.1:20999".parse().unwrap();
            let err = RdmaListener::bind(addr, RdmaOptions::default())
                .expect_err("bind must fail without RDMA");
            assert!(
                err.is_unavailable(),
                "bind: expected Unavailable, got {err:?}"
            );
            let opts = RdmaOptions {
                connect_timeout: Duration::from_secs(2),
                ..RdmaOptions::default()
            };
            let err = RdmaConnection::connect(addr, opts)
                .await
                .expect_err("connect must fail without RDMA");
            assert!(
                err.is_unavailable(),
                "connect: expected Unavailable, got {err:?}"
            );
        }
    }
}
