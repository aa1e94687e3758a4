//! The end-to-end suite, written against an endpoint so that every transport runs the same
//! checks: `tests/e2e_tcp.rs` runs it over TCP loopback, the RDMA tests in the guest over rxe
//! and siw.
#![allow(dead_code, missing_docs, unreachable_pub)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdma_rpc::codec::Bincode;
use rdma_rpc::{
    rdma_service, Client, Config, Endpoint, Payload, RpcError, Server, ServerErrorKind,
    ShutdownHandle,
};
use tokio::sync::{mpsc, Mutex, Semaphore};

/// Generous bound for waiting on an event that must happen; a failure, not a pacing device.
pub const EVENTUALLY: Duration = Duration::from_secs(30);

#[rdma_service]
pub trait Probe {
    async fn echo(&self, data: Payload) -> Payload;
    async fn add(&self, a: u64, b: u64) -> u64;
    /// Waits until the test opens the gate; reports start and drop.
    async fn block(&self, tag: u64) -> u64;
    async fn explode(&self, why: String) -> u64;
    /// `len` bytes of `seed` in a buffer from `rdma_rpc::payload_mut`; whether it was lent.
    async fn fill(&self, len: u64, seed: u8) -> (bool, Payload);
    /// `text` back, with its length: a body of that size each way, no payload.
    async fn text(&self, text: String) -> (u64, String);
}

#[derive(Default)]
pub struct Events {
    pub running: AtomicUsize,
    pub max_running: AtomicUsize,
}

pub struct ProbeImpl {
    pub gate: Arc<Semaphore>,
    pub events: Arc<Events>,
    started: mpsc::UnboundedSender<u64>,
    dropped: mpsc::UnboundedSender<u64>,
}

pub struct Probes {
    pub gate: Arc<Semaphore>,
    pub events: Arc<Events>,
    pub started: Mutex<mpsc::UnboundedReceiver<u64>>,
    pub dropped: Mutex<mpsc::UnboundedReceiver<u64>>,
}

impl Probes {
    /// Waits for handler `tag` to start.
    pub async fn started(&self, tag: u64) {
        wait_for(&self.started, tag, "started").await
    }

    /// Waits for handler `tag` to be dropped before it finished (cancelled or past deadline).
    pub async fn dropped(&self, tag: u64) {
        wait_for(&self.dropped, tag, "was dropped").await
    }
}

