//! The server's run-to-completion path: on a transport with a receive shortcut and a direct
//! sender (RDMA's completion dispatch), a request whose handler finishes on its first poll is
//! answered where it arrives, without the connection task; everything else still goes
//! through the connection task: requests on a busy link, answers that cannot go directly,
//! handlers that wait (which can still be cancelled), and requests after shutdown has begun
//! (refused). Requests taken there count as traffic for the keep-alive.
//!
//! The transport is an in-process fake built on [`rpc_core::mem`]: the test plays the
//! client, offering each frame to the shortcut first as a transport's receive path does, and
//! the fake direct sender records what it was given. It is not a network transport.

mod common;

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{request, FakeDirect, Lent};
use futures::{SinkExt, StreamExt};
use rpc_core::mem::{self, MemReader, MemTransport, MemWriter};
use rpc_core::wire::{Kind, Message};
use rpc_core::{
    Bincode, Codec, Config, DirectSend, Reply, Request, ResponseShortcut, ServerError,
    ServerErrorKind, ShutdownHandle, Transport,
};
use tokio::sync::{mpsc, oneshot, Notify};

/// The server's end: the in-process transport plus the shortcut and the direct sender.
struct Fast {
    inner: MemTransport,
    shortcut: ResponseShortcut,
    direct: Arc<FakeDirect>,
}

impl Transport for Fast {
    type Reader = MemReader;
    type Writer = MemWriter;
    fn split(self) -> (MemReader, MemWriter) {
        self.inner.split()
    }
    fn peer(&self) -> String {
        "fake".into()
    }
    fn response_shortcut(&self) -> Option<ResponseShortcut> {
        Some(self.shortcut.clone())
    }
    fn direct_send(&self) -> Option<Arc<dyn DirectSend>> {
        Some(self.direct.clone())
    }
}

struct FastListener(Option<Fast>);

impl rpc_core::Listener for FastListener {
    type Transport = Fast;
    async fn accept(&mut self) -> io::Result<Fast> {
        match self.0.take() {
            Some(t) => Ok(t),
            None => std::future::pending().await,
        }
    }
}

/// Method 1 echoes at once; method 2 waits for `go`, and says when its future is dropped.
#[derive(Default)]
struct Svc {
    go: Notify,
    dropped: Mutex<Vec<oneshot::Sender<()>>>,
}

struct OnDrop(Option<oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl rpc_core::Service for Svc {
    const NAME: &'static str = "Svc";

    fn method_name(&self, m: u32) -> Option<&'static str> {
        match m {
            1 => Some("Svc.echo"),
            2 => Some("Svc.wait"),
            _ => None,
        }
    }

    async fn dispatch(&self, m: u32, req: Request) -> Result<Reply, ServerError> {
        let x: u64 = req.decode::<Bincode, _>("Svc")?;
        if m == 2 {
            let _guard = OnDrop(self.dropped.lock().unwrap().pop());
            self.go.notified().await;
        }
        Reply::encode::<Bincode, _>(&x)
    }
}

fn value(answer: &Message) -> u64 {
    assert_eq!(answer.header.kind, Kind::Response);
    assert_eq!(answer.header.aux, 0, "the call failed");
    Bincode::decode(&answer.body).unwrap()
}

/// The test's end of one connection to a served `Svc`.
struct Peer {
    /// frames the server wrote through its writer
    written: MemReader,
    /// frames that go to the server's reader
    to_reader: MemWriter,
    /// what the server sent through the direct sender
    direct_sent: mpsc::UnboundedReceiver<Message>,
    shortcut: ResponseShortcut,
    direct: Arc<FakeDirect>,
    svc: Arc<Svc>,
    shutdown: ShutdownHandle,
    serving: tokio::task::JoinHandle<()>,
}

/// `Arc<Svc>` as the service, so that the test keeps a handle on it.
struct Shared(Arc<Svc>);

impl rpc_core::Service for Shared {
    const NAME: &'static str = "Svc";
    fn method_name(&self, m: u32) -> Option<&'static str> {
        self.0.method_name(m)
    }
    async fn dispatch(&self, m: u32, req: Request) -> Result<Reply, ServerError> {
        rpc_core::Service::dispatch(&*self.0, m, req).await
    }
}

