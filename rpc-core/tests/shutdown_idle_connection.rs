//! A graceful shutdown reaches a connection that is idle when it begins at once: the
//! connection says go-away and closes without waiting for anything else to wake it (it used
//! to notice only at its next keep-alive tick, 5 s later by default). Virtual time (the
//! runtime's clock is paused and only moves when every task waits for a timer), so the check
//! that no time passed is exact, not a timing bound. The transport is the in-process one.

mod common;

use std::time::Duration;

use common::{request, Echo};

use futures::{SinkExt, StreamExt};
use rpc_core::mem;
use rpc_core::wire::Kind;
use rpc_core::{Config, ShutdownHandle, Transport};

#[tokio::test(start_paused = true)]
async fn an_idle_connection_hears_of_shutdown_at_once() {
    let (listener, connector) = mem::listener();
    let shutdown = ShutdownHandle::new();
    let mut config = Config::default();
    config.keepalive_interval = Duration::from_secs(5);
    let serving = tokio::spawn(rpc_core::server::serve(
        listener,
        Echo,
        config,
        shutdown.clone(),
        Default::default(),
    ));
    let (mut answers, mut requests) = connector.connect().await.unwrap().split();
    requests.send(request(1, 1)).await.unwrap();
    assert_eq!(answers.next().await.unwrap().unwrap().header.id, 1);
    // the connection now waits for frames, with nothing else due before its keep-alive tick
    let began = tokio::time::Instant::now();
    shutdown.shutdown();
    let go_away = answers.next().await.unwrap().unwrap();
    assert_eq!(go_away.header.kind, Kind::GoAway);
    assert!(answers.next().await.is_none(), "closed once drained");
    assert_eq!(
        began.elapsed(),
        Duration::ZERO,
        "no timer had to fire first"
    );
    drop(requests);
    serving.await.unwrap();
}
