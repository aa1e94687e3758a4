//! The end-to-end suite over TCP loopback, plus what only TCP can be fed: raw bytes.

mod suite;

use std::time::Duration;

use rdma_rpc::core::wire::{Kind, Message, HEADER_LEN};
use rdma_rpc::{Config, Endpoint, RpcError, ServerErrorKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use suite::EVENTUALLY;

fn ep() -> Endpoint {
    "tcp://127.0.0.1:0".parse().unwrap()
}

transport_suite!(ep);

use suite::raw::{connect as raw, frame, read_to_close};

/// Without the greeting, a raw peer's request never reaches a handler on a server that
/// requires a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_raw_request_runs_no_handler() {
    let mut config = Config::default();
    config.auth_token = Some(rdma_rpc::Secret::new("s3cret"));
    let srv = suite::start(&ep(), config).await;
    let mut s = raw(&srv.endpoint).await;
    let block = rdma_rpc::__private::method_id("Probe.block");
    s.write_all(&frame(Kind::Request, 1, block, &[1]))
        .await
        .unwrap();
    let answer = read_to_close(&mut s).await;
    let msgs = decode_all(&answer);
    assert_eq!(msgs.len(), 1);
    assert_eq!(
        ServerErrorKind::from_code(msgs[0].header.aux),
        ServerErrorKind::Unauthenticated
    );
    assert!(
        srv.probes.started.lock().await.try_recv().is_err(),
        "a handler ran"
    );
    srv.shutdown.shutdown();
}

fn decode_all(mut bytes: &[u8]) -> Vec<Message> {
    use tokio_util_codec_shim::decode;
    let mut out = Vec::new();
    while let Some((m, used)) = decode(bytes) {
        out.push(m);
        bytes = &bytes[used..];
    }
    out
}

/// Minimal decoding of whole frames for assertions, via the core's codec.
mod tokio_util_codec_shim {
    use super::*;
    use rdma_rpc::core::wire::{Limits, WireHeader};

    pub(crate) fn decode(bytes: &[u8]) -> Option<(Message, usize)> {
        if bytes.len() < HEADER_LEN {
            return None;
        }
        let limits = Limits {
            max_message_size: 1 << 30,
            max_attachments: 1024,
        };
        let h = WireHeader::parse(bytes[..HEADER_LEN].try_into().unwrap(), &limits).ok()?;
        let end = HEADER_LEN + h.len as usize;
        let rest = bytes::Bytes::copy_from_slice(bytes.get(HEADER_LEN..end)?);
        Some((h.split(rest).ok()?, end))
    }
}

