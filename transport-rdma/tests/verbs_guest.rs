//! Real-verbs tests: they need an RDMA device, so they are built only with the `guest-tests`
//! feature, by `scripts/rdma-test.sh`, which runs them inside the QEMU guest (Soft-RoCE `rxe0`
//! and soft-iWARP `siw0`).
//!
//! The device comes from the environment: `RDMA_RPC_TEST_DEVICE` (e.g. `rxe0`) and
//! `RDMA_RPC_TEST_IP` (an IPv4 address of its netdev). Unset, or naming a missing device, the
//! tests FAIL: they never pass by skipping.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use transport_rdma::{
    devices, RdmaConnection, RdmaListener, RdmaOptions, RemoteAccess, RemoteToken,
};

const LIMIT: Duration = Duration::from_secs(180);
const MIB4: usize = 4 << 20;

/// The device and address under test, checked to exist.
fn target(port: u16) -> (String, SocketAddr) {
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

fn pattern(seed: u8, i: usize) -> u8 {
    (i as u32)
        .wrapping_mul(2_654_435_761)
        .rotate_left(7)
        .to_le_bytes()[0]
        ^ seed
        ^ (i >> 12) as u8
}

fn check_pattern(what: &str, data: &[u8], seed: u8) {
    let mut bad = 0usize;
    let mut first = None;
    for (i, b) in data.iter().enumerate() {
        if *b != pattern(seed, i) {
            bad += 1;
            first.get_or_insert(i);
        }
    }
    assert_eq!(
        bad,
        0,
        "{what}: {bad} of {} bytes differ, first at {:?}",
        data.len(),
        first
    );
}

/// Connects a client to a fresh listener; returns (server side, client side).
async fn pair(addr: SocketAddr, opts: RdmaOptions) -> (RdmaConnection, RdmaConnection) {
    let listener = RdmaListener::bind(addr, opts.clone()).expect("bind/listen");
    let (server, client) = tokio::join!(listener.accept(), RdmaConnection::connect(addr, opts));
    (server.expect("accept"), client.expect("connect"))
}

/// Sends `msg` with the waiting calls and checks that the peer echoed it (message `i`).
async fn check_echo(conn: &RdmaConnection, msg: &[u8], i: usize) {
    conn.send(msg).await.expect("send");
    let back = conn.recv().await.expect("recv").expect("peer closed early");
    assert_eq!(back, msg, "echo of message {i}");
}

/// Ping-pong on one runtime (client, server, both completion drivers).
async fn ping_pong(dev: String, addr: SocketAddr, opts: RdmaOptions, rounds: usize, label: &str) {
    let (server, client) = pair(addr, opts.clone()).await;
    assert_eq!(
        server.device_name(),
        dev,
        "server side runs on the requested device"
    );
    assert_eq!(
        client.device_name(),
        dev,
        "client side runs on the requested device"
    );
    println!(
        "device {dev} ({:?}): connected {addr} via rdma_cm [{label}]",
        client.transport()
    );

    // echo server
    let echo = tokio::spawn(async move {
        let mut n = 0u64;
        while let Some(msg) = server.recv().await.expect("server recv") {
            server.send(&msg).await.expect("server send");
            n += 1;
        }
        n
    });

    let t0 = Instant::now();
    for i in 0..rounds {
        let mut msg = [0u8; 32];
        msg[..8].copy_from_slice(&(i as u64).to_le_bytes());
        for (j, b) in msg[8..].iter_mut().enumerate() {
            *b = pattern(i as u8, j);
        }
        check_echo(&client, &msg, i).await;
    }
    let el = t0.elapsed();
    println!(
        "device {dev}: {rounds} x 32 B SEND/RECV ping-pongs [{label}]: mean round trip {:.1} us",
        el.as_secs_f64() * 1e6 / rounds as f64,
    );
    // a message of exactly the slot size, and an empty one
    let big = vec![0xA5u8; client.max_message_size()];
    client.send(&big).await.expect("send full slot");
    assert_eq!(client.recv().await.unwrap().unwrap(), big);
    client.send(&[]).await.expect("send empty");
    assert_eq!(client.recv().await.unwrap().unwrap(), Vec::<u8>::new());
    assert!(
        client
            .send(&vec![0u8; client.max_message_size() + 1])
            .await
            .is_err(),
        "oversized message rejected"
    );

    client.close();
    let echoed = echo.await.expect("echo task");
    assert_eq!(
        echoed,
        rounds as u64 + 2,
        "the server saw every message, then end of stream"
    );
}

#[test]
fn cm_connect_and_send_recv_ping_pong() {
    let (dev, addr) = target(20_011);
    let spins: &[u64] = &[0, 50];
    for (i, &spin) in spins.iter().enumerate() {
        for threads in [1usize, 2] {
            let rt = if threads == 1 {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(threads)
                    .enable_all()
                    .build()
            }
            .expect("runtime");
            let opts = RdmaOptions {
                busy_poll: Duration::from_micros(spin),
                busy_poll_max: Duration::from_micros(spin),
                ..RdmaOptions::default()
            };
            let label = format!("{threads} thread(s), busy-poll {spin} us");
            let addr = SocketAddr::new(addr.ip(), addr.port() + (i * 2 + threads) as u16);
            let dev = dev.clone();
            rt.block_on(async move {
                tokio::time::timeout(LIMIT, ping_pong(dev, addr, opts, 1000, &label))
                    .await
                    .expect("test timed out")
            });
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_write_and_read_4mib_verified() {
    let (dev, addr) = target(20_012);
    tokio::time::timeout(LIMIT, async move {
        let (server, client) = pair(addr, RdmaOptions::default()).await;
        assert_eq!(client.device_name(), dev);

        let server_task = tokio::spawn(async move {
            let mut buf = server.alloc_buffer(MIB4).expect("server buffer");
            // 1. let the client WRITE
            let exposed = buf.expose(RemoteAccess::Write).expect("expose for write");
            let mut msg = b"W".to_vec();
            msg.extend_from_slice(&exposed.token().to_bytes());
            assert!(buf.bytes().is_err(), "no local access while exposed");
            server.send(&msg).await.expect("send write token");
            let done = server.recv().await.unwrap().expect("client closed");
            assert_eq!(done, b"written");
            drop(exposed); // revoke the peer's access, then look
            check_pattern("RDMA WRITE target (server)", buf.bytes().expect("buffer free"), 0x11);
            // 2. let the client READ
            for (i, b) in buf.bytes_mut().unwrap().iter_mut().enumerate() {
                *b = pattern(0x77, i);
            }
            let exposed = buf.expose(RemoteAccess::Read).expect("expose for read");
            let mut msg = b"R".to_vec();
            msg.extend_from_slice(&exposed.token().to_bytes());
            server.send(&msg).await.expect("send read token");
            let done = server.recv().await.unwrap().expect("client closed");
            assert_eq!(done, b"read");
            drop(exposed);
            // 3. end of stream after the client closes
            assert_eq!(server.recv().await.expect("recv after close"), None);
        });

        let mut local = client.alloc_buffer(MIB4).expect("client buffer");
        for (i, b) in local.bytes_mut().unwrap().iter_mut().enumerate() {
            *b = pattern(0x11, i);
        }
        let msg = client.recv().await.unwrap().expect("server closed");
        assert_eq!(msg[0], b'W');
        let token = RemoteToken::from_bytes(&msg[1..]).expect("token");
        assert_eq!(token.len, MIB4 as u64);
        let t0 = Instant::now();
        client.write(&mut local, 0, &token, 0, MIB4).await.expect("RDMA WRITE");
        let tw = t0.elapsed();
        // the peer sees no completion for a WRITE: tell it (iWARP has no write-with-immediate)
        client.send(b"written").await.expect("send");

        let msg = client.recv().await.unwrap().expect("server closed");
        assert_eq!(msg[0], b'R');
        let token = RemoteToken::from_bytes(&msg[1..]).expect("token");
        local.bytes_mut().unwrap().fill(0);
        let t0 = Instant::now();
        client.read(&mut local, 0, &token, 0, MIB4).await.expect("RDMA READ");
        let tr = t0.elapsed();
        check_pattern("RDMA READ destination (client)", local.bytes().expect("buffer free"), 0x77);
        client.send(b"read").await.expect("send");
        println!(
            "device {dev}: 4 MiB RDMA WRITE {:.1} ms ({:.0} MB/s), 4 MiB RDMA READ {:.1} ms ({:.0} MB/s), both verified byte by byte",
            tw.as_secs_f64() * 1e3,
            MIB4 as f64 / tw.as_secs_f64() / 1e6,
            tr.as_secs_f64() * 1e3,
            MIB4 as f64 / tr.as_secs_f64() / 1e6
        );
        client.close();
        server_task.await.expect("server side");
    })
    .await
    .expect("test timed out");
}

/// rdma_cm negotiates the READ depth: both QPs of a connection get the smaller of the two
/// sides' `read_depth` (within the device's limit; rxe and siw allow 128), so several RDMA
/// READs can be in flight at once. siw reports its two limits the other way round from
/// InfiniBand (`max_rd_atomic` is its inbound queue), so the cases here are symmetric; rxe
/// rounds a depth up to a power of two (3 becomes 4), so they are powers of two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_depth_is_negotiated() {
    let (dev, addr) = target(20_013);
    tokio::time::timeout(LIMIT, async move {
        let both = |n| transport_rdma::ReadDepth {
            responder: n,
            initiator: n,
        };
        // the defaults on both sides
        let (server, client) = pair(addr, RdmaOptions::default()).await;
        let want = both(transport_rdma::DEFAULT_READ_DEPTH);
        assert_eq!(server.read_depth().expect("server QP"), want, "server");
        assert_eq!(client.read_depth().expect("client QP"), want, "client");
        client.close();
        drop((server, client));
        // a client that asks for fewer: the server answers with as many
        let addr = SocketAddr::new(addr.ip(), addr.port() + 1);
        let listener = RdmaListener::bind(addr, RdmaOptions::default()).expect("bind/listen");
        let few = RdmaOptions {
            read_depth: 2,
            ..RdmaOptions::default()
        };
        let (server, client) = tokio::join!(listener.accept(), RdmaConnection::connect(addr, few));
        let (server, client) = (server.expect("accept"), client.expect("connect"));
        assert_eq!(server.read_depth().expect("server QP"), both(2), "server");
        assert_eq!(client.read_depth().expect("client QP"), both(2), "client");
        println!(
            "device {dev}: READ depth negotiated: defaults {want:?}, client asking 2 {:?}",
            client.read_depth()
        );
        client.close();
    })
    .await
    .expect("test timed out");
}

/// Each side's queue pair gets the local ACK timeout its options ask for (the default, about
/// 67 ms, or a given one rounded up to the device's power of two) on RoCE; on iWARP there is
/// none (TCP retransmits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_timeout_reaches_the_queue_pair() {
    let (dev, addr) = target(20_017);
    tokio::time::timeout(LIMIT, async move {
        let listener = RdmaListener::bind(addr, RdmaOptions::default()).expect("bind/listen");
        let short = RdmaOptions {
            ack_timeout: Some(Duration::from_millis(1)),
            ..RdmaOptions::default()
        };
        let (server, client) =
            tokio::join!(listener.accept(), RdmaConnection::connect(addr, short));
        let (server, client) = (server.expect("accept"), client.expect("connect"));
        let (s, c) = (
            server.ack_timeout().expect("server QP"),
            client.ack_timeout().expect("client QP"),
        );
        if client.transport() == transport_rdma::TransportKind::IWarp {
            assert_eq!((s, c), (None, None), "iWARP has no local ACK timeout");
        } else {
            // 4.096 µs × 2^14 and × 2^8
            assert_eq!(s, Some(transport_rdma::DEFAULT_ACK_TIMEOUT), "server");
            assert_eq!(c, Some(Duration::from_nanos(4096 << 8)), "client");
        }
        println!("device {dev}: local ACK timeouts: server {s:?}, client {c:?}");
        client.close();
    })
    .await
    .expect("test timed out");
}

/// A listener bound to port 0 reports the port rdma_cm picked for it, and a client reaches it
/// there: two such listeners on one address get two ports, each serving its own client; one
/// bound to a given port reports that port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn port_zero_listeners_report_their_port() {
    let (dev, fixed) = target(20_015);
    tokio::time::timeout(LIMIT, async move {
        let any = SocketAddr::new(fixed.ip(), 0);
        let a = RdmaListener::bind(any, RdmaOptions::default()).expect("bind/listen a");
        let b = RdmaListener::bind(any, RdmaOptions::default()).expect("bind/listen b");
        let (pa, pb) = (a.local_addr(), b.local_addr());
        assert_eq!(pa.ip(), fixed.ip());
        assert_ne!(pa.port(), 0, "listener a reports port 0");
        assert_ne!(pb.port(), 0, "listener b reports port 0");
        assert_ne!(pa.port(), pb.port(), "two listeners, one port");
        for (i, (listener, at)) in [(&a, pa), (&b, pb)].into_iter().enumerate() {
            let (server, client) = tokio::join!(
                listener.accept(),
                RdmaConnection::connect(at, RdmaOptions::default())
            );
            let (server, client) = (server.expect("accept"), client.expect("connect"));
            let msg = [i as u8 + 1; 16];
            client.send(&msg).await.expect("send");
            let got = server.recv().await.expect("recv").expect("a message");
            assert_eq!(got, msg, "listener {i}");
            client.close();
        }
        let f = RdmaListener::bind(fixed, RdmaOptions::default()).expect("bind/listen fixed");
        assert_eq!(f.local_addr(), fixed);
        println!(
            "device {dev}: port-0 listeners on ports {} and {}",
            pa.port(),
            pb.port()
        );
    })
    .await
    .expect("test timed out");
}

/// Polls `conn` until a message is ready (the non-waiting API: `poll_completions` and
/// `try_recv_bytes`), yielding between polls so that the rest of the runtime runs.
async fn poll_for_message(conn: &RdmaConnection) -> Option<Vec<u8>> {
    loop {
        if let Some(got) = conn.try_recv_bytes() {
            return got.expect("try_recv_bytes").map(|b| b.to_vec());
        }
        if !conn.poll_completions() {
            tokio::task::yield_now().await;
        }
    }
}

/// The connection layer's calls that never wait (`try_send`, `poll_completions`,
/// `try_recv_bytes`), on each side against the waiting calls on the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_waiting_send_poll_and_receive() {
    let (dev, addr) = target(20_031);
    let opts = RdmaOptions {
        busy_poll: Duration::from_micros(50),
        busy_poll_max: Duration::from_micros(50),
        ..RdmaOptions::default()
    };
    tokio::time::timeout(LIMIT, async move {
        // the client never waits; the server echoes with recv/send
        let (server, client) = pair(addr, opts.clone()).await;
        assert!(client.try_recv_bytes().is_none(), "nothing was sent yet");
        let echo = tokio::spawn(async move {
            let mut n = 0u64;
            while let Some(msg) = server.recv_bytes().await.expect("server recv") {
                server.send(&msg).await.expect("server send");
                n += 1;
            }
            n
        });
        let rounds = 1000usize;
        for i in 0..rounds {
            let msg: Vec<u8> = (0..48).map(|j| pattern(i as u8, j)).collect();
            while !client.try_send(&msg).expect("try_send") {
                client.poll_completions();
            }
            let back = poll_for_message(&client).await.expect("peer closed early");
            assert_eq!(back, msg, "echo of message {i}");
        }
        assert!(
            client
                .try_send(&vec![0u8; client.max_message_size() + 1])
                .is_err(),
            "an oversized message is an error, not a full queue"
        );
        client.close();
        assert_eq!(echo.await.expect("echo task"), rounds as u64);

        // the server never waits; the client sends with send/recv, then leaves
        let addr = SocketAddr::new(addr.ip(), addr.port() + 1);
        let (server, client) = pair(addr, opts).await;
        let lean = tokio::spawn(async move {
            let mut n = 0u64;
            while let Some(msg) = poll_for_message(&server).await {
                while !server.try_send(&msg).expect("server try_send") {
                    server.poll_completions();
                }
                n += 1;
            }
            n
        });
        for i in 0..rounds {
            let msg: Vec<u8> = (0..48).map(|j| pattern(!(i as u8), j)).collect();
            check_echo(&client, &msg, i).await;
        }
        client.close();
        assert_eq!(
            lean.await.expect("lean server"),
            rounds as u64,
            "the non-waiting side saw every message, then the end of the stream"
        );
        println!("device {dev}: {rounds} round trips each way with the non-waiting calls");
    })
    .await
    .expect("test timed out");
}