async fn wait_for(events: &Mutex<mpsc::UnboundedReceiver<u64>>, tag: u64, what: &str) {
    let mut rx = events.lock().await;
    let seen = tokio::time::timeout(EVENTUALLY, async {
        while let Some(t) = rx.recv().await {
            if t == tag {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(
        seen,
        Ok(true),
        "handler {tag} never {what} (or the server is gone)"
    );
}

/// Defines one `#[tokio::test]` per suite function, each run against the endpoint `$ep()`
/// gives, so that every transport runs the same list.
#[macro_export]
macro_rules! transport_suite {
    ($ep:ident) => {
        $crate::transport_suite!(@tests $ep;
            round_trip_sizes,
            large_bodies,
            lent_payloads,
            frame_at_threshold,
            many_concurrent_calls,
            deadline,
            cancellation,
            handler_panic,
            unknown_method_and_bad_arguments,
            client_flow_control,
            server_flow_control,
            graceful_shutdown,
            size_limits,
            auth_token,
            reconnect_after_restart,
            connection_limit,
            server_killed_at_every_stage,
        );
    };
    (@tests $ep:ident; $($name:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            suite::log_from_env();
            suite::$name(&$ep()).await;
        }
    )*};
}

/// Logs to the test's output as `RUST_LOG` says (nothing when it is unset).
pub fn log_from_env() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// Raw frames over a plain TCP socket, for feeding a server what the client never sends.
pub mod raw {
    use rdma_rpc::core::wire::{Header, Kind, Message};
    use rdma_rpc::Endpoint;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpStream;

    /// One frame with `body` and no attachments.
    pub fn frame(kind: Kind, id: u64, method: u32, body: &[u8]) -> Vec<u8> {
        let m = Message {
            header: Header {
                kind,
                flags: 0,
                id,
                method,
                aux: 0,
            },
            body: bytes::Bytes::copy_from_slice(body),
            attachments: Default::default(),
        };
        let mut b = bytes::BytesMut::new();
        m.encode_into(&mut b);
        b.to_vec()
    }

    /// A plain TCP connection to the endpoint's address.
    pub async fn connect(ep: &Endpoint) -> TcpStream {
        TcpStream::connect(ep.authority()).await.unwrap()
    }

    /// Reads until the server closes the connection; returns what it sent.
    pub async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
        let mut out = Vec::new();
        tokio::time::timeout(super::EVENTUALLY, s.read_to_end(&mut out))
            .await
            .expect("server closes the connection")
            .ok();
        out
    }
}

pub fn probe() -> (ProbeImpl, Probes) {
    let gate = Arc::new(Semaphore::new(0));
    let events = Arc::new(Events::default());
    let (s_tx, s_rx) = mpsc::unbounded_channel();
    let (d_tx, d_rx) = mpsc::unbounded_channel();
    (
        ProbeImpl {
            gate: gate.clone(),
            events: events.clone(),
            started: s_tx,
            dropped: d_tx,
        },
        Probes {
            gate,
            events,
            started: Mutex::new(s_rx),
            dropped: Mutex::new(d_rx),
        },
    )
}

struct DropReport {
    tag: u64,
    tx: mpsc::UnboundedSender<u64>,
    finished: bool,
    events: Arc<Events>,
}

impl Drop for DropReport {
    fn drop(&mut self) {
        self.events.running.fetch_sub(1, Ordering::SeqCst);
        if !self.finished {
            let _ = self.tx.send(self.tag);
        }
    }
}

impl Probe for ProbeImpl {
    async fn echo(&self, data: Payload) -> Payload {
        data
    }

    async fn add(&self, a: u64, b: u64) -> u64 {
        a.wrapping_add(b)
    }

    async fn block(&self, tag: u64) -> u64 {
        let now = self.events.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.events.max_running.fetch_max(now, Ordering::SeqCst);
        let mut report = DropReport {
            tag,
            tx: self.dropped.clone(),
            finished: false,
            events: self.events.clone(),
        };
        let _ = self.started.send(tag);
        self.gate.acquire().await.expect("gate open").forget();
        report.finished = true;
        tag
    }

    async fn explode(&self, why: String) -> u64 {
        panic!("{why}");
    }

    async fn fill(&self, len: u64, seed: u8) -> (bool, Payload) {
        let mut buf = rdma_rpc::payload_mut(len as usize);
        buf.fill(seed);
        (buf.is_lent(), buf.freeze())
    }

    async fn text(&self, text: String) -> (u64, String) {
        (text.len() as u64, text)
    }
}

/// A running probe server.
pub struct Running {
    pub endpoint: Endpoint,
    pub shutdown: ShutdownHandle,
    pub probes: Probes,
    pub serving: tokio::task::JoinHandle<Result<(), RpcError>>,
    pub stats: Arc<rdma_rpc::core::server::ServerStats>,
    /// The server's registered pools (RDMA only).
    #[cfg(feature = "rdma")]
    pub pools: Option<rdma_rpc::PoolMonitor>,
}

pub async fn start(bind: &Endpoint, config: Config) -> Running {
    let server = Server::bind_with(bind, config).await.expect("bind");
    let endpoint = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let stats = server.stats();
    #[cfg(feature = "rdma")]
    let pools = server.rdma_pools();
    let (imp, probes) = probe();
    let serving = tokio::spawn(server.serve(ProbeServer::new(imp)));
    Running {
        endpoint,
        shutdown,
        probes,
        serving,
        stats,
        #[cfg(feature = "rdma")]
        pools,
    }
}

pub async fn connect(ep: &Endpoint) -> ProbeClient {
    ProbeClient::connect(ep).await.expect("connect")
}

pub async fn connect_with(ep: &Endpoint, config: Config) -> ProbeClient {
    ProbeClient::from_client(Client::connect_with(ep, config).await.expect("connect"))
}

/// As `connect_with`; a failure names the test's stage and which server it was.
async fn connect_named(ep: &Endpoint, config: Config, stage: &str, whom: &str) -> ProbeClient {
    match Client::connect_with(ep, config).await {
        Ok(c) => ProbeClient::from_client(c),
        Err(e) => panic!("[{stage}] connecting to {whom}: {e:?}"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

// ---------------------------------------------------------------------------------------------

/// Payloads of 0 B, 1 B, around the eager threshold, 1 MiB and 64 MiB come back byte-exact.
pub async fn round_trip_sizes(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let t = Config::default().eager_threshold;
    for (i, len) in [0, 1, t - 1, t, t + 1, 1 << 20, 64 << 20]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, i as u8);
        let back = client
            .echo(Payload::from(data.clone()))
            .await
            .expect("echo");
        assert_eq!(back.len(), len, "length of a {len}-byte round trip");
        assert!(back == data, "bytes of a {len}-byte round trip differ");
    }
    srv.shutdown.shutdown();
}

/// Arguments and results whose body (encoded values, no `Payload`) is over the eager
/// threshold (8 KiB) or larger than an RDMA receive slot (16 KiB by default) go as they go over
/// TCP: byte-exact both ways, up to 2 MiB, one at a time with small calls between them and
/// eight at once. Over RDMA such a body travels by rendezvous as the last segment of its
/// message.
pub async fn large_bodies(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let text = |len: usize, seed: usize| -> String {
        (0..len)
            .map(|i| char::from(b'a' + ((i * 7 + seed) % 26) as u8))
            .collect()
    };
    for (i, len) in [
        0,
        1000,
        9000,
        (16 << 10) - 64,
        16 << 10,
        20_000,
        300_000,
        2 << 20,
    ]
    .into_iter()
    .enumerate()
    {
        let sent = text(len, i);
        let (n, back) = client
            .text(sent.clone())
            .await
            .unwrap_or_else(|e| panic!("a body of {len} bytes: {e}"));
        assert_eq!(n, len as u64);
        assert!(back == sent, "the {len}-byte body came back changed");
        assert_eq!(client.add(len as u64, 1).await.unwrap(), len as u64 + 1);
    }
    let calls = (0..8).map(|i| {
        let client = client.clone();
        let sent = text(20_000 + 1000 * i, i);
        async move {
            let (_, back) = client.text(sent.clone()).await.expect("a large body");
            assert!(back == sent, "call {i}'s body came back changed");
        }
    });
    futures::future::join_all(calls).await;
    srv.shutdown.shutdown();
}

/// Payloads filled in place in memory the client lends (`Client::payload_mut`) come back
/// byte-exact, inline and by rendezvous, in a pool class and above it; so do answers a handler
/// fills in memory its connection lends (`rdma_rpc::payload_mut`). Over RDMA they are
/// registered buffers, sent without a copy by pull or push (the pool counters count no
/// copied bytes; the server echoes what it received without one either); over TCP, heap
/// memory.
pub async fn lent_payloads(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let rdma = srv.endpoint.scheme() == rdma_rpc::Scheme::Rdma;
    for (i, len) in [1, 100 << 10, 1 << 20, 16 << 20].into_iter().enumerate() {
        let mut buf = client.client().payload_mut(len);
        assert_eq!(buf.len(), len);
        assert_eq!(buf.is_lent(), rdma, "{len} B lent by the connection");
        buf.copy_from_slice(&pattern(len, i as u8));
        let p = buf.freeze();
        let back = client.echo(p.clone()).await.expect("echo");
        assert!(back == p, "bytes of a lent {len}-byte payload differ");
        let back = client.echo(p.slice(1..)).await.expect("echo of a slice");
        assert!(
            back[..] == p[1..],
            "bytes of a slice of a lent {len}-byte payload differ"
        );
    }
    // and the server's handler fills its answer in memory its connection lends
    for (i, len) in [1, 100 << 10, 1 << 20, 16 << 20].into_iter().enumerate() {
        let (lent, p) = client.fill(len, i as u8).await.expect("fill");
        assert_eq!(lent, rdma, "{len} B lent to the handler by its connection");
        assert!(
            p.len() == len as usize && p.iter().all(|b| *b == i as u8),
            "bytes of a {len}-byte answer filled in place differ"
        );
    }
    // nothing was copied to be sent, by pull or by push, on either side
    #[cfg(feature = "rdma")]
    if let (Some(pools), Some(server)) = (client.client().rdma_pools(), &srv.pools) {
        for (side, c) in [("client", pools.counts()), ("server", server.counts())] {
            assert_eq!(c.copied_bytes, 0, "{side}: a payload was copied: {c:?}");
        }
    }
    srv.shutdown.shutdown();
}

/// Messages whose whole frame sits at the eager threshold and one byte either side.
pub async fn frame_at_threshold(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let t = Config::default().eager_threshold;
    // Header 32 + table 8 + body (index varint, 1 byte) = 41 bytes besides the payload.
    for len in [t - 42, t - 41, t - 40] {
        let data = pattern(len, 7);
        let back = client
            .echo(Payload::from(data.clone()))
            .await
            .expect("echo");
        assert!(back == data, "frame around the threshold: {len}");
    }
    srv.shutdown.shutdown();
}

/// 10,000 calls at once from many tasks on one client, all answered correctly.
pub async fn many_concurrent_calls(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let calls: Vec<_> = (0..10_000u64)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { (i, c.add(i, 1_000_000).await) })
        })
        .collect();
    for call in calls {
        let (i, r) = call.await.expect("task");
        assert_eq!(r.expect("call"), i + 1_000_000);
    }
    srv.shutdown.shutdown();
}

