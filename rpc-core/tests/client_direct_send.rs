//! A client on a transport with a direct sender: the caller of a lone call posts its request
//! through it when the link is idle, past the writer; a busy link, a refused post, or other
//! calls in flight leave the request to the writer as before. Answers still come through the
//! reader either way. A call whose arguments do not encode fails at once and sends nothing; one
//! that waits for a credit keeps its deadline and gives the credit back.
//!
//! The transport is an in-process fake: the writer and the direct sender each put what they
//! are given on a channel of their own, and the test plays the server.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::{ChanReader, ChanWriter, FakeDirect};
use rpc_core::wire::{Header, Kind, Message};
use rpc_core::{Bincode, Client, Config, DirectSend, Transport};
use tokio::sync::mpsc;

/// The client's end of the in-process fake.
struct Fake {
    written: mpsc::UnboundedSender<Message>,
    incoming: mpsc::UnboundedReceiver<Message>,
    direct: Arc<FakeDirect>,
}

impl Transport for Fake {
    type Reader = ChanReader;
    type Writer = ChanWriter;
    fn split(self) -> (ChanReader, ChanWriter) {
        (ChanReader(self.incoming), ChanWriter(self.written))
    }
    fn peer(&self) -> String {
        "fake".into()
    }
    fn direct_send(&self) -> Option<Arc<dyn DirectSend>> {
        Some(self.direct.clone())
    }
}

/// The test's end: the server's side of the fake.
struct Server {
    written: mpsc::UnboundedReceiver<Message>,
    direct_sent: mpsc::UnboundedReceiver<Message>,
    reply: mpsc::UnboundedSender<Message>,
    direct: Arc<FakeDirect>,
}

impl Server {
    /// Answers `req` (an echo of its body) through the client's reader.
    fn answer(&self, req: &Message) {
        let mut header = Header::new(Kind::Response, req.header.id);
        header.method = req.header.method;
        self.reply
            .send(Message {
                header,
                body: req.body.clone(),
                attachments: Default::default(),
            })
            .unwrap();
    }
}

fn connect() -> (Client, Server) {
    connect_with(Config::default())
}

fn connect_with(config: Config) -> (Client, Server) {
    let (written_tx, written) = mpsc::unbounded_channel();
    let (reply, incoming) = mpsc::unbounded_channel();
    let (direct, direct_sent) = FakeDirect::new();
    let direct = Arc::new(direct);
    let client = Client::new(
        Fake {
            written: written_tx,
            incoming,
            direct: direct.clone(),
        },
        config,
    );
    (
        client,
        Server {
            written,
            direct_sent,
            reply,
            direct,
        },
    )
}

/// The next message on `rx`; fails the test (rather than hang) if none comes.
async fn next(rx: &mut mpsc::UnboundedReceiver<Message>) -> Message {
    tokio::time::timeout(std::time::Duration::from_secs(10), rx.recv())
        .await
        .expect("a message on this path")
        .expect("channel open")
}

fn call(
    client: &Client,
    n: u64,
) -> impl std::future::Future<Output = Result<u64, rpc_core::RpcError>> {
    client.call::<Bincode, u64, u64>(1, "echo", &n)
}

/// A lone call of `n` that goes directly, answered by the test: it must come back as `n`.
async fn direct_round_trip(client: &Client, server: &mut Server, n: u64) {
    let pending = tokio::spawn(call(client, n));
    let req = next(&mut server.direct_sent).await;
    server.answer(&req);
    assert_eq!(pending.await.unwrap().unwrap(), n);
}

