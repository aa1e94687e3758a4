//! A message with more payloads than `Config::max_attachments` fails alone, with an error that
//! says so, and the connection's other calls go on: a request is refused by its caller before
//! anything is sent, and a handler's result by the server, which answers the call with an
//! `Internal` error instead (a frame with that many would be refused by the peer's decoder,
//! which closes the connection, and a count past 65,535 does not fit the wire's field).
//!
//! Over [`rpc_core::mem`], an in-process transport with no framing (its frames are never
//! decoded, so nothing but these checks stands between a call and the limit).

use rpc_core::{
    mem, Bincode, Client, Config, Payload, Reply, Request, RpcError, ServerError, ServerErrorKind,
    ShutdownHandle,
};

/// Method 1 answers `n` one-byte payloads; method 2 counts the payloads it was sent.
struct Svc;

impl rpc_core::Service for Svc {
    const NAME: &'static str = "Svc";

    fn method_name(&self, m: u32) -> Option<&'static str> {
        match m {
            1 => Some("Svc.many"),
            2 => Some("Svc.count"),
            _ => None,
        }
    }

    async fn dispatch(&self, m: u32, req: Request) -> Result<Reply, ServerError> {
        if m == 1 {
            let n: u64 = req.decode::<Bincode, _>("Svc.many")?;
            let all: Vec<Payload> = (0..n).map(|i| Payload::from(vec![i as u8])).collect();
            Reply::encode::<Bincode, _>(&all)
        } else {
            let all: Vec<Payload> = req.decode::<Bincode, _>("Svc.count")?;
            Reply::encode::<Bincode, _>(&(all.len() as u64))
        }
    }
}

async fn served(config: Config) -> (Client, ShutdownHandle) {
    let (listener, connector) = mem::listener();
    let shutdown = ShutdownHandle::new();
    tokio::spawn(rpc_core::server::serve(
        listener,
        Svc,
        config.clone(),
        shutdown.clone(),
        Default::default(),
    ));
    let transport = connector.connect().await.unwrap();
    let client = Client::handshake(transport, config).await.unwrap();
    (client, shutdown)
}

fn payloads(n: usize) -> Vec<Payload> {
    (0..n).map(|_| Payload::from(vec![7u8; 3])).collect()
}

#[tokio::test]
async fn a_request_with_too_many_payloads_fails_alone_before_it_is_sent() {
    let mut config = Config::default();
    config.max_attachments = 4;
    let (client, shutdown) = served(config).await;
    let at_limit: u64 = client
        .call::<Bincode, _, _>(2, "Svc.count", &payloads(4))
        .await
        .unwrap();
    assert_eq!(at_limit, 4);
    let e = client
        .call::<Bincode, _, u64>(2, "Svc.count", &payloads(5))
        .await
        .unwrap_err();
    assert!(
        matches!(e, RpcError::TooManyAttachments { count: 5, limit: 4 }),
        "{e}"
    );
    assert!(e.to_string().contains("5 payloads"), "{e}");
    assert_eq!(
        client.in_flight(),
        0,
        "nothing registered for the refused call"
    );
    // the connection goes on
    let after: u64 = client
        .call::<Bincode, _, _>(2, "Svc.count", &payloads(1))
        .await
        .unwrap();
    assert_eq!(after, 1);
    assert!(!client.is_closed());
    shutdown.shutdown();
}

#[tokio::test]
async fn a_result_with_too_many_payloads_is_answered_with_an_error() {
    let mut config = Config::default();
    config.max_attachments = 4;
    let (client, shutdown) = served(config).await;
    let four: Vec<Payload> = client
        .call::<Bincode, _, _>(1, "Svc.many", &4u64)
        .await
        .unwrap();
    assert_eq!(four.len(), 4);
    assert_eq!(&*four[3], &[3]);
    let e = client
        .call::<Bincode, _, Vec<Payload>>(1, "Svc.many", &5u64)
        .await
        .unwrap_err();
    assert_eq!(e.server_kind(), Some(ServerErrorKind::Internal), "{e}");
    assert!(e.to_string().contains("5 payloads"), "{e}");
    // the connection goes on
    let one: Vec<Payload> = client
        .call::<Bincode, _, _>(1, "Svc.many", &1u64)
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    assert!(!client.is_closed());
    shutdown.shutdown();
}