/// A call past its deadline fails with DeadlineExceeded, and the server drops the handler.
pub async fn deadline(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let r = client
        .with_timeout(Duration::from_millis(200))
        .block(11)
        .await;
    assert!(matches!(r, Err(RpcError::DeadlineExceeded)), "{r:?}");
    srv.probes.dropped(11).await;
    // The connection is still good.
    assert_eq!(client.add(2, 3).await.unwrap(), 5);
    srv.shutdown.shutdown();
}

/// Dropping a call's future stops the handler on the server.
pub async fn cancellation(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let c = client.clone();
    let call = tokio::spawn(async move { c.block(21).await });
    srv.probes.started(21).await;
    call.abort();
    srv.probes.dropped(21).await;
    assert_eq!(client.add(1, 1).await.unwrap(), 2);
    srv.shutdown.shutdown();
}

/// A panicking handler answers its caller with an error; connection and server live on.
pub async fn handler_panic(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let e = client.explode("kaboom".into()).await.unwrap_err();
    assert_eq!(e.server_kind(), Some(ServerErrorKind::Panicked), "{e}");
    assert!(e.to_string().contains("kaboom"), "{e}");
    assert_eq!(client.add(40, 2).await.unwrap(), 42);
    let other = connect(&srv.endpoint).await;
    assert_eq!(other.add(1, 2).await.unwrap(), 3);
    srv.shutdown.shutdown();
}

