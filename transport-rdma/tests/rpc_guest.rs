//! rdma-rpc calls over the RDMA transport on a real device: eager messages and receiver-pull
//! rendezvous of large payloads, with rpc-core's client and server. Like `verbs_guest`, these
//! tests are built only with the `guest-tests` feature and run by `scripts/rdma-test.sh` in the
//! QEMU guest on rxe0 and siw0 (`RDMA_RPC_TEST_DEVICE`, `RDMA_RPC_TEST_IP`); they FAIL when the
//! named device is missing. They run one at a time (`--test-threads=1`, as that script passes):
//! `idle_connections_sleep` and `many_connections_memory` measure the whole process's CPU time
//! and resident memory, which tests running beside them would add to.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rpc_core::codec::{Bincode, Codec};
use rpc_core::rendezvous::{Packet, Segment};
use rpc_core::server::{self, Reply, Request, Service, ShutdownHandle};
use rpc_core::wire::{Header, Kind, Message};
use rpc_core::{Client, Config, Payload, ServerError};
use transport_rdma::{
    devices, PoolCounts, PoolMonitor, RdmaConnection, RdmaOptions, RdmaRpcListener, RdmaTransport,
    RemoteAccess, RemoteToken, SharedReceiveMonitor, SharedReceiveStats,
};

const LIMIT: Duration = Duration::from_secs(240);

fn target(port: u16) -> (String, SocketAddr) {
    // RUST_LOG=transport_rdma=debug shows the transport's view of a failure
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dev = std::env::var("RDMA_RPC_TEST_DEVICE").expect(
        "RDMA_RPC_TEST_DEVICE must name the RDMA device to test (run scripts/rdma-test.sh)",
    );
    let ip: IpAddr = std::env::var("RDMA_RPC_TEST_IP")
        .expect("RDMA_RPC_TEST_IP must be an IP address of the device's netdev")
        .parse()
        .expect("RDMA_RPC_TEST_IP is not an IP address");
    let found = devices().unwrap_or_else(|e| panic!("RDMA device {dev} requested, but: {e}"));
    assert!(
        found.iter().any(|d| d.name == dev),
        "RDMA device {dev} requested but not present; devices: {found:?}"
    );
    (dev, SocketAddr::new(ip, port))
}

/// `Blob.echo(Payload) -> Payload` and `Blob.digest(Payload) -> (len, fnv64)`.
struct Blob;

const ECHO: u32 = 1;
const DIGEST: u32 = 2;
/// like DIGEST, after holding the payload for half a second
const HOLD: u32 = 3;

fn fnv64(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ *x as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Service for Blob {
    const NAME: &'static str = "Blob";

    fn method_name(&self, m: u32) -> Option<&'static str> {
        match m {
            ECHO => Some("Blob.echo"),
            DIGEST => Some("Blob.digest"),
            HOLD => Some("Blob.hold"),
            _ => None,
        }
    }

    async fn dispatch(&self, m: u32, req: Request) -> Result<Reply, ServerError> {
        match m {
            ECHO => {
                let (p,): (Payload,) = req.decode::<Bincode, _>("Blob.echo")?;
                Reply::encode::<Bincode, _>(&p)
            }
            _ => {
                let (p,): (Payload,) = req.decode::<Bincode, _>("Blob.digest")?;
                if m == HOLD {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Reply::encode::<Bincode, _>(&(p.len() as u64, fnv64(&p)))
            }
        }
    }
}

fn data(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(0x9E37_79B9).wrapping_add(seed) >> 7) as u8)
        .collect()
}

/// A `Blob` server on `addr` with `opts`: its listener's pool counters, and how to stop it.
struct BlobServer {
    pools: PoolMonitor,
    srq: SharedReceiveMonitor,
    shutdown: ShutdownHandle,
    task: tokio::task::JoinHandle<()>,
}

impl BlobServer {
    fn start(addr: SocketAddr, config: &Config, opts: RdmaOptions) -> BlobServer {
        let listener = RdmaRpcListener::bind(addr, config.clone(), opts).expect("bind");
        let pools = listener.pool_monitor();
        let srq = listener.shared_receive_monitor();
        let shutdown = ShutdownHandle::new();
        let task = tokio::spawn(server::serve(
            listener,
            Blob,
            config.clone(),
            shutdown.clone(),
            Default::default(),
        ));
        BlobServer {
            pools,
            srq,
            shutdown,
            task,
        }
    }

    /// Shuts it down and waits until `serve` returned.
    async fn stop(self) {
        self.shutdown.shutdown();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("server stops after shutdown")
            .expect("server task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpc_calls_eager_and_rendezvous() {
    let (dev, addr) = target(20_021);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let srv = BlobServer::start(addr, &config, RdmaOptions::default());

        let transport = RdmaTransport::connect(addr, config.clone(), RdmaOptions::default()).await.expect("connect");
        assert_eq!(transport.device_name(), dev, "client runs on the requested device");
        let client = Client::new(transport, config);

        // eager: small payloads, one SEND each way
        let n = 500;
        let t0 = Instant::now();
        for i in 0..n {
            let d = data(64, i);
            let back: Payload =
                client.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),)).await.expect("echo");
            assert_eq!(&back[..], &d[..], "eager echo {i}");
        }
        let el = t0.elapsed();
        println!(
            "device {dev}: {n} rdma-rpc calls with 64 B payloads (eager): mean {:.1} us per call",
            el.as_secs_f64() * 1e6 / n as f64
        );

        // rendezvous both ways: 4 MiB there and back, verified
        let big = data(4 << 20, 42);
        let t0 = Instant::now();
        let back: Payload =
            client.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(big.clone()),)).await.expect("big echo");
        let el = t0.elapsed();
        assert_eq!(back.len(), big.len());
        assert!(back[..] == big[..], "4 MiB echo differs");
        println!(
            "device {dev}: 4 MiB payload echoed by rendezvous (RDMA READ both ways) in {:.1} ms ({:.0} MB/s each way)",
            el.as_secs_f64() * 1e3,
            2.0 * big.len() as f64 / el.as_secs_f64() / 1e6
        );

        // many calls at once, mixed sizes (eager and rendezvous), more than the receive slots
        let sizes = [0usize, 1, 100, 7_000, 9_000, 65_536, 300_000, 1 << 20];
        let calls = (0..48u64).map(|i| {
            let client = client.clone();
            let len = sizes[i as usize % sizes.len()];
            async move {
                let d = data(len, i);
                let (l, h): (u64, u64) = client
                    .call::<Bincode, _, _>(DIGEST, "Blob.digest", &(Payload::from_owner(d.clone()),))
                    .await
                    .expect("digest");
                assert_eq!((l, h), (len as u64, fnv64(&d)), "digest of call {i} ({len} B)");
            }
        });
        let t0 = Instant::now();
        futures::future::join_all(calls).await;
        println!(
            "device {dev}: 48 concurrent calls (0 B .. 1 MiB payloads) verified in {:.1} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );

        drop(client);
        srv.stop().await;

        // baseline: the same calls over rdma-rpc's TCP transport, loopback, same machine
        let tcp = transport_tcp::TcpListener::bind("127.0.0.1:0", Config::default()).await.expect("tcp bind");
        let tcp_addr = tcp.local_addr().expect("tcp addr");
        let tcp_shutdown = ShutdownHandle::new();
        let tcp_server =
            tokio::spawn(server::serve(tcp, Blob, Config::default(), tcp_shutdown.clone(), Default::default()));
        let t = transport_tcp::TcpTransport::connect(tcp_addr, Config::default()).await.expect("tcp connect");
        let tcp_client = Client::new(t, Config::default());
        let t0 = Instant::now();
        for i in 0..n {
            let d = data(64, i);
            let back: Payload = tcp_client
                .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                .await
                .expect("tcp echo");
            assert_eq!(&back[..], &d[..]);
        }
        println!(
            "device {dev}: baseline, same runtime and machine: {n} calls over TCP loopback: mean {:.1} us per call",
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        );
        drop(tcp_client);
        tcp_shutdown.shutdown();
        let _ = tokio::time::timeout(Duration::from_secs(20), tcp_server).await;
    })
    .await
    .expect("test timed out");
}