/// The message `i` of `borrowed_receive_reposts_each_slot_in_order`: its index, then a pattern.
fn indexed(i: usize) -> Vec<u8> {
    let mut msg = (i as u32).to_le_bytes().to_vec();
    msg.extend((0..44).map(|j| pattern(i as u8, j)));
    msg
}

/// `poll_recv_with`: each message borrowed from its slot and the same slot posted again at
/// once (with 4 receive slots, 3,000 messages arrive only if every slot comes back), in order
/// with the messages the waiting receive and the completion driver took, then the end of the
/// stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn borrowed_receive_reposts_each_slot_in_order() {
    let (dev, addr) = target(20_035);
    let opts = RdmaOptions {
        recv_slots: 4,
        send_slots: 4,
        busy_poll: Duration::from_micros(50),
        busy_poll_max: Duration::from_micros(50),
        ..RdmaOptions::default()
    };
    tokio::time::timeout(LIMIT, async move {
        let (server, client) = pair(addr, opts).await;
        let mut nothing_yet = 0;
        assert_eq!(
            server.poll_recv_with(|_| nothing_yet += 1).expect("poll"),
            Some(0),
            "nothing was sent yet"
        );
        assert_eq!(nothing_yet, 0);
        let rounds = 1000usize;
        let echo = tokio::spawn(async move {
            let mut next = 0usize;
            let mut echoes: Vec<Vec<u8>> = Vec::new();
            loop {
                // every other round, the waiting receive takes its first message (and the
                // completion driver may queue the rest): the borrowed ones must follow in order
                if next % 3 == 0 && (next / 3) % 2 == 1 {
                    let Some(msg) = server.recv_bytes().await.expect("recv_bytes") else {
                        break;
                    };
                    assert_eq!(
                        &msg[..],
                        &indexed(next)[..],
                        "message {next} (waiting receive)"
                    );
                    next += 1;
                    server.send(&msg).await.expect("server send");
                }
                let got = server.poll_recv_with(|msg| {
                    assert_eq!(msg, &indexed(next)[..], "message {next} (borrowed)");
                    next += 1;
                    echoes.push(msg.to_vec());
                });
                for msg in echoes.drain(..) {
                    server.send(&msg).await.expect("server send");
                }
                match got.expect("poll_recv_with") {
                    None => break,
                    Some(0) => tokio::task::yield_now().await,
                    Some(_) => {}
                }
            }
            next
        });
        // three in flight at a time, against four receive slots
        for round in 0..rounds {
            for i in 3 * round..3 * round + 3 {
                client.send(&indexed(i)).await.expect("send");
            }
            for i in 3 * round..3 * round + 3 {
                let back = client
                    .recv()
                    .await
                    .expect("recv")
                    .expect("server left early");
                assert_eq!(back, indexed(i), "echo of message {i}");
            }
        }
        client.close();
        assert_eq!(
            echo.await.expect("echo task"),
            3 * rounds,
            "the borrowing side saw every message once, then the end of the stream"
        );
        println!(
            "device {dev}: {} messages received borrowed from 4 slots",
            3 * rounds
        );
    })
    .await
    .expect("test timed out");
}