/// Unknown method ids and undecodable arguments get answers that say so.
pub async fn unknown_method_and_bad_arguments(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let raw = client.client();
    let id = rdma_rpc::__private::method_id("Probe.nope");
    let e = raw
        .call::<Bincode, _, u64>(id, "Probe.nope", &(1u64,))
        .await
        .unwrap_err();
    assert_eq!(e.server_kind(), Some(ServerErrorKind::UnknownMethod), "{e}");
    assert!(e.to_string().contains("Probe"), "{e}");
    let add = rdma_rpc::__private::method_id("Probe.add");
    let e = raw
        .call::<Bincode, _, u64>(add, "Probe.add", &("not", "numbers"))
        .await
        .unwrap_err();
    assert_eq!(e.server_kind(), Some(ServerErrorKind::BadRequest), "{e}");
    assert!(e.to_string().contains("Probe.add"), "{e}");
    assert_eq!(client.add(1, 2).await.unwrap(), 3);
    srv.shutdown.shutdown();
}

/// The client keeps at most `max_in_flight` calls on the wire; the rest wait, then finish.
pub async fn client_flow_control(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let mut config = Config::default();
    config.max_in_flight = 4;
    let client = connect_with(&srv.endpoint, config).await;
    let calls: Vec<_> = (0..20u64)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { c.block(100 + i).await })
        })
        .collect();
    // Wait until the window is full, then let everything through.
    for _ in 0..4 {
        tokio::time::timeout(EVENTUALLY, srv.probes.started.lock().await.recv())
            .await
            .expect("four calls start");
    }
    srv.probes.gate.add_permits(20);
    for (i, c) in calls.into_iter().enumerate() {
        assert_eq!(c.await.unwrap().unwrap(), 100 + i as u64);
    }
    assert_eq!(srv.probes.events.max_running.load(Ordering::SeqCst), 4);
    srv.shutdown.shutdown();
}