/// Waits until the monitor's counters satisfy `ok` (at most 30 s); panics with them otherwise.
async fn settle(what: &str, mon: &PoolMonitor, ok: impl Fn(&PoolCounts) -> bool) -> PoolCounts {
    eventually(what, || mon.counts(), ok).await
}

/// Polls `read` until `ok` holds (the counters are updated by other tasks, which signal no
/// one); panics with the last value after 30 s.
async fn eventually<T: std::fmt::Debug>(
    what: &str,
    read: impl Fn() -> T,
    ok: impl Fn(&T) -> bool,
) -> T {
    let t0 = Instant::now();
    loop {
        let v = read();
        if ok(&v) {
            return v;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            panic!("{what}: did not settle: {v:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every buffer of the registered pools comes back: after ordinary calls (eager and
/// rendezvous, payloads held and dropped) and after a client dies in the middle of transfers;
/// received payloads are views of pool buffers; the pools are sized so that no buffer is
/// registered on the hot path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_return_every_buffer() {
    let (dev, addr) = target(20_041);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let srv = BlobServer::start(addr, &config, RdmaOptions::default());
        let server_pools = srv.pools.clone();

        // 1. ordinary calls
        let transport = RdmaTransport::connect(addr, config.clone(), RdmaOptions::default()).await.expect("connect");
        let pools = transport.pool_monitor();
        let posted = RdmaOptions::default().recv_slots as u64;
        let client = Client::new(transport, config.clone());
        for i in 0..50 {
            let d = data(64 + i as usize, i);
            let back: Payload =
                client.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),)).await.expect("echo");
            assert_eq!(&back[..], &d[..], "eager echo {i}");
        }
        let big = data(4 << 20, 42);
        let back: Payload =
            client.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(big.clone()),)).await.expect("big echo");
        assert!(back[..] == big[..], "4 MiB echo differs");
        // the reply we hold is a view of the pool buffer it was read into: one buffer beyond
        // the posted receive slots is out until we drop it
        let held = settle("holding a 4 MiB reply", &pools, |c| c.outstanding() == posted + 1).await;
        drop(back);
        settle("reply dropped", &pools, |c| c.outstanding() == posted).await;
        let sizes = [0usize, 1, 100, 7_000, 9_000, 65_536, 300_000, 1 << 20];
        let calls = (0..32u64).map(|i| {
            let client = client.clone();
            let len = sizes[i as usize % sizes.len()];
            async move {
                let d = data(len, i);
                let (l, h): (u64, u64) = client
                    .call::<Bincode, _, _>(DIGEST, "Blob.digest", &(Payload::from_owner(d.clone()),))
                    .await
                    .expect("digest");
                assert_eq!((l, h), (len as u64, fnv64(&d)), "digest of call {i} ({len} B)");
            }
        });
        futures::future::join_all(calls).await;
        let during = settle("after concurrent calls", &pools, |c| c.outstanding() == posted).await;
        assert_eq!(during.fallback_registrations, 0, "a buffer was registered on the hot path: {during:?}");
        assert_eq!(during.live_regions, 2, "one slot pool and one rendezvous pool per connection");
        drop(client);
        let client_end = settle("client closed", &pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        let server_end = settle("server side of the closed client", &server_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        assert_eq!(server_end.fallback_registrations, 0, "server registered on the hot path: {server_end:?}");
        println!("device {dev}: pools after ordinary calls: while holding a reply {held:?}; client at the end {client_end:?}; server {server_end:?}");

        // 2. a client that dies with transfers in flight: its runtime is dropped (like a killed
        // process: its QP is destroyed and the server sees a disconnect), while the server is
        // still reading its buffers or holding payloads in handlers
        let config2 = config.clone();
        let (killed_pools, mid) = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
            let (pools, mid) = rt.block_on(async move {
                let transport = RdmaTransport::connect(addr, config2.clone(), RdmaOptions::default()).await.expect("connect");
                let pools = transport.pool_monitor();
                let client = Client::new(transport, config2);
                for (i, len) in [4usize << 20, 1 << 20, 1 << 20, 4 << 20, 1 << 20, 300_000, 1 << 20].into_iter().enumerate() {
                    let client = client.clone();
                    tokio::spawn(async move {
                        let d = data(len, i as u64);
                        let _: Result<(u64, u64), _> = client.call::<Bincode, _, _>(HOLD, "Blob.hold", &(Payload::from_owner(d),)).await;
                    });
                }
                tokio::spawn(async move {
                    let _keep = client;
                    std::future::pending::<()>().await
                });
                // killed as soon as its transfers are under way (it has lent buffers)
                let mid = eventually("the client lends buffers", || pools.counts(), |c| c.leased > posted).await;
                (pools, mid)
            });
            drop(rt);
            (pools, mid)
        })
        .join()
        .expect("client thread");
        let killed_end = settle("killed client", &killed_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        let server_mid = server_pools.counts();
        let server_end = settle("server side of the killed client", &server_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        println!("device {dev}: pools around a client killed mid-transfer: client at the kill {mid:?}, after {killed_end:?}; server just after {server_mid:?}, at the end {server_end:?}");

        srv.stop().await;
    })
    .await
    .expect("test timed out");
}

/// A hostile peer speaking the packet protocol by hand on a bare [`RdmaConnection`].
struct Raw {
    conn: RdmaConnection,
}

impl Raw {
    async fn connect(addr: SocketAddr) -> Raw {
        let opts = RdmaOptions::default();
        let conn = RdmaConnection::connect(addr, opts.clone())
            .await
            .expect("raw connect");
        // windows are granted, not assumed: the server may send us 2 packets until we grant
        // the rest of our receive slots (what the transport's first packet does)
        let mut out = BytesMut::new();
        let grant = opts.recv_slots as u16 - rpc_core::rendezvous::START_WINDOW as u16;
        Packet::encode_control(&mut out, grant, &Packet::Credit);
        conn.send(&out).await.expect("raw grant");
        Raw { conn }
    }

    /// Announces a `Blob.echo` request whose payload is "at" `segment` (whatever it claims).
    async fn announce_echo(&self, id: u64, segment: Segment) {
        let mut header = Header::new(Kind::Request, id);
        header.method = ECHO;
        // the arguments `(Payload,)`: the payload is attachment 0
        let mut body = Vec::new();
        <Bincode as Codec>::encode(&(0u32,), &mut body).expect("encode");
        let msg = Message {
            header,
            body: body.into(),
            attachments: vec![Payload::from_owner(vec![0u8; segment.len as usize])].into(),
        };
        let mut out = BytesMut::new();
        Packet::encode_pull_rts(&mut out, 0, id, &msg, &[segment]);
        self.conn.send(&out).await.expect("raw send");
    }