impl Peer {
    async fn connect(config: Config) -> Peer {
        let (server_end, client_end) = mem::pair();
        let (direct, direct_sent) = FakeDirect::new();
        let direct = Arc::new(direct);
        let shortcut = ResponseShortcut::new();
        let svc = Arc::new(Svc::default());
        let shutdown = ShutdownHandle::new();
        let serving = tokio::spawn(rpc_core::server::serve(
            FastListener(Some(Fast {
                inner: server_end,
                shortcut: shortcut.clone(),
                direct: direct.clone(),
            })),
            Shared(svc.clone()),
            config,
            shutdown.clone(),
            Default::default(),
        ));
        let (written, to_reader) = client_end.split();
        let mut peer = Peer {
            written,
            to_reader,
            direct_sent,
            shortcut,
            direct,
            svc,
            shutdown,
            serving,
        };
        // The first request goes through the reader: the server installs its taker before it
        // reads anything, so once this is answered every later request is offered to it.
        peer.to_reader.send(request(1, 1000)).await.unwrap();
        let first = peer.written.next().await.unwrap().unwrap();
        assert_eq!(value(&first), 1000);
        peer
    }

    /// Delivers `msg` as a transport's receive path does: offered to the shortcut first, to
    /// the reader if given back. True if the server took it in the shortcut.
    async fn deliver(&mut self, msg: Message) -> bool {
        match self.shortcut.offer(msg) {
            None => true,
            Some(msg) => {
                self.to_reader.send(msg).await.unwrap();
                false
            }
        }
    }

    /// Lends `msg` as a transport's receive path does ([`ResponseShortcut::offer_frame`]),
    /// saying `accept` when the server accepts it: whether it was taken, and whether the
    /// server asked to accept it.
    fn lend(&self, msg: &Message, accept: bool) -> (bool, bool) {
        let mut lent = Lent::new(msg, accept);
        let taken = self.shortcut.offer_frame(&mut lent);
        (taken, lent.asked)
    }

    /// The next frame the server wrote through its writer that is not a keep-alive ping.
    async fn next_written(&mut self) -> Message {
        loop {
            let m = self.written.next().await.expect("connection open").unwrap();
            if m.header.kind != Kind::Ping {
                return m;
            }
        }
    }

    async fn finish(mut self) {
        assert!(
            self.direct_sent.try_recv().is_err(),
            "nothing else went directly"
        );
        self.shutdown.shutdown();
        drop(self.to_reader);
        self.serving.await.unwrap();
    }
}

/// A request lent where it arrived is run there and answered through the direct sender, as
/// one offered as a message is; one the server cannot take now (a busy link, an unknown
/// method) is given back before it is accepted, and one the transport does not accept gives
/// its handler slot back (with a single slot, the next request is still taken).
#[tokio::test]
async fn lent_requests_are_answered_where_they_arrive() {
    let mut config = Config::default();
    config.max_concurrent_handlers = 1;
    let mut peer = Peer::connect(config).await;
    for id in 1..=20u64 {
        assert_eq!(
            peer.lend(&request(1, id), true),
            (true, true),
            "request {id} taken"
        );
        let answer = peer.direct_sent.try_recv().expect("answered directly");
        assert_eq!((answer.header.id, value(&answer)), (id, id));
    }
    assert_eq!(
        peer.lend(&request(1, 21), false),
        (false, true),
        "not accepted"
    );
    assert_eq!(
        peer.lend(&request(9, 22), true),
        (false, false),
        "unknown method"
    );
    peer.direct.ready.store(false, Ordering::SeqCst);
    assert_eq!(
        peer.lend(&request(1, 23), true),
        (false, false),
        "busy link"
    );
    peer.direct.ready.store(true, Ordering::SeqCst);
    assert_eq!(
        peer.lend(&request(1, 24), true),
        (true, true),
        "the slot came back"
    );
    let answer = peer.direct_sent.try_recv().expect("answered directly");
    assert_eq!((answer.header.id, value(&answer)), (24, 24));
    peer.finish().await;
}