/// The server runs at most `max_concurrent_handlers` handlers, across connections.
pub async fn server_flow_control(bind: &Endpoint) {
    let mut config = Config::default();
    config.max_concurrent_handlers = 2;
    let srv = start(bind, config).await;
    let mut calls = Vec::new();
    for c in 0..3u64 {
        let client = connect(&srv.endpoint).await;
        for i in 0..5u64 {
            let client = client.clone();
            calls.push(tokio::spawn(async move { client.block(c * 10 + i).await }));
        }
    }
    for _ in 0..2 {
        tokio::time::timeout(EVENTUALLY, srv.probes.started.lock().await.recv())
            .await
            .expect("two calls start");
    }
    srv.probes.gate.add_permits(15);
    for c in calls {
        c.await.unwrap().unwrap();
    }
    assert_eq!(srv.probes.events.max_running.load(Ordering::SeqCst), 2);
    srv.shutdown.shutdown();
}

/// Graceful shutdown: calls in flight finish and answer, new calls are refused, serve returns.
pub async fn graceful_shutdown(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let client = connect(&srv.endpoint).await;
    let mut fail_fast = Config::default();
    fail_fast.wait_for_reconnect = false;
    let other = connect_with(&srv.endpoint, fail_fast).await;
    let c = client.clone();
    let long = tokio::spawn(async move { c.block(31).await });
    srv.probes.started(31).await;
    // a call in flight keeps each connection open while the server drains
    let o = other.clone();
    let other_long = tokio::spawn(async move { o.block(32).await });
    srv.probes.started(32).await;
    srv.shutdown.shutdown();
    // New calls are refused with a clear error: by the server, or, once the go-away frame
    // arrived, by the client, which then looks for a new connection instead (this one fails
    // fast; a waiting client would wait for a server to come back, as configured).
    let e = other.add(1, 1).await.unwrap_err();
    assert!(
        matches!(e, RpcError::Unavailable(_))
            || e.server_kind() == Some(ServerErrorKind::ShuttingDown),
        "{e}"
    );
    assert!(e.to_string().contains("shutting down"), "{e}");
    srv.probes.gate.add_permits(2);
    assert_eq!(long.await.unwrap().unwrap(), 31);
    assert_eq!(other_long.await.unwrap().unwrap(), 32);
    tokio::time::timeout(EVENTUALLY, srv.serving)
        .await
        .expect("serve returns after draining")
        .unwrap()
        .unwrap();
    // And nobody is listening any more.
    assert!(ProbeClient::connect(&srv.endpoint).await.is_err());
}

/// Messages over the limit are refused before anything is sent (client) or reserved (server).
pub async fn size_limits(bind: &Endpoint) {
    let mut small = Config::default();
    small.max_message_size = 1 << 20;
    let srv = start(bind, small.clone()).await;
    // Client-side limit: refused locally.
    let limited = connect_with(&srv.endpoint, small).await;
    let e = limited
        .echo(Payload::from(vec![0u8; 2 << 20]))
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::TooLarge { .. }), "{e}");
    assert_eq!(limited.add(1, 1).await.unwrap(), 2);
    // Server-side limit: the server answers TooLarge and closes that connection only.
    let big = connect(&srv.endpoint).await;
    let e = big
        .echo(Payload::from(vec![0u8; 2 << 20]))
        .await
        .unwrap_err();
    assert!(
        e.server_kind() == Some(ServerErrorKind::TooLarge)
            || matches!(e, RpcError::ConnectionClosed),
        "{e}"
    );
    assert_eq!(limited.add(2, 2).await.unwrap(), 4);
    srv.shutdown.shutdown();
}