    /// The next packet from the server, `None` once the server closed this connection.
    async fn next(&self) -> Option<Packet> {
        let limits = Config::default().limits();
        match self.conn.recv_bytes().await {
            Ok(Some(b)) => Some(
                Packet::parse(b, &limits)
                    .expect("the server sends valid packets")
                    .0,
            ),
            Ok(None) | Err(_) => None,
        }
    }

    /// Waits until the server has dropped this connection (packets before that are ignored).
    async fn dropped_by_server(&self, what: &str) {
        tokio::time::timeout(Duration::from_secs(60), async {
            while self.next().await.is_some() {}
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: the server did not close the offending connection"));
    }
}

/// A peer that forges or steals remote keys, addresses or lengths gets an error on its own
/// connection; the server, its memory and its other clients go on (issue 5, "Security").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_keys_hurt_only_their_own_connection() {
    let (dev, addr) = target(20_061);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let srv = BlobServer::start(addr, &config, RdmaOptions::default());
        let server_pools = srv.pools.clone();
        let good = Client::new(
            RdmaTransport::connect(addr, config.clone(), RdmaOptions::default()).await.expect("connect"),
            config.clone(),
        );
        let mut round = 0u64;
        let mut good_calls = || {
            round += 1;
            let good = good.clone();
            let seed = round;
            async move {
                for len in [64usize, 64 << 10] {
                    let d = data(len, seed);
                    let back: Payload = good
                        .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                        .await
                        .expect("the well-behaved client's call");
                    assert!(back[..] == d[..], "echo of {len} B differs");
                }
            }
        };
        good_calls().await;

        // 1. an address and key out of thin air: the server's READ fails, on that connection
        let forger = Raw::connect(addr).await;
        forger.announce_echo(1, Segment { addr: 0x7f00_dead_0000, len: 64 << 10, rkey: 0x00c0_ffee }).await;
        forger.dropped_by_server("forged address and key").await;
        good_calls().await;

        // 2. a real buffer and key, a length past its end
        let liar = Raw::connect(addr).await;
        let mut small = liar.conn.alloc_buffer(4096).expect("alloc");
        small.bytes_mut().expect("bytes").fill(7);
        let exposed = small.expose(RemoteAccess::Read).expect("expose");
        let t = exposed.token();
        liar.announce_echo(1, Segment { addr: t.addr, len: 1 << 20, rkey: t.rkey }).await;
        liar.dropped_by_server("length past the exposed buffer").await;
        good_calls().await;

        // 3. a key the server lent to another connection: an honest call gets the server's
        //    buffer key for its echoed payload; another connection cannot use it
        let honest = Raw::connect(addr).await;
        let sent = data(64 << 10, 99);
        let mut src = honest.conn.alloc_buffer(sent.len()).expect("alloc");
        src.bytes_mut().expect("bytes").copy_from_slice(&sent);
        let src_exposed = src.expose(RemoteAccess::Read).expect("expose");
        let t = src_exposed.token();
        honest.announce_echo(5, Segment { addr: t.addr, len: t.len, rkey: t.rkey }).await;
        let (_reply_id, lent) = loop {
            match honest.next().await.expect("the honest call is answered") {
                Packet::PullRts { id, segments, .. } => break (id, segments[0]),
                Packet::Fin { id } => assert_eq!(id, 5, "Fin for our transfer"),
                _ => {}
            }
        };
        assert_eq!(lent.len, sent.len() as u64);
        let stolen = RemoteToken { addr: lent.addr, len: lent.len, rkey: lent.rkey };
        let thief = Raw::connect(addr).await;
        let mut dst = thief.conn.alloc_buffer(sent.len()).expect("alloc");
        let read = tokio::time::timeout(Duration::from_secs(60), thief.conn.read(&mut dst, 0, &stolen, 0, sent.len()))
            .await
            .expect("a READ with a stolen key completes (with an error)");
        assert!(read.is_err(), "a READ with another connection's key must fail");
        thief.dropped_by_server("READ with a stolen key").await;
        assert!(dst.bytes().map(|b| b.iter().all(|&x| x == 0)).unwrap_or(true), "no byte of the server's buffer arrived");
        let vandal = Raw::connect(addr).await;
        let mut junk = vandal.conn.alloc_buffer(4096).expect("alloc");
        junk.bytes_mut().expect("bytes").fill(0xEE);
        let write = tokio::time::timeout(Duration::from_secs(60), vandal.conn.write(&mut junk, 0, &stolen, 0, 4096))
            .await
            .expect("a WRITE with a stolen key completes (with an error)");
        // On InfiniBand/RoCE the WRITE fails at once (the responder NAKs it); on iWARP a WRITE
        // completes when it leaves (no acknowledgement) and the responder terminates the
        // connection instead. Either way the vandal's connection ends, and the bytes below
        // show that nothing was written.
        tracing::info!("WRITE with a stolen key: {write:?}");
        vandal.dropped_by_server("WRITE with a stolen key").await;
        // the rightful reader gets the bytes, untouched by the vandal
        let mut mine = honest.conn.alloc_buffer(sent.len()).expect("alloc");
        honest.conn.read(&mut mine, 0, &stolen, 0, sent.len()).await.expect("the owner reads its reply");
        assert!(mine.bytes().expect("bytes")[..] == sent[..], "the echoed payload is intact");
        good_calls().await;

        // 4. the rightful peer itself WRITEs with the key of a pull token it was given (read
        //    access): the echoed reply is the very pool buffer the server pulled the request
        //    into and handed to its handler (re-exposed without a copy), so a write there would
        //    change data the server delivered. The key must not allow it: the WRITE fails
        //    (InfiniBand/RoCE NAK it; on iWARP the responder terminates the connection), only
        //    this peer's connection ends, and the server's bytes stay as they were.
        let mut graffiti = honest.conn.alloc_buffer(sent.len()).expect("alloc");
        graffiti.bytes_mut().expect("bytes").fill(0x5A);
        let overwrite = tokio::time::timeout(Duration::from_secs(60), honest.conn.write(&mut graffiti, 0, &stolen, 0, sent.len()))
            .await
            .expect("a WRITE with a read key completes (with an error on IB/RoCE)");
        tracing::info!("WRITE with a pull token's key: {overwrite:?}");
        // if the connection still works, the server's buffer must be unchanged (before the
        // rendezvous pool was split by access, this READ succeeded and returned 0x5A bytes)
        let mut again = honest.conn.alloc_buffer(sent.len()).expect("alloc");
        let reread = tokio::time::timeout(Duration::from_secs(60), honest.conn.read(&mut again, 0, &stolen, 0, sent.len()))
            .await
            .expect("a READ after the WRITE completes");
        if reread.is_ok() {
            let b = again.bytes().expect("bytes");
            assert!(
                b[..] == sent[..],
                "a WRITE with a pull token's (read) key changed the server's exposed buffer: {} of {} bytes are now 0x5A",
                b.iter().filter(|&&x| x == 0x5A).count(),
                b.len()
            );
        }
        assert!(
            overwrite.is_err() || reread.is_err(),
            "a WRITE with a pull token's (read) key went through and the connection lives on: {overwrite:?} {reread:?}"
        );
        honest.dropped_by_server("WRITE with a pull token's read key").await;
        good_calls().await;
        println!(
            "device {dev}: forged key, overlong length, stolen key (READ, and WRITE: {}), WRITE with a pull token's read key ({}): each ended only its own connection; the server's bytes were unchanged; the other client's calls went on",
            if write.is_err() { "failed at once" } else { "terminated by the responder" },
            match (&overwrite, &reread) {
                (Err(e), _) => format!("failed at once: {e}"),
                (Ok(()), Err(e)) => format!("terminated by the responder, next READ: {e}"),
                (Ok(()), Ok(())) => "went through?!".to_string(),
            }
        );

        // nothing leaked on the server: every buffer back once the connections are gone
        drop((forger, liar, exposed, small, honest, src_exposed, src, thief, vandal, good));
        let end = settle("server after the attacks", &server_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        println!("device {dev}: server pools after the attacks: {end:?}");
        srv.stop().await;
    })
    .await
    .expect("test timed out");
}