/// The message `i` of `small_messages_are_copied_and_their_slots_posted_again`: 0 to 256
/// bytes of a pattern.
fn small(i: usize) -> Vec<u8> {
    (0..i % 257).map(|j| pattern(i as u8, j)).collect()
}

/// A received message of at most 256 bytes is copied out of its slot, and the same slot is
/// posted again at once: holding every such message received leases no slot at all (with 4
/// receive slots, 1,200 of them arrive byte-exact and in order), while a longer message is a
/// view of its slot, which stays out of the pool until the message is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_messages_are_copied_and_their_slots_posted_again() {
    let (dev, addr) = target(20_037);
    let opts = RdmaOptions {
        recv_slots: 4,
        send_slots: 4,
        ..RdmaOptions::default()
    };
    tokio::time::timeout(LIMIT, async move {
        let (server, client) = pair(addr, opts).await;
        let pools = server.pool_monitor();
        let before = pools.counts();
        let mut held = Vec::new();
        // three in flight at a time, against four receive slots
        for round in 0..400 {
            for i in 3 * round..3 * round + 3 {
                client.send(&small(i)).await.expect("send");
            }
            for i in 3 * round..3 * round + 3 {
                let msg = server
                    .recv_bytes()
                    .await
                    .expect("recv_bytes")
                    .expect("client left early");
                assert_eq!(&msg[..], &small(i)[..], "message {i}");
                held.push(msg);
            }
        }
        let c = pools.counts();
        assert_eq!(
            (c.leased, c.outstanding(), c.exhausted),
            (before.leased, before.outstanding(), before.exhausted),
            "a slot was leased for a small message, or is held by one: {c:?}"
        );
        // one byte longer: a view of its slot
        let long: Vec<u8> = (0..257).map(|j| pattern(9, j)).collect();
        client.send(&long).await.expect("send");
        let msg = server
            .recv_bytes()
            .await
            .expect("recv_bytes")
            .expect("client left early");
        assert_eq!(&msg[..], &long[..], "the 257-byte message");
        assert_eq!(
            pools.counts().outstanding(),
            before.outstanding() + 1,
            "the 257-byte message is not a view of its slot"
        );
        drop(msg);
        assert_eq!(
            pools.counts().outstanding(),
            before.outstanding(),
            "the 257-byte message's slot did not go back when the message was dropped"
        );
        // the copies outlive the slots they came from
        for (i, msg) in held.iter().enumerate() {
            assert_eq!(&msg[..], &small(i)[..], "message {i}, held");
        }
        println!(
            "device {dev}: {} small messages copied out of 4 slots, held to the end",
            held.len()
        );
    })
    .await
    .expect("test timed out");
}