/// A server with a shared token accepts only clients that present it; others are refused
/// before any handler runs, and the server keeps serving the good ones.
pub async fn auth_token(bind: &Endpoint) {
    use rdma_rpc::Secret;
    let mut config = Config::default();
    config.auth_token = Some(Secret::new("s3cret"));
    let srv = start(bind, config.clone()).await;
    let good = connect_with(&srv.endpoint, config).await;
    assert_eq!(good.add(1, 2).await.unwrap(), 3);
    for token in [None, Some("s3creT"), Some("")] {
        let mut c = Config::default();
        c.auth_token = token.map(Secret::new);
        let e = Client::connect_with(&srv.endpoint, c).await.unwrap_err();
        assert_eq!(
            e.server_kind(),
            Some(ServerErrorKind::Unauthenticated),
            "{token:?}: {e}"
        );
    }
    assert_eq!(good.add(2, 2).await.unwrap(), 4);
    assert_eq!(srv.probes.events.max_running.load(Ordering::SeqCst), 0);
    srv.shutdown.shutdown();
}

/// After the server restarts, a client reconnects by itself. While it is down, calls wait
/// (bounded by their deadline) or, configured to fail fast, fail at once with Unavailable.
pub async fn reconnect_after_restart(bind: &Endpoint) {
    let srv = start(bind, Config::default()).await;
    let ep = srv.endpoint.clone();
    let waiting = connect(&ep).await;
    let mut fail_fast = Config::default();
    fail_fast.wait_for_reconnect = false;
    let fast = connect_with(&ep, fail_fast).await;
    assert_eq!(waiting.add(1, 1).await.unwrap(), 2);
    assert_eq!(fast.add(1, 1).await.unwrap(), 2);

    srv.shutdown.shutdown();
    tokio::time::timeout(EVENTUALLY, srv.serving)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
    for c in [&waiting, &fast] {
        tokio::time::timeout(EVENTUALLY, c.client().closed())
            .await
            .expect("the client sees the connection close");
    }
    let e = tokio::time::timeout(EVENTUALLY, fast.add(2, 2))
        .await
        .expect("fails fast")
        .unwrap_err();
    assert!(matches!(e, RpcError::Unavailable(_)), "{e}");
    let e = waiting
        .with_timeout(Duration::from_millis(300))
        .add(2, 2)
        .await
        .unwrap_err();
    assert!(
        matches!(e, RpcError::DeadlineExceeded | RpcError::Unavailable(_)),
        "{e}"
    );

    let again = start(&ep, Config::default()).await;
    assert_eq!(waiting.add(3, 3).await.unwrap(), 6, "reconnected by itself");
    fast.client().ensure_connected().await.unwrap();
    assert_eq!(fast.add(4, 4).await.unwrap(), 8);
    again.shutdown.shutdown();
}