/// Sender-push both ways (every rendezvous by RDMA WRITE into granted buffers): payloads come
/// back byte-exact, concurrent transfers too, and every buffer returns to both pools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_rendezvous_returns_every_buffer() {
    let (dev, addr) = target(20_081);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let opts = RdmaOptions { push_up_to: u64::MAX, ..RdmaOptions::default() };
        let srv = BlobServer::start(addr, &config, opts.clone());
        let server_pools = srv.pools.clone();
        let transport = RdmaTransport::connect(addr, config.clone(), opts).await.expect("connect");
        let client_pools = transport.pool_monitor();
        let client = Client::new(transport, config);
        let sizes = [9_000usize, 64 << 10, 1 << 20, 4 << 20];
        let calls = (0..16u64).map(|i| {
            let client = client.clone();
            let d = data(sizes[i as usize % sizes.len()], i);
            async move {
                let back: Payload = client
                    .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                    .await
                    .expect("pushed echo");
                assert!(back[..] == d[..], "pushed echo {i} of {} B differs", d.len());
            }
        });
        let t0 = Instant::now();
        futures::future::join_all(calls).await;
        println!("device {dev}: 16 concurrent echoes by sender-push (9 KB .. 4 MiB) verified in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
        drop(client);
        let c = settle("client pools after push", &client_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        let s = settle("server pools after push", &server_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        println!("device {dev}: pools after push: client {c:?}, server {s:?}");
        srv.stop().await;
    })
    .await
    .expect("test timed out");
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .expect("VmRSS in /proc/self/status")
}

/// Attachments larger than the rendezvous pool's largest class (4 MiB by default) get
/// registered buffers that are kept for the next ones (`RdmaOptions::large_buffer_bytes`): a
/// run of 16 MiB and 32 MiB echoes, one at a time and two at once, registers nothing per
/// transfer on either side, stays within the bound, and gives every buffer back; with the
/// bound at 0 each such transfer registers a buffer of its own, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_attachments_reuse_registered_buffers() {
    large_attachments(20_181, RdmaOptions::default()).await;
}

/// The same by sender-push: the grants for large pushes come from kept write-exposed regions,
/// and the server sends what was pushed to it back from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_pushes_reuse_registered_buffers() {
    let push = RdmaOptions {
        push_up_to: u64::MAX,
        ..RdmaOptions::default()
    };
    large_attachments(20_185, push).await;
}

async fn large_attachments(port: u16, opts: RdmaOptions) {
    let (dev, addr) = target(port);
    let push = opts.push_up_to > 0;
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let srv = BlobServer::start(addr, &config, opts.clone());
        let server_pools = srv.pools.clone();
        let transport = RdmaTransport::connect(addr, config.clone(), opts.clone())
            .await
            .expect("connect");
        let pools = transport.pool_monitor();
        let posted = RdmaOptions::default().recv_slots as u64;
        let client = Client::new(transport, config.clone());
        let echo = |client: Client, len: usize, seed: u64| async move {
            let d = data(len, seed);
            let back: Payload = client
                .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                .await
                .unwrap_or_else(|e| panic!("echo of {len} B: {e}"));
            assert!(
                back.len() == d.len() && back[..] == d[..],
                "echo of {len} B differs"
            );
        };
        let t0 = Instant::now();
        for i in 0..4 {
            echo(client.clone(), 16 << 20, i).await;
        }
        futures::future::join(
            echo(client.clone(), 16 << 20, 10),
            echo(client.clone(), 16 << 20, 11),
        )
        .await;
        echo(client.clone(), 32 << 20, 12).await;
        println!(
            "device {dev}: 6 echoes of 16 MiB and one of 32 MiB in {:.0} ms",
            t0.elapsed().as_secs_f64() * 1e3
        );
        // receive slots (1 MiB) and the rendezvous pool (15 MiB), under push its write-exposed
        // part too (15 MiB)
        let base = if push { 31u64 << 20 } else { 16 << 20 };
        for (side, mon) in [("client", &pools), ("server", &server_pools)] {
            let c = settle(side, mon, |c| c.outstanding() == posted).await;
            println!("device {dev}: {side} after the large echoes: {c:?}");
            assert_eq!(
                c.fallback_registrations, 0,
                "{side}: a transfer registered a buffer: {c:?}"
            );
            if side == "server" {
                assert_eq!(c.copied_bytes, 0, "server: an echo was copied: {c:?}");
            }
            assert!(
                c.registered_bytes <= base + transport_rdma::DEFAULT_LARGE_BUFFER_BYTES,
                "{side}: {} bytes registered",
                c.registered_bytes
            );
        }
        drop(client);
        settle("client closed", &pools, |c| {
            c.outstanding() == 0 && c.live_regions == 0
        })
        .await;

        // the bound at 0: every large transfer registers its own buffer
        let opts = RdmaOptions {
            large_buffer_bytes: 0,
            ..opts
        };
        let transport = RdmaTransport::connect(addr, config.clone(), opts)
            .await
            .expect("connect");
        let pools = transport.pool_monitor();
        let client = Client::new(transport, config.clone());
        for i in 0..2 {
            echo(client.clone(), 16 << 20, 20 + i).await;
        }
        let c = settle("bound 0", &pools, |c| c.outstanding() == posted).await;
        assert_eq!(
            c.fallback_registrations, 4,
            "a registration for each source and sink (or grant): {c:?}"
        );
        drop(client);
        settle("second client closed", &pools, |c| {
            c.outstanding() == 0 && c.live_regions == 0
        })
        .await;
        srv.stop().await;
        settle("server stopped", &server_pools, |c| {
            c.outstanding() == 0 && c.live_regions == 0
        })
        .await;
    })
    .await
    .expect("test timed out");
}

/// A payload filled in a buffer the connection lends (`Client::payload_mut`) is sent without a
/// copy: the server READs it where it is, at 64 KiB (a pool class), 1 MiB and 16 MiB (a kept
/// large region); the server echoes what it received by pull without a copy too. A heap
/// payload is copied once per send, which the same counter shows. A lent buffer stays out of
/// the pool while its payload lives; once the connection is gone, heap memory is lent instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lent_payloads_are_sent_without_a_copy() {
    sent_without_a_copy(
        20_191,
        RdmaOptions::default(),
        &[64 << 10, 1 << 20, 16 << 20],
    )
    .await;
}