/// Small SENDs go inline: both sides' queue pairs got the default inline size from the
/// provider (64 bytes, what a small call's packet needs), and messages of every length from 0 to one
/// past it (the last one not inline) arrive byte-exact and in order, four times over, up to
/// four unreceived at a time: every other one with `send` (from one of two send slots), the others with
/// `try_send` straight from the caller's buffer (an inline SEND needs no slot), which is
/// overwritten as soon as the post returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_sends_go_inline_byte_exact() {
    let (dev, addr) = target(20_039);
    let opts = RdmaOptions {
        recv_slots: 8,
        send_slots: 2,
        ..RdmaOptions::default()
    };
    tokio::time::timeout(LIMIT, async move {
        let (server, client) = pair(addr, opts.clone()).await;
        let inline = client.max_inline();
        let want = transport_rdma::DEFAULT_MAX_INLINE as usize;
        assert_eq!(inline, want, "client's inline bytes");
        assert_eq!(server.max_inline(), want, "server's inline bytes");
        let msg = move |i: usize| -> Vec<u8> {
            (0..i % (inline + 2)).map(|j| pattern(i as u8, j)).collect()
        };
        let count = 4 * (inline + 2);
        // at most 4 messages unreceived, against 8 receive slots: this layer has no credits,
        // and on iWARP a SEND that finds no receive posted ends the connection
        let window = std::sync::Arc::new(tokio::sync::Semaphore::new(4));
        let room = window.clone();
        let sender = tokio::spawn(async move {
            for i in 0..count {
                room.acquire().await.expect("window").forget();
                if i % 2 == 0 {
                    client.send(&msg(i)).await.expect("send");
                    continue;
                }
                // posted from this buffer (inline up to the limit: no slot), which is then
                // overwritten at once, before the peer can have received it
                let mut buf = msg(i);
                while !client.try_send(&buf).expect("try_send") {
                    client.poll_completions();
                    tokio::task::yield_now().await;
                }
                buf.fill(0xee);
                drop(buf);
            }
            client
        });
        for i in 0..count {
            let got = server
                .recv()
                .await
                .expect("recv")
                .expect("client left early");
            assert_eq!(got, msg(i), "message {i} ({} bytes)", i % (inline + 2));
            window.add_permits(1);
        }
        let client = sender.await.expect("sender");
        // every SEND's permit came back with its completion (an inline SEND keeps no entry in
        // the QP: its poster counts it), and so do those of SENDs cut short by a close
        // (flushed, or completed before it)
        while client.sends_in_flight() > 0 {
            client.poll_completions();
            tokio::task::yield_now().await;
        }
        assert!(
            client.try_send(&msg(1)).expect("try_send"),
            "a slot is free"
        );
        assert!(
            client.try_send(&msg(3)).expect("try_send"),
            "a slot is free"
        );
        client.close();
        while client.sends_in_flight() > 0 {
            client.poll_completions();
            tokio::task::yield_now().await;
        }
        // with inline SENDs off, the same from send slots
        let addr = SocketAddr::new(addr.ip(), addr.port() + 1);
        let off = RdmaOptions {
            max_inline: 0,
            ..opts
        };
        let (server, client) = pair(addr, off).await;
        assert_eq!((client.max_inline(), server.max_inline()), (0, 0));
        for i in 0..inline + 2 {
            let mut buf = msg(i);
            while !client.try_send(&buf).expect("try_send") {
                client.poll_completions();
                tokio::task::yield_now().await;
            }
            buf.fill(0xee);
            let got = server.recv().await.expect("recv").expect("client left");
            assert_eq!(got, msg(i), "message {i}, not inline");
        }
        client.close();
        println!(
            "device {dev}: {count} messages of 0 to {} bytes, inline up to {inline}; none inline \
             with max_inline 0",
            inline + 1
        );
    })
    .await
    .expect("test timed out");
}