/// Plays the server's side of the greeting on a raw socket.
async fn greet(s: &mut TcpStream) {
    let mut head = [0u8; HEADER_LEN];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(head[3], Kind::Hello as u8);
    let len = u64::from_le_bytes(head[24..32].try_into().unwrap()) as usize;
    let mut token = vec![0u8; len];
    s.read_exact(&mut token).await.unwrap();
    s.write_all(&frame(Kind::Hello, 0, 0, &[])).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_closes_only_that_connection() {
    let srv = suite::start(&ep(), Config::default()).await;
    let good = suite::connect(&srv.endpoint).await;
    let mut bad = raw(&srv.endpoint).await;
    bad.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n and some more garbage")
        .await
        .unwrap();
    let answer = read_to_close(&mut bad).await;
    assert!(answer.is_empty(), "no answer to garbage: {answer:?}");
    assert_eq!(good.add(1, 2).await.unwrap(), 3);
    srv.shutdown.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_frame_then_hangup() {
    let srv = suite::start(&ep(), Config::default()).await;
    let good = suite::connect(&srv.endpoint).await;
    let mut bad = raw(&srv.endpoint).await;
    let add = rdma_rpc::__private::method_id("Probe.add");
    let f = frame(Kind::Request, 1, add, &[1, 2]);
    bad.write_all(&f[..f.len() - 1]).await.unwrap();
    bad.shutdown().await.unwrap();
    let answer = read_to_close(&mut bad).await;
    assert!(answer.is_empty(), "{answer:?}");
    assert_eq!(good.add(2, 2).await.unwrap(), 4);
    srv.shutdown.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn length_of_two_to_the_63_is_answered_and_closed() {
    let srv = suite::start(&ep(), Config::default()).await;
    let good = suite::connect(&srv.endpoint).await;
    let mut bad = raw(&srv.endpoint).await;
    let mut f = frame(Kind::Request, 77, 1, &[]);
    f[24..32].copy_from_slice(&(1u64 << 63).to_le_bytes());
    bad.write_all(&f).await.unwrap();
    let answer = read_to_close(&mut bad).await;
    let msgs = decode_all(&answer);
    assert_eq!(msgs.len(), 1, "one error response, then close");
    assert_eq!(msgs[0].header.kind, Kind::Response);
    assert_eq!(msgs[0].header.id, 77);
    assert_eq!(
        ServerErrorKind::from_code(msgs[0].header.aux),
        ServerErrorKind::TooLarge
    );
    let text = String::from_utf8_lossy(&msgs[0].body);
    assert!(text.contains("exceeds"), "{text}");
    assert_eq!(good.add(3, 3).await.unwrap(), 6);
    srv.shutdown.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_unknown_method_and_bad_body_get_answers_and_connection_stays() {
    let srv = suite::start(&ep(), Config::default()).await;
    let mut s = raw(&srv.endpoint).await;
    let add = rdma_rpc::__private::method_id("Probe.add");
    let mut bytes = frame(Kind::Request, 1, 0x1234_5678, &[]);
    bytes.extend(frame(Kind::Request, 2, add, &[0xff; 3]));
    // A valid call after the bad ones: add(5, 6) with bincode varints.
    bytes.extend(frame(Kind::Request, 3, add, &[5, 6]));
    s.write_all(&bytes).await.unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    while decode_all(&got).len() < 3 {
        let n = tokio::time::timeout(EVENTUALLY, s.read(&mut buf))
            .await
            .expect("answers")
            .unwrap();
        assert!(n > 0, "server closed early");
        got.extend_from_slice(&buf[..n]);
    }
    let mut msgs = decode_all(&got);
    msgs.sort_by_key(|m| m.header.id);
    assert_eq!(
        ServerErrorKind::from_code(msgs[0].header.aux),
        ServerErrorKind::UnknownMethod
    );
    assert_eq!(
        ServerErrorKind::from_code(msgs[1].header.aux),
        ServerErrorKind::BadRequest
    );
    assert_eq!(msgs[2].header.aux, 0);
    assert_eq!(&msgs[2].body[..], &[11]);
    srv.shutdown.shutdown();
}

/// The deadline travels with the request: a caller that never times out by itself (raw
/// frames, no client timer) still gets DeadlineExceeded, and the handler is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_enforced_by_server() {
    let srv = suite::start(&ep(), Config::default()).await;
    let mut s = raw(&srv.endpoint).await;
    let block = rdma_rpc::__private::method_id("Probe.block");
    let mut f = frame(Kind::Request, 5, block, &[13]);
    f[20..24].copy_from_slice(&100_000u32.to_le_bytes()); // 100 ms
    s.write_all(&f).await.unwrap();
    srv.probes.dropped(13).await;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 1024];
    while decode_all(&got).is_empty() {
        let n = tokio::time::timeout(EVENTUALLY, s.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let m = &decode_all(&got)[0];
    assert_eq!(m.header.id, 5);
    assert_eq!(
        ServerErrorKind::from_code(m.header.aux),
        ServerErrorKind::DeadlineExceeded
    );
    srv.shutdown.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_server_is_noticed_by_keepalive() {
    // A "server" that accepts and reads but never answers anything, pings included.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        greet(&mut s).await;
        let mut sink = vec![0u8; 1024];
        while s.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
    });
    let ep: Endpoint = format!("tcp://{addr}?keepalive_ms=50&keepalive_timeout_ms=300")
        .parse()
        .unwrap();
    let client = suite::connect(&ep).await;
    let r = tokio::time::timeout(EVENTUALLY, client.add(1, 2))
        .await
        .expect("the call fails instead of hanging");
    assert!(matches!(r, Err(RpcError::ConnectionClosed)), "{r:?}");
    assert!(client.client().is_closed());
    silent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_client_is_dropped_by_the_server() {
    let bind: Endpoint = "tcp://127.0.0.1:0?keepalive_ms=50&keepalive_timeout_ms=300"
        .parse()
        .unwrap();
    let srv = suite::start(&bind, Config::default()).await;
    let mut silent = raw(&srv.endpoint).await;
    // It receives pings, never answers; the server must hang up.
    let got = read_to_close(&mut silent).await;
    let msgs = decode_all(&got);
    assert!(!msgs.is_empty() && msgs.iter().all(|m| m.header.kind == Kind::Ping));
    srv.shutdown.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_vanishing_mid_call_fails_the_call() {
    // A server that reads one request then drops the connection.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        greet(&mut s).await;
        let mut head = [0u8; HEADER_LEN];
        s.read_exact(&mut head).await.unwrap();
    });
    let ep: Endpoint = format!("tcp://{addr}").parse().unwrap();
    let client = suite::connect(&ep).await;
    let r = tokio::time::timeout(EVENTUALLY, client.echo(vec![1u8; 1 << 20].into()))
        .await
        .expect("fails, not hangs");
    assert!(matches!(r, Err(RpcError::ConnectionClosed)), "{r:?}");
}

#[tokio::test]
async fn rdma_endpoint_without_transport_is_unavailable() {
    let ep: Endpoint = "rdma://127.0.0.1:1".parse().unwrap();
    let e = rdma_rpc::Client::connect(&ep).await.unwrap_err();
    assert!(matches!(e, RpcError::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("rdma://127.0.0.1:1"), "{e}");
    let e = rdma_rpc::Server::bind(&ep).await.unwrap_err();
    assert!(matches!(e, RpcError::Unavailable(_)), "{e}");
}

#[tokio::test]
async fn connection_refused_is_unavailable() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l);
    let ep: Endpoint = format!("tcp://127.0.0.1:{port}").parse().unwrap();
    let e = rdma_rpc::Client::connect(&ep).await.unwrap_err();
    assert!(matches!(e, RpcError::Unavailable(_)), "{e}");
    let _ = Duration::ZERO;
}

/// A server whose keep-alive pings before it has read the client's greeting (a loaded server
/// with a short keep-alive interval): the client answers the ping during its handshake and
/// still connects.
#[tokio::test]
async fn handshake_answers_an_early_ping() {
    use rdma_rpc::core::wire::{Limits, WireHeader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(&frame(Kind::Ping, 7, 0, b"")).await.unwrap();
        let mut seen = Vec::new();
        for _ in 0..2 {
            let mut head = [0u8; HEADER_LEN];
            s.read_exact(&mut head).await.unwrap();
            let h = WireHeader::parse(
                &head,
                &Limits {
                    max_message_size: 1 << 20,
                    max_attachments: 4,
                },
            )
            .unwrap();
            let mut rest = vec![0u8; h.len as usize];
            s.read_exact(&mut rest).await.unwrap();
            seen.push((h.header.kind, h.header.id));
        }
        s.write_all(&frame(Kind::Hello, 0, 0, b"")).await.unwrap();
        (seen, s)
    });
    let ep: Endpoint = format!("tcp://{addr}").parse().unwrap();
    let client = tokio::time::timeout(EVENTUALLY, rdma_rpc::Client::connect(&ep))
        .await
        .expect("the handshake ends")
        .expect("the handshake succeeds after an early ping");
    let (seen, _s) = server.await.unwrap();
    assert_eq!(
        seen,
        [(Kind::Hello, 0), (Kind::Pong, 7)],
        "greeting, then the pong"
    );
    assert!(!client.is_closed());
}

/// A call that waits for a handler slot for longer than its client's keep-alive timeout is
/// served once a slot frees: the server does not read that connection while the call waits
/// (back-pressure), so it pings the client meanwhile, and the client does not take the busy
/// server for a dead one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_for_a_handler_slot_outlives_the_keepalive_timeout() {
    let mut server = Config::default();
    server.max_concurrent_handlers = 1;
    server.keepalive_interval = Duration::from_millis(50);
    server.keepalive_timeout = Duration::from_millis(900);
    let srv = suite::start(&ep(), server).await;
    let mut client = Config::default();
    client.keepalive_interval = Duration::from_millis(50);
    client.keepalive_timeout = Duration::from_millis(300);
    let holder = suite::connect_with(&srv.endpoint, client.clone()).await;
    let waiter = suite::connect_with(&srv.endpoint, client).await;
    let held = tokio::spawn(async move { holder.block(1).await });
    srv.probes.started(1).await;
    let waiting = tokio::spawn(async move { waiter.add(2, 3).await });
    // A raw peer that never answers the server's pings is dropped after the server's
    // keep-alive timeout, three times the waiting client's: by then the waiting client, had
    // it heard nothing since its call, would have closed its connection.
    let mut silent = raw(&srv.endpoint).await;
    let pings = decode_all(&read_to_close(&mut silent).await);
    assert!(
        pings.len() >= 2,
        "the server pinged the silent peer: {pings:?}"
    );
    srv.probes.gate.add_permits(1);
    assert_eq!(held.await.unwrap().unwrap(), 1);
    let added = tokio::time::timeout(EVENTUALLY, waiting)
        .await
        .expect("the waiting call is answered")
        .unwrap();
    assert_eq!(added.unwrap(), 5);
    srv.shutdown.shutdown();
}