/// The same by sender-push: the client WRITEs a lent payload from where it is, and the server
/// WRITEs back what was pushed into its granted buffer from there (a pool buffer, or at 16 MiB
/// a kept write-exposed region), no copy on either side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lent_payloads_are_pushed_without_a_copy() {
    let push = RdmaOptions {
        push_up_to: u64::MAX,
        ..RdmaOptions::default()
    };
    sent_without_a_copy(20_193, push, &[64 << 10, 1 << 20, 16 << 20]).await;
}

async fn sent_without_a_copy(port: u16, opts: RdmaOptions, sizes: &[usize]) {
    let (dev, addr) = target(port);
    let sizes = sizes.to_vec();
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let srv = BlobServer::start(addr, &config, opts.clone());
        let server_pools = srv.pools.clone();
        let transport = RdmaTransport::connect(addr, config.clone(), opts.clone())
            .await
            .expect("connect");
        let pools = transport.pool_monitor();
        let posted = RdmaOptions::default().recv_slots as u64;
        let client = Client::new(transport, config.clone());
        let echo = |p: Payload| {
            let client = client.clone();
            async move {
                let back: Payload = client
                    .call::<Bincode, _, _>(ECHO, "Blob.echo", &(p.clone(),))
                    .await
                    .unwrap_or_else(|e| panic!("echo of {} B: {e}", p.len()));
                assert!(back[..] == p[..], "echo of {} B differs", p.len());
            }
        };
        for (i, len) in sizes.into_iter().enumerate() {
            let mut buf = client.payload_mut(len);
            assert!(buf.is_lent(), "{len} B: the connection lent no buffer");
            assert_eq!(buf.len(), len);
            buf.copy_from_slice(&data(len, i as u64));
            let p = buf.freeze();
            let before = pools.counts();
            echo(p.clone()).await;
            futures::future::join(echo(p.clone()), echo(p.slice(1..len - 1))).await;
            let c = pools.counts();
            assert!(
                c.outstanding() > posted,
                "{len} B: the lent buffer is back in the pool while its payload lives: {c:?}"
            );
            drop(p);
            let c = settle("lent payload dropped", &pools, |c| {
                c.outstanding() == posted
            })
            .await;
            assert_eq!(
                (c.copied_sends, c.copied_bytes),
                (before.copied_sends, before.copied_bytes),
                "{len} B: a lent payload was copied: {c:?}"
            );
        }
        let s = server_pools.counts();
        assert_eq!(
            s.copied_bytes, 0,
            "the server copied a payload it had received: {s:?}"
        );
        // a heap payload: one copy per send
        let before = pools.counts();
        echo(Payload::from(data(1 << 20, 7))).await;
        let c = settle("heap payload", &pools, |c| c.outstanding() == posted).await;
        assert_eq!(
            (
                c.copied_sends - before.copied_sends,
                c.copied_bytes - before.copied_bytes
            ),
            (1, 1 << 20),
            "a heap payload is copied once: {c:?}"
        );
        println!("device {dev}: client {c:?}, server {s:?}");
        // the connection gone, nothing is lent
        srv.stop().await;
        client.closed().await;
        eventually(
            "lent after the connection closed",
            || client.payload_mut(4096).is_lent(),
            |lent| !lent,
        )
        .await;
        drop(client);
        settle("client closed", &pools, |c| {
            c.outstanding() == 0 && c.live_regions == 0
        })
        .await;
        settle("server stopped", &server_pools, |c| {
            c.outstanding() == 0 && c.live_regions == 0
        })
        .await;
    })
    .await
    .expect("test timed out");
}

/// CPU time this process has used (user and system), from `/proc/self/stat` (in USER_HZ ticks,
/// which are 10 ms on Linux).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // the fields after the command name, which is in parentheses and may hold spaces
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // fields 14 and 15 of proc(5): utime, stime; `rest` starts at field 3
    let ticks: u64 = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    Duration::from_millis(ticks * 10)
}

/// With the default options, connections poll their completion queue only for a short window
/// after activity (at most `busy_poll_max`), then sleep on the completion channel: after a
/// burst of calls, 8 idle connections (both ends in this process) use almost no CPU, and a call
/// on each still completes, woken by a completion event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_sleep() {
    let (dev, addr) = target(20_111);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let srv = BlobServer::start(addr, &config, RdmaOptions::default());
        let mut clients = Vec::new();
        for _ in 0..8 {
            let t = RdmaTransport::connect(addr, config.clone(), RdmaOptions::default())
                .await
                .expect("connect");
            clients.push(Client::new(t, config.clone()));
        }
        // a burst on each: the spin window adapts to the round trip
        for (i, c) in clients.iter().enumerate() {
            for j in 0..100u64 {
                let d = data(64, j);
                let back: Payload = c
                    .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                    .await
                    .unwrap_or_else(|e| panic!("connection {i}, call {j}: {e}"));
                assert!(back[..] == d[..]);
            }
        }
        // then idle: a spinning connection would take a whole worker (1 s of CPU per second)
        let (cpu0, t0) = (cpu_time(), Instant::now());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (cpu, wall) = (cpu_time() - cpu0, t0.elapsed());
        println!(
            "device {dev}: 8 idle connections, both ends in one process: {} ms of CPU in {} ms",
            cpu.as_millis(),
            wall.as_millis()
        );
        assert!(
            cpu * 5 < wall,
            "idle connections used {cpu:?} of CPU in {wall:?}"
        );
        // and every connection still answers, woken from its sleep
        for (i, c) in clients.iter().enumerate() {
            let d = data(64, i as u64);
            let back: Payload = c
                .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                .await
                .unwrap_or_else(|e| panic!("connection {i} after idling: {e}"));
            assert!(back[..] == d[..]);
        }
        drop(clients);
        srv.stop().await;
    })
    .await
    .expect("test timed out");
}