/// A server at `max_connections` answers one more connection with `Overloaded` and closes it;
/// the connections it serves go on, and a freed place is taken again.
pub async fn connection_limit(bind: &Endpoint) {
    let mut config = Config::default();
    config.max_connections = 2;
    let srv = start(bind, config).await;
    let a = connect(&srv.endpoint).await;
    let b = connect(&srv.endpoint).await;
    assert_eq!(a.add(1, 1).await.unwrap(), 2);
    assert_eq!(b.add(2, 2).await.unwrap(), 4);
    let e = ProbeClient::connect(&srv.endpoint)
        .await
        .expect_err("a third connection is refused");
    assert_eq!(e.server_kind(), Some(ServerErrorKind::Overloaded), "{e}");
    assert!(e.to_string().contains("limit of 2 connections"), "{e}");
    assert_eq!(
        a.add(3, 3).await.unwrap(),
        6,
        "the served connections go on"
    );
    // closing one frees its place
    drop(b);
    tokio::time::timeout(EVENTUALLY, async {
        while srv
            .stats
            .connections
            .load(std::sync::atomic::Ordering::Relaxed)
            > 1
        {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the server notices the closed connection");
    let c = connect(&srv.endpoint).await;
    assert_eq!(c.add(4, 4).await.unwrap(), 8);
    srv.shutdown.shutdown();
}

/// A probe server on a runtime and a thread of its own, so that a test can kill it the way a
/// process dies: every task, connection and handler dropped at once, no shutdown, no goodbye.
pub struct Doomed {
    pub endpoint: Endpoint,
    pub probes: Probes,
    rt: test_support::DoomedRuntime,
}

impl Doomed {
    pub fn start(bind: &Endpoint, config: Config) -> Doomed {
        let (imp, probes) = probe();
        let bind = bind.clone();
        let (endpoint, rt) = test_support::DoomedRuntime::start(move || async move {
            let server = Server::bind_with(&bind, config).await.expect("bind");
            let endpoint = server.local_endpoint();
            tokio::spawn(server.serve(ProbeServer::new(imp)));
            (endpoint, ())
        });
        Doomed {
            endpoint,
            probes,
            rt,
        }
    }

    /// Kills the server; returns once its runtime is gone.
    pub fn kill(self) -> Probes {
        self.rt.kill();
        self.probes
    }
}

/// The server dies at each stage of a call: before the request, with large payloads in flight
/// and a handler running, after its reply arrived. Each time, within the keep-alive timeout
/// (never hanging): every call in flight either returned its exact bytes or failed with
/// `ConnectionClosed`, a call made afterwards fails with `ConnectionClosed` (reconnection is off
/// here; `reconnect_after_restart` covers it), a reply received before the death is intact, and
/// a new connection to a new server works.
pub async fn server_killed_at_every_stage(bind: &Endpoint) {
    let mut config = Config::default();
    config.keepalive_interval = Duration::from_millis(250);
    config.keepalive_timeout = Duration::from_secs(3);
    config.reconnect = false;
    // "within the keep-alive time": its timeout, an interval, and slack for a loaded machine
    let bound = config.keepalive_timeout * 3;
    for stage in ["before the request", "mid-call", "after the reply"] {
        let srv = Doomed::start(bind, config.clone());
        let client = connect_named(&srv.endpoint, config.clone(), stage, "the doomed server").await;
        let mut echoes = Vec::new();
        let mut blocked = None;
        let mut kept = None;
        match stage {
            "mid-call" => {
                for i in 0..4u8 {
                    let c = client.clone();
                    echoes.push(tokio::spawn(async move {
                        let d = pattern(4 << 20, i);
                        (c.echo(Payload::from(d.clone())).await, d)
                    }));
                }
                let c = client.clone();
                blocked = Some(tokio::spawn(async move { c.block(77).await }));
                srv.probes.started(77).await;
            }
            "after the reply" => {
                let d = pattern(1 << 20, 5);
                let back = client
                    .echo(Payload::from(d.clone()))
                    .await
                    .expect("echo before the death");
                kept = Some((back, d));
            }
            _ => {}
        }
        let _probes = srv.kill();
        for e in echoes {
            let (r, d) = tokio::time::timeout(bound, e)
                .await
                .unwrap_or_else(|_| panic!("[{stage}] a call in flight hangs after the death"))
                .expect("call task");
            match r {
                Ok(back) => assert!(back == d, "[{stage}] an echo came back corrupted"),
                Err(e) => assert!(matches!(e, RpcError::ConnectionClosed), "[{stage}] {e:?}"),
            }
        }
        if let Some(b) = blocked {
            let r = tokio::time::timeout(bound, b)
                .await
                .unwrap_or_else(|_| panic!("[{stage}] the blocked call hangs after the death"))
                .expect("call task");
            assert!(
                matches!(r, Err(RpcError::ConnectionClosed)),
                "[{stage}] blocked call: {r:?}"
            );
        }
        let r = tokio::time::timeout(bound, client.add(1, 2))
            .await
            .unwrap_or_else(|_| panic!("[{stage}] a new call hangs after the death"));
        assert!(
            matches!(r, Err(RpcError::ConnectionClosed)),
            "[{stage}] new call: {r:?}"
        );
        if let Some((back, d)) = kept {
            assert!(
                back == d,
                "[{stage}] a reply received before the death changed"
            );
        }
        // a new server, a new connection
        let fresh = start(bind, config.clone()).await;
        let c = connect_named(&fresh.endpoint, config.clone(), stage, "a new server").await;
        let d = pattern(2 << 20, 9);
        let back = c
            .echo(Payload::from(d.clone()))
            .await
            .expect("a call on a new connection");
        assert!(back == d, "[{stage}] echo on a new connection");
        fresh.shutdown.shutdown();
    }
}