/// A connecting side that has not heard from its peer since the set-up nudges it (an RDMA
/// WRITE of no bytes) on iWARP, where soft-iWARP can strand a new connection's first messages
/// until another packet arrives (see `RdmaConnection::nudges`), and never on InfiniBand/RoCE.
/// The nudges are invisible to the peer: it receives exactly the messages sent, and both
/// directions carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_nudged_on_iwarp_only() {
    let (dev, addr) = target(20_091);
    tokio::time::timeout(LIMIT, async move {
        let (server, client) = pair(addr, RdmaOptions::default()).await;
        let iwarp = client.transport() == transport_rdma::TransportKind::IWarp;
        client.send(b"first").await.expect("send");
        assert_eq!(
            server.recv().await.expect("recv").as_deref(),
            Some(&b"first"[..])
        );
        // the server stays silent: on iWARP the client nudges it, after 20 ms and again after
        // 40 more (checked every 5 ms); elsewhere the same time passes without a nudge
        let silent = Instant::now();
        if iwarp {
            while client.nudges() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let nudged = client.nudges();
        let waited = silent.elapsed();
        server.send(b"answer").await.expect("send");
        assert_eq!(
            client.recv().await.expect("recv").as_deref(),
            Some(&b"answer"[..])
        );
        // the nudges took no slot and raised nothing at the server: the next message is the
        // next one it receives
        client.send(b"second").await.expect("send");
        assert_eq!(
            server.recv().await.expect("recv").as_deref(),
            Some(&b"second"[..])
        );
        assert_eq!(server.nudges(), 0, "the accepting side never nudges");
        if iwarp {
            assert!(nudged >= 2, "{nudged} nudges");
        } else {
            assert_eq!(nudged, 0, "nudged on {:?}", client.transport());
        }
        client.close();
        assert_eq!(
            server.recv().await.expect("recv"),
            None,
            "the end of the stream"
        );
        println!(
            "device {dev}: {nudged} nudges of a peer silent for {waited:?} ({:?})",
            client.transport()
        );
    })
    .await
    .expect("test timed out");
}