/// Many idle connections to one server, each with its own registered pools (no shared receive
/// queue yet): all of them work, and what one costs is measured and bounded, with small pools
/// (`RdmaOptions::pool_classes`, `recv_slots`; first, while RSS is not yet inflated by freed
/// memory the allocator keeps) and with the default ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_memory() {
    let (dev, addr) = target(20_101);
    tokio::time::timeout(LIMIT, async move {
        for (label, opts, n) in [
            (
                "small pools",
                RdmaOptions {
                    recv_slots: 8,
                    pool_classes: vec![transport_rdma::SizeClass { size: 64 << 10, count: 4 }],
                    ..RdmaOptions::default()
                },
                64usize,
            ),
            ("default pools", RdmaOptions::default(), 64),
        ] {
            let config = Config::default();
            let srv = BlobServer::start(addr, &config, opts.clone());
            let server_pools = srv.pools.clone();
            let rss0 = rss_kib();
            // as many as the guest allows, up to n
            let mut clients = Vec::with_capacity(n);
            let mut stopped = None;
            for _ in 0..n {
                match RdmaTransport::connect(addr, config.clone(), opts.clone()).await {
                    Ok(t) => clients.push(Client::new(t, config.clone())),
                    Err(e) => {
                        stopped = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = &stopped {
                println!("device {dev}: ({label}) the device took {} connections, then: {e}", clients.len());
            }
            assert!(clients.len() >= 8, "{label}: only {} connections: {stopped:?}", clients.len());
            let n = clients.len();
            for (i, c) in clients.iter().enumerate() {
                let d = data(64, i as u64);
                let back: Payload =
                    c.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),)).await.expect("call");
                assert!(back[..] == d[..]);
            }
            let per_conn_kib = rss_kib().saturating_sub(rss0) / n as u64;
            let registered = server_pools.counts().registered_bytes / n as u64;
            println!(
                "device {dev}: {n} idle RDMA connections ({label}): {per_conn_kib} KiB RSS per connection, both ends in one process; server registers {} KiB per connection",
                registered / 1024
            );
            // everything a connection costs is its registered pools (slots, rendezvous) and
            // small bookkeeping: both ends together stay within twice the registered size
            // plus 1 MiB
            assert!(
                per_conn_kib <= 2 * registered / 1024 + 1024,
                "{label}: {per_conn_kib} KiB per connection for {} KiB registered per side",
                registered / 1024
            );
            drop(clients);
            settle(label, &server_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
            srv.stop().await;
        }
    })
    .await
    .expect("test timed out");
}

/// A `Blob` server on a runtime of its own, in a thread of its own, so that it can die the way
/// a killed process does: every task, connection and handler dropped at once, mid-flight, with
/// no shutdown and no goodbye.
struct Doomed {
    pools: PoolMonitor,
    rt: test_support::DoomedRuntime,
}

impl Doomed {
    fn start(addr: SocketAddr, config: &Config, opts: RdmaOptions) -> Doomed {
        let config = config.clone();
        let (pools, rt) = test_support::DoomedRuntime::start(move || async move {
            let srv = BlobServer::start(addr, &config, opts);
            // the server still runs, from its own point of view: its runtime goes first
            (srv.pools.clone(), srv)
        });
        Doomed { pools, rt }
    }

    /// Kills it; its pool counters afterwards.
    fn kill(self) -> PoolMonitor {
        self.rt.kill();
        self.pools
    }
}

/// The server dies at each stage of a call (before the request, with its RDMA READs of our
/// attachments or its handlers still running, after its reply arrived), with pull and with push
/// rendezvous. Each time: the client's calls fail with `ConnectionClosed` well within the
/// keep-alive timeout (never hang), a reply received before the death stays intact, every buffer
/// of the client's pools comes back (and of the dead server's, once its runtime is gone), and a
/// new connection to a new server works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_at_every_stage() {
    let (dev, addr) = target(20_121);
    tokio::time::timeout(LIMIT, async move {
        let mut config = Config::default();
        config.keepalive_interval = Duration::from_millis(250);
        config.keepalive_timeout = Duration::from_secs(3);
        // failing "within the keep-alive time": the timeout plus an interval, and slack for TCG
        let bound = config.keepalive_timeout * 3;
        let posted = RdmaOptions::default().recv_slots as u64;
        let mut port = addr.port();
        for (mode, opts) in [
            ("pull", RdmaOptions::default()),
            ("push", RdmaOptions { push_up_to: u64::MAX, ..RdmaOptions::default() }),
        ] {
            for stage in ["before the request", "mid-transfer", "after the reply"] {
                port += 1;
                let at = SocketAddr::new(addr.ip(), port);
                let srv = Doomed::start(at, &config, opts.clone());
                let transport =
                    RdmaTransport::connect(at, config.clone(), opts.clone()).await.expect("connect");
                let pools = transport.pool_monitor();
                let client = Client::new(transport, config.clone());
                let mut calls = Vec::new();
                let mut kept: Option<(Payload, Vec<u8>)> = None;
                match stage {
                    "before the request" => {}
                    "mid-transfer" => {
                        // four 4 MiB attachments: the server READs them (pull) or grants buffers
                        // we WRITE into (push), then holds them in its handlers
                        for i in 0..4u64 {
                            let client = client.clone();
                            calls.push(tokio::spawn(async move {
                                let d = data(4 << 20, i);
                                client
                                    .call::<Bincode, _, (u64, u64)>(HOLD, "Blob.hold", &(Payload::from_owner(d),))
                                    .await
                                    .map(|_| ())
                            }));
                        }
                        // the server has leased a buffer for an attachment: the transfer runs
                        settle("server mid-transfer", &srv.pools, |c| c.outstanding() > posted).await;
                    }
                    _ => {
                        let d = data(1 << 20, 7);
                        let back: Payload = client
                            .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                            .await
                            .expect("echo before the death");
                        kept = Some((back, d));
                    }
                }
                let dead_pools = srv.kill();
                let t0 = Instant::now();
                for c in calls {
                    let r = tokio::time::timeout(bound, c)
                        .await
                        .unwrap_or_else(|_| panic!("[{mode}, {stage}] a call in flight hangs after the server died"))
                        .expect("call task");
                    assert!(matches!(r, Err(rpc_core::RpcError::ConnectionClosed)), "[{mode}, {stage}] call in flight: {r:?}");
                }
                let r = tokio::time::timeout(
                    bound,
                    client.call::<Bincode, _, (u64, u64)>(DIGEST, "Blob.digest", &(Payload::from_owner(data(64, 1)),)),
                )
                .await
                .unwrap_or_else(|_| panic!("[{mode}, {stage}] a new call hangs after the server died"));
                assert!(matches!(r, Err(rpc_core::RpcError::ConnectionClosed)), "[{mode}, {stage}] new call: {r:?}");
                let failed_in = t0.elapsed();
                if let Some((back, d)) = kept.take() {
                    assert!(back[..] == d[..], "[{mode}, {stage}] a reply received before the death changed");
                }
                drop(client);
                let c = settle("client pools after the server died", &pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
                let s = settle("the dead server's pools", &dead_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
                // a new server, a new connection: it works
                port += 1;
                let at = SocketAddr::new(addr.ip(), port);
                let fresh = BlobServer::start(at, &config, opts.clone());
                let transport =
                    RdmaTransport::connect(at, config.clone(), opts.clone()).await.expect("connect to a new server");
                let client = Client::new(transport, config.clone());
                let d = data(2 << 20, 9);
                let (l, h): (u64, u64) = client
                    .call::<Bincode, _, _>(DIGEST, "Blob.digest", &(Payload::from_owner(d.clone()),))
                    .await
                    .expect("a call on a new connection");
                assert_eq!((l, h), (d.len() as u64, fnv64(&d)), "[{mode}, {stage}] new connection");
                drop(client);
                fresh.stop().await;
                println!(
                    "device {dev}: server killed {stage} ({mode}): calls failed with ConnectionClosed within {:.0} ms; client pools {c:?}; dead server's pools {s:?}; a new connection works",
                    failed_in.as_secs_f64() * 1e3
                );
            }
        }
    })
    .await
    .expect("test timed out");
}

/// A peer that sends more large attachments at once than a connection's fallback budget
/// (`max_fallback_bytes`) allows: with pools too small to lend, every attachment needs a
/// registered buffer; the transfers beyond the budget wait for earlier payloads to be dropped,
/// so the registered bytes held at once never exceed the budget. Every call still succeeds with
/// the right bytes, by pull and by push, and every byte and buffer comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_budget_bounds_registered_memory() {
    let (dev, addr) = target(20_141);
    tokio::time::timeout(LIMIT, async move {
        let mut config = Config::default();
        config.max_message_size = 4 << 20;
        let budget: u64 = 8 << 20;
        for (i, (mode, push_up_to)) in [("pull", 0u64), ("push", u64::MAX)].into_iter().enumerate() {
            let at = SocketAddr::new(addr.ip(), addr.port() + i as u16);
            let server_opts = RdmaOptions {
                pool_classes: vec![transport_rdma::SizeClass { size: 64 << 10, count: 2 }],
                max_fallback_bytes: budget,
                // no kept large buffers: every attachment above the 64 KiB class registers
                // (those are bounded on their own, see large_attachments_reuse_registered_buffers)
                large_buffer_bytes: 0,
                push_up_to,
                ..RdmaOptions::default()
            };
            let srv = BlobServer::start(at, &config, server_opts.clone());
            let transport = RdmaTransport::connect(at, config.clone(), server_opts).await.expect("connect");
            let client = Client::new(transport, config.clone());
            // eight 3 MiB attachments held 0.5 s each by the server's handlers: 24 MiB if
            // nothing waited
            let calls = (0..8u64).map(|i| {
                let client = client.clone();
                async move {
                    let d = data(3 << 20, i);
                    let (l, h): (u64, u64) = client
                        .call::<Bincode, _, _>(HOLD, "Blob.hold", &(Payload::from_owner(d.clone()),))
                        .await
                        .expect("a call beyond the budget waits, then succeeds");
                    assert_eq!((l, h), (d.len() as u64, fnv64(&d)), "[{mode}] attachment {i}");
                }
            });
            let t0 = Instant::now();
            futures::future::join_all(calls).await;
            let took = t0.elapsed();
            drop(client);
            let s = settle("server pools after the budgeted calls", &srv.pools, |c| {
                c.outstanding() == 0 && c.live_regions == 0 && c.fallback_bytes == 0
            })
            .await;
            assert!(s.fallback_registrations >= 8, "[{mode}] the pool lent what it should not have: {s:?}");
            assert!(
                s.fallback_bytes_peak <= budget,
                "[{mode}] {} bytes registered at once, over the budget of {budget}: {s:?}",
                s.fallback_bytes_peak
            );
            assert!(s.fallback_bytes_peak >= 6 << 20, "[{mode}] the budget was not used: {s:?}");
            println!(
                "device {dev}: [{mode}] 8 x 3 MiB held by handlers, budget 8 MiB: at most {} MiB registered at once, {} fallback registrations, {:.0} ms",
                s.fallback_bytes_peak >> 20,
                s.fallback_registrations,
                took.as_secs_f64() * 1e3
            );
            srv.stop().await;
        }
    })
    .await
    .expect("test timed out");
}