/// On a server with a token, a greeting that claims more than a greeting's size
/// (`GREETING_MAX`) is refused as soon as its header is in: the server neither waits for nor
/// reserves the bytes of a peer it has not authenticated. (The connection time limit is set
/// far beyond the test's bound, so a server that waited would fail it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_greeting_is_refused_at_its_header() {
    use rdma_rpc::core::wire::GREETING_MAX;
    let mut config = Config::default();
    config.auth_token = Some(rdma_rpc::Secret::new("s3cret"));
    config.connect_timeout = 4 * EVENTUALLY;
    let srv = suite::start(&ep(), config.clone()).await;
    let good = suite::connect_with(&srv.endpoint, config).await;
    let mut bad = raw(&srv.endpoint).await;
    let mut head = frame(Kind::Hello, 0, 0, &[]);
    head[24..32].copy_from_slice(&(GREETING_MAX + 1).to_le_bytes());
    bad.write_all(&head).await.unwrap();
    let msgs = decode_all(&read_to_close(&mut bad).await);
    assert_eq!(msgs.len(), 1, "one refusal, then close: {msgs:?}");
    assert_eq!(
        ServerErrorKind::from_code(msgs[0].header.aux),
        ServerErrorKind::Unauthenticated
    );
    assert_eq!(good.add(4, 4).await.unwrap(), 8);
    srv.shutdown.shutdown();
}