#[tokio::test(flavor = "current_thread")]
async fn a_lone_call_on_an_idle_link_goes_directly() {
    let (client, mut server) = connect();
    for n in 0..10u64 {
        let pending = tokio::spawn(call(&client, n));
        let req = next(&mut server.direct_sent).await;
        assert_eq!(req.header.kind, Kind::Request);
        server.answer(&req);
        assert_eq!(pending.await.unwrap().unwrap(), n);
    }
    assert!(
        server.written.try_recv().is_err(),
        "nothing went through the writer"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_busy_link_or_a_refused_post_leaves_the_request_to_the_writer() {
    let (client, mut server) = connect();
    server.direct.ready.store(false, Ordering::SeqCst);
    let pending = tokio::spawn(call(&client, 1));
    let req = next(&mut server.written).await;
    server.answer(&req);
    assert_eq!(pending.await.unwrap().unwrap(), 1);

    server.direct.ready.store(true, Ordering::SeqCst);
    server.direct.accept.store(false, Ordering::SeqCst);
    let pending = tokio::spawn(call(&client, 2));
    let req = next(&mut server.written).await;
    server.answer(&req);
    assert_eq!(pending.await.unwrap().unwrap(), 2);
    assert!(server.direct_sent.try_recv().is_err());
}

#[tokio::test(flavor = "current_thread")]
async fn with_another_call_in_flight_the_request_goes_to_the_writer() {
    let (client, mut server) = connect();
    // spawned in this order on one thread: the first is alone when it sends, the second not
    let first = tokio::spawn(call(&client, 1));
    let second = tokio::spawn(call(&client, 2));
    let direct = next(&mut server.direct_sent).await;
    let written = next(&mut server.written).await;
    server.answer(&written);
    server.answer(&direct);
    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(second.await.unwrap().unwrap(), 2);
    assert!(server.direct_sent.try_recv().is_err());
    assert!(server.written.try_recv().is_err());
}

/// Arguments that serde cannot encode.
struct Unencodable;

impl serde::Serialize for Unencodable {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("this value does not encode"))
    }
}

#[tokio::test(flavor = "current_thread")]
async fn arguments_that_do_not_encode_fail_the_call_and_send_nothing() {
    let (client, mut server) = connect();
    let outcome = client
        .call::<Bincode, Unencodable, u64>(1, "echo", &Unencodable)
        .await;
    assert!(
        matches!(outcome, Err(rpc_core::RpcError::Codec(_))),
        "expected a codec error, got {outcome:?}"
    );
    assert_eq!(client.in_flight(), 0, "no call was registered");
    assert!(server.direct_sent.try_recv().is_err());
    assert!(server.written.try_recv().is_err());
    // the connection goes on
    direct_round_trip(&client, &mut server, 7).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_call_that_waits_for_a_credit_keeps_its_deadline_and_leaks_nothing() {
    let mut config = Config::default();
    config.max_in_flight = 1;
    let (client, mut server) = connect_with(config);
    // the one credit, held by a call the server has not answered yet
    let first = tokio::spawn(call(&client, 1));
    let req = next(&mut server.direct_sent).await;
    // a second call waits for the credit, and its deadline comes first
    let second = client
        .with_timeout(std::time::Duration::from_millis(50))
        .call::<Bincode, u64, u64>(1, "echo", &2)
        .await;
    assert!(
        matches!(second, Err(rpc_core::RpcError::DeadlineExceeded)),
        "expected DeadlineExceeded, got {second:?}"
    );
    assert!(server.direct_sent.try_recv().is_err(), "it sent nothing");
    assert!(server.written.try_recv().is_err(), "it sent nothing");
    assert_eq!(client.in_flight(), 1);
    server.answer(&req);
    assert_eq!(first.await.unwrap().unwrap(), 1);
    // the credit came back (a leaked one would leave the next call waiting for ever)
    direct_round_trip(&client, &mut server, 3).await;
    // and a call that waited for the credit goes once it is free
    let first = tokio::spawn(call(&client, 4));
    let req = next(&mut server.direct_sent).await;
    let waiting = tokio::spawn(call(&client, 5));
    tokio::task::yield_now().await;
    assert!(
        server.direct_sent.try_recv().is_err(),
        "it waits for the credit"
    );
    server.answer(&req);
    assert_eq!(first.await.unwrap().unwrap(), 4);
    let req = next(&mut server.direct_sent).await;
    server.answer(&req);
    assert_eq!(waiting.await.unwrap().unwrap(), 5);
    // a call dropped while in flight gives its credit back too
    let mut dropped = Box::pin(call(&client, 6));
    assert!(futures::poll!(&mut dropped).is_pending());
    let req = next(&mut server.direct_sent).await;
    drop(dropped);
    let cancel = next(&mut server.written).await;
    assert_eq!(cancel.header.kind, Kind::Cancel);
    assert_eq!(cancel.header.id, req.header.id);
    direct_round_trip(&client, &mut server, 7).await;
}

/// A call's future is moved by whoever awaits it (an `async fn` that awaits it moves it into
/// its own state, and so on up): each byte is copied each time. One named future for the
/// whole call took it from 576 bytes (an `async` block around an inner future, with a tracing
/// wrapper) to 336 on this project's toolchain; see docs/latency.md.
#[tokio::test(flavor = "current_thread")]
async fn a_calls_future_stays_small() {
    let (client, _server) = connect();
    let size = std::mem::size_of_val(&call(&client, 1));
    assert!(size <= 384, "a call's future is {size} bytes");
}