#[tokio::test]
async fn a_request_that_finishes_at_once_is_answered_where_it_arrives() {
    let mut peer = Peer::connect(Config::default()).await;
    for id in 1..=20u64 {
        assert!(peer.deliver(request(1, id)).await, "request {id} taken");
        // answered before the offer returned, through the direct sender
        let answer = peer.direct_sent.try_recv().expect("answered directly");
        assert_eq!(answer.header.id, id);
        assert_eq!(value(&answer), id);
    }
    // nothing went through the writer meanwhile
    peer.to_reader.send(request(1, 99)).await.unwrap();
    assert_eq!(peer.next_written().await.header.id, 99);
    peer.finish().await;
}

#[tokio::test]
async fn a_busy_link_leaves_requests_to_the_connection_task() {
    let mut peer = Peer::connect(Config::default()).await;
    peer.direct.ready.store(false, Ordering::SeqCst);
    assert!(!peer.deliver(request(1, 7)).await, "given back");
    let answer = peer.next_written().await;
    assert_eq!((answer.header.id, value(&answer)), (7, 7));
    peer.finish().await;
}

#[tokio::test]
async fn an_answer_that_cannot_go_directly_goes_through_the_writer() {
    let mut peer = Peer::connect(Config::default()).await;
    peer.direct.accept.store(false, Ordering::SeqCst);
    assert!(
        peer.deliver(request(1, 8)).await,
        "taken: the link looked idle"
    );
    let answer = peer.next_written().await;
    assert_eq!((answer.header.id, value(&answer)), (8, 8));
    peer.finish().await;
}

#[tokio::test]
async fn a_handler_that_waits_gets_a_task_of_its_own_and_can_be_cancelled() {
    let mut peer = Peer::connect(Config::default()).await;
    let (dropped_tx, dropped) = oneshot::channel();
    peer.svc.dropped.lock().unwrap().push(dropped_tx);
    assert!(peer.deliver(request(2, 5)).await, "taken; it waits");
    // the client gives up on call 5: the cancel goes through the reader
    let mut cancel = Message::control(Kind::Cancel, 5);
    cancel.header.method = 2;
    assert!(!peer.deliver(cancel).await, "only requests are taken");
    tokio::time::timeout(Duration::from_secs(10), dropped)
        .await
        .expect("the cancelled handler was dropped")
        .unwrap();
    // another waiting call, not cancelled, answers through the writer once it may
    assert!(peer.deliver(request(2, 6)).await);
    peer.svc.go.notify_waiters();
    let answer = peer.next_written().await;
    assert_eq!((answer.header.id, value(&answer)), (6, 6));
    peer.finish().await;
}

#[tokio::test]
async fn after_shutdown_begins_requests_go_to_the_connection_task_and_are_refused() {
    let mut peer = Peer::connect(Config::default()).await;
    // a waiting call keeps the connection draining, not closed
    assert!(peer.deliver(request(2, 3)).await);
    peer.shutdown.shutdown();
    let go_away = peer.next_written().await;
    assert_eq!(go_away.header.kind, Kind::GoAway);
    assert!(
        !peer.deliver(request(1, 4)).await,
        "given back while draining"
    );
    let refusal = peer.next_written().await;
    assert_eq!(refusal.header.id, 4);
    assert_eq!(refusal.header.aux, ServerErrorKind::ShuttingDown.code());
    // the waiting call still gets its answer, then the connection ends
    peer.svc.go.notify_waiters();
    let answer = peer.next_written().await;
    assert_eq!((answer.header.id, value(&answer)), (3, 3));
    assert!(peer.written.next().await.is_none(), "closed once drained");
    assert!(peer.direct_sent.try_recv().is_err());
    peer.serving.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn requests_taken_there_count_as_traffic_for_the_keep_alive() {
    let mut config = Config::default();
    config.keepalive_interval = Duration::from_millis(100);
    config.keepalive_timeout = Duration::from_millis(300);
    let mut peer = Peer::connect(config).await;
    // 20 intervals of traffic that only the shortcut sees (virtual time)
    for id in 1..=40u64 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(peer.deliver(request(1, id)).await);
        assert_eq!(value(&peer.direct_sent.try_recv().unwrap()), id);
    }
    // the server neither pinged nor gave up: the next thing it wrote is this answer
    peer.to_reader.send(request(1, 77)).await.unwrap();
    let next = peer.written.next().await.unwrap().unwrap();
    assert_eq!(next.header.kind, Kind::Response, "no ping before it");
    assert_eq!(value(&next), 77);
    peer.finish().await;
}