/// The one shared receive queue of a server (its only device), once a connection made it.
fn srq_stats(mon: &SharedReceiveMonitor) -> SharedReceiveStats {
    let all = mon.stats();
    assert_eq!(
        all.len(),
        1,
        "one shared receive queue, on the one device: {all:?}"
    );
    all[0].1
}

/// Waits (bounded) until every slot of the server's shared receive queue is free and posted
/// again: all windows given back, no receive lost.
/// Waits until every slot of the shared receive queue is posted. A completion is retired before
/// its slot (or a fresh one) is posted again, so a packet still arriving (a credit return after
/// the last answer) makes the count one short for a moment: a single reading may miss a slot
/// that is about to come back.
async fn srq_all_posted(what: &str, mon: &SharedReceiveMonitor) -> SharedReceiveStats {
    eventually(what, || srq_stats(mon), |s| s.posted == s.slots as usize).await
}

async fn srq_settles(what: &str, mon: &SharedReceiveMonitor) -> SharedReceiveStats {
    eventually(
        what,
        || srq_stats(mon),
        |s| s.free == s.slots && s.posted == s.slots as usize,
    )
    .await
}

/// A server with a shared receive queue (`srq_slots`): as many connections as the device takes
/// (up to 256), each answering; the server registers its receive slots once, so its registered
/// memory does not grow with the connections (the number is the same with 1 and with all of
/// them), and every slot is back in the queue and in the budget when they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_receive_queue_many_connections() {
    let (dev, addr) = target(20_141);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let slots = 1024usize;
        let server_opts = RdmaOptions { srq_slots: slots, ..RdmaOptions::default() };
        let srv = BlobServer::start(addr, &config, server_opts);
        let client_opts = RdmaOptions::default();
        let echo = |c: Client, i: u64| async move {
            let d = data(64, i);
            let back: Payload =
                c.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),)).await.expect("call");
            assert!(back[..] == d[..], "echo {i}");
        };
        let first = Client::new(
            RdmaTransport::connect(addr, config.clone(), client_opts.clone()).await.expect("connect"),
            config.clone(),
        );
        echo(first.clone(), 0).await;
        let registered_1 = srv.pools.counts().registered_bytes;
        let s1 = srq_all_posted("every slot is posted", &srv.srq).await;
        assert_eq!(s1.slots as usize, slots);
        let rss0 = rss_kib();
        let mut clients = vec![first];
        let mut monitors = Vec::new();
        let mut stopped = None;
        while clients.len() < 256 {
            match RdmaTransport::connect(addr, config.clone(), client_opts.clone()).await {
                Ok(t) => {
                    monitors.push(t.pool_monitor());
                    clients.push(Client::new(t, config.clone()))
                }
                Err(e) => {
                    stopped = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = &stopped {
            println!("device {dev}: (shared receive queue) the device took {} connections, then: {e}", clients.len());
        }
        let n = clients.len();
        assert!(n >= 8, "only {n} connections: {stopped:?}");
        for (i, c) in clients.iter().enumerate() {
            echo(c.clone(), i as u64).await;
        }
        let registered_n = srv.pools.counts().registered_bytes;
        let sn = srq_all_posted("every slot is posted", &srv.srq).await;
        let per_conn_kib = rss_kib().saturating_sub(rss0) / (n as u64 - 1);
        // the client's own receive slots (registered, touched) are most of that
        let client_kib = monitors[0].counts().registered_bytes / 1024;
        println!(
            "device {dev}: {n} idle RDMA connections to a server with a shared receive queue of {slots} slots ({} KiB registered): server registered {} KiB with 1 connection, {} KiB with {n}; {per_conn_kib} KiB RSS per added connection, both ends in one process, of which {client_kib} KiB are the client's own registered receive slots, so about {} KiB for the server's side and both ends' bookkeeping; {} of {slots} slots free",
            sn.registered_bytes / 1024,
            registered_1 / 1024,
            registered_n / 1024,
            per_conn_kib.saturating_sub(client_kib),
            sn.free
        );
        assert_eq!(registered_n, registered_1, "the server's registered memory grew with its connections");
        assert!(
            sn.free as usize <= slots - 2 * n,
            "each of {n} connections holds at least its start window: {sn:?}"
        );
        drop(clients);
        srq_settles("after the connections closed", &srv.srq).await;
        // what is still leased is the slots posted to the shared receive queue, no more
        settle("server pools", &srv.pools, |c| c.outstanding() == slots as u64).await;
        srv.stop().await;
    })
    .await
    .expect("test timed out");
}

/// Connections that together want far more than a small shared receive queue holds (16 slots
/// for 6 connections of up to 32 each, 16 calls in flight on each, eager and rendezvous): every
/// call is answered byte-exact and no connection fails, which on iWARP (siw) shows that no SEND
/// ever found the queue empty (that would terminate the connection); a connection over what
/// the queue can admit is refused, and admitted once another has gone; all slots come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_receive_queue_under_pressure() {
    let (dev, addr) = target(20_161);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let slots = 16usize;
        let server_opts = RdmaOptions { srq_slots: slots, ..RdmaOptions::default() };
        let srv = BlobServer::start(addr, &config, server_opts);
        let mut clients = Vec::new();
        for _ in 0..6 {
            clients.push(Client::new(
                RdmaTransport::connect(addr, config.clone(), RdmaOptions::default()).await.expect("connect"),
                config.clone(),
            ));
        }
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for (ci, c) in clients.iter().enumerate() {
            for k in 0..16u64 {
                let c = c.clone();
                tasks.push(tokio::spawn(async move {
                    for round in 0..20u64 {
                        let seed = (ci as u64) << 32 | k << 16 | round;
                        // mostly eager; every fifth call a rendezvous (its control packets use
                        // the window too)
                        let len = if round % 5 == 4 { 64 << 10 } else { 64 + (seed as usize % 4000) };
                        let d = data(len, seed);
                        let back: Payload = c
                            .call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),))
                            .await
                            .unwrap_or_else(|e| panic!("call {seed:#x} of {len} B: {e}"));
                        assert!(back[..] == d[..], "echo {seed:#x} of {len} B differs");
                    }
                }));
            }
        }
        for t in tasks {
            t.await.expect("caller");
        }
        let calls = 6 * 16 * 20;
        let during = srq_all_posted("every slot is posted after the calls", &srv.srq).await;
        println!(
            "device {dev}: {calls} calls, 6 connections x 16 in flight, over a shared receive queue of {slots} slots: all answered byte-exact in {:.1} s; {} slots free afterwards",
            t0.elapsed().as_secs_f64(),
            during.free
        );

        // admission: connect until refused (each connection needs 2 free slots)
        let mut more = Vec::new();
        let refused = loop {
            match RdmaTransport::connect(addr, config.clone(), RdmaOptions::default()).await {
                Ok(t) => {
                    more.push(Client::new(t, config.clone()));
                    assert!(6 + more.len() <= slots / 2, "more connections admitted than the queue's slots allow");
                }
                Err(e) => break e,
            }
        };
        println!("device {dev}: {} connections admitted, the next refused: {refused}", 6 + more.len());
        // the connections admitted still work
        for (i, c) in clients.iter().chain(more.iter()).enumerate() {
            let d = data(100, i as u64);
            let back: Payload =
                c.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),)).await.expect("call after refusal");
            assert!(back[..] == d[..]);
        }
        // once every connection has gone, a new one is admitted and works
        drop(clients);
        drop(more);
        srq_settles("after the connections closed", &srv.srq).await;
        let late = Client::new(
            RdmaTransport::connect(addr, config.clone(), RdmaOptions::default()).await.expect("admitted once slots are free"),
            config.clone(),
        );
        let d = data(64, 7);
        let back: Payload = late.call::<Bincode, _, _>(ECHO, "Blob.echo", &(Payload::from_owner(d.clone()),)).await.expect("call");
        assert!(back[..] == d[..]);
        drop(late);
        srq_settles("at the end", &srv.srq).await;
        // what is still leased is the slots posted to the shared receive queue, no more
        settle("server pools", &srv.pools, |c| c.outstanding() == slots as u64).await;
        srv.stop().await;
    })
    .await
    .expect("test timed out");
}

/// A lone caller on a current-thread runtime, busy-polling, receives its own answers and
/// decodes a small one where it arrived, borrowed from its receive slot
/// (`DirectSend::progress_with`; attachments copied out), while larger answers take the usual
/// path. Over 1,500 calls (far more than the receive window, so every lent slot's credit must
/// come back), with answers of both sizes, with and without attachments, and the server's
/// errors mixed in, every answer is the right one, and once the client is gone every buffer of
/// both sides is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_callers_decode_small_answers_in_place() {
    let (dev, addr) = target(20_211);
    tokio::time::timeout(LIMIT, async move {
        let config = Config::default();
        let spin = RdmaOptions {
            busy_poll: Duration::from_millis(2),
            busy_poll_max: Duration::from_millis(2),
            poll_burst: Duration::from_micros(200),
            ..RdmaOptions::default()
        };
        let srv = BlobServer::start(addr, &config, spin.clone());
        let server_pools = srv.pools.clone();
        let window = spin.recv_slots as u64;
        let calls = 1_500u64;
        let (pools, digests, echoes, refused) = std::thread::spawn(move || {
            // a lone call's caller spins only on a current-thread runtime
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let transport = RdmaTransport::connect(addr, config.clone(), spin).await.expect("connect");
                let pools = transport.pool_monitor();
                let client = Client::new(transport, config);
                let (mut digests, mut echoes, mut refused) = (0, 0, 0);
                for i in 0..calls {
                    let d = data((i as usize * 7) % 400, i);
                    let arg = (Payload::from_owner(d.clone()),);
                    match i % 10 {
                        // an answer with an attachment of 0 to 399 bytes: lent up to 256 bytes of
                        // packet, the usual path beyond
                        3 => {
                            let back: Payload = client.call::<Bincode, _, _>(ECHO, "Blob.echo", &arg).await.expect("echo");
                            assert_eq!(&back[..], &d[..], "echo {i}");
                            echoes += 1;
                        }
                        // the server's error, small: lent
                        7 => {
                            let e = client.call::<Bincode, _, (u64, u64)>(99, "Blob.none", &arg).await.expect_err("no method 99");
                            assert_eq!(e.server_kind(), Some(rpc_core::ServerErrorKind::UnknownMethod), "call {i}: {e}");
                            refused += 1;
                        }
                        // (len, fnv64): 2 to 20 bytes of answer, lent
                        _ => {
                            let got: (u64, u64) = client.call::<Bincode, _, _>(DIGEST, "Blob.digest", &arg).await.expect("digest");
                            assert_eq!(got, (d.len() as u64, fnv64(&d)), "digest of call {i}");
                            digests += 1;
                        }
                    }
                }
                assert_eq!(client.in_flight(), 0, "every call's slot is free");
                let end = settle("after the calls", &pools, |c| c.outstanding() == window).await;
                assert_eq!(end.fallback_registrations, 0, "no buffer registered on the hot path: {end:?}");
                drop(client);
                (pools, digests, echoes, refused)
            })
        })
        .join()
        .expect("client thread");
        let client_end = settle("client closed", &pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        let server_end = settle("server side of the closed client", &server_pools, |c| c.outstanding() == 0 && c.live_regions == 0).await;
        println!("device {dev}: {calls} lone calls on a current-thread runtime: {digests} digests, {refused} errors, {echoes} echoes; pools at the end: client {client_end:?}, server {server_end:?}");
        srv.stop().await;
    })
    .await
    .expect("test timed out");
}
