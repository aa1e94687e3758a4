//! TLS on `tcp://` endpoints: certificates made at test time (rcgen) in a temporary
//! directory; round trips, and every way a peer can fail the handshake, each refused before
//! any handler runs while the server goes on serving the others.
#![cfg(feature = "tls")]

mod suite;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rdma_rpc::tls::ServerTls;
use rdma_rpc::{Client, Config, Endpoint, Payload, RpcError, Scheme, Server};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use suite::{ProbeClient, EVENTUALLY};

/// A CA, a server certificate (for `localhost` and 127.0.0.1) and a client certificate it
/// issued, and an unrelated CA with a client certificate of its own, as PEM files.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new() -> Pki {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rdma-rpc-tls-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let pki = Pki { dir };
        let ca = pki.ca("ca", "rdma-rpc test CA");
        pki.leaf("server", &ca, &["localhost", "127.0.0.1"], true);
        pki.leaf("client", &ca, &["client.test"], false);
        let other = pki.ca("other-ca", "some other CA");
        pki.leaf("other-client", &other, &["client.test"], false);
        pki
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_str().unwrap().to_owned()
    }

    fn write(&self, name: &str, contents: &str) {
        std::fs::write(self.dir.join(name), contents).unwrap();
    }

    fn ca(&self, name: &str, cn: &str) -> Issuer<'static, KeyPair> {
        let mut params = CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, cn);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        self.write(
            &format!("{name}.pem"),
            &params.self_signed(&key).unwrap().pem(),
        );
        Issuer::new(params, key)
    }

    fn leaf(&self, name: &str, ca: &Issuer<'static, KeyPair>, sans: &[&str], server: bool) {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        params.distinguished_name.push(DnType::CommonName, sans[0]);
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, ca).unwrap();
        self.write(&format!("{name}.pem"), &cert.pem());
        self.write(&format!("{name}.key"), &key.serialize_pem());
    }

    /// Where a TLS server binds (port 0).
    fn server_ep(&self) -> Endpoint {
        plain_bind()
            .with_option("tls_cert", self.path("server.pem"))
            .with_option("tls_key", self.path("server.key"))
    }

    /// A TLS server that requires client certificates from our CA.
    fn mtls_server_ep(&self) -> Endpoint {
        self.server_ep()
            .with_option("tls_client_ca", self.path("ca.pem"))
    }

    /// A TLS client's endpoint for a server on `port`, trusting our CA.
    fn client_ep(&self, port: u16) -> Endpoint {
        Endpoint::new(Scheme::Tcp, "127.0.0.1", port)
            .with_option("tls", "1")
            .with_option("tls_ca", self.path("ca.pem"))
    }

    /// The same, presenting the client certificate `name` (`client` or `other-client`).
    fn client_ep_with_cert(&self, port: u16, name: &str) -> Endpoint {
        self.client_ep(port)
            .with_option("tls_cert", self.path(&format!("{name}.pem")))
            .with_option("tls_key", self.path(&format!("{name}.key")))
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn plain_bind() -> Endpoint {
    "tcp://127.0.0.1:0".parse().unwrap()
}

fn plain_ep(port: u16) -> Endpoint {
    Endpoint::new(Scheme::Tcp, "127.0.0.1", port)
}

/// A client config that does not retry: each connection attempt is one handshake.
fn once() -> Config {
    let mut c = Config::default();
    c.reconnect = false;
    c
}

async fn connect(ep: &Endpoint) -> Result<ProbeClient, RpcError> {
    tokio::time::timeout(EVENTUALLY, Client::connect_with(ep, once()))
        .await
        .expect("connecting ends")
        .map(ProbeClient::from_client)
}

async fn refused(ep: &Endpoint) -> String {
    match connect(ep).await {
        Ok(_) => panic!("{ep}: connected"),
        Err(e) => e.to_string(),
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 9) as u8)
        .collect()
}

async fn stop(srv: suite::Running) {
    srv.shutdown.shutdown();
    tokio::time::timeout(EVENTUALLY, srv.serving)
        .await
        .expect("server stops")
        .expect("server task")
        .expect("server result");
}

/// Asserts that no handler ran on `srv` (the refused peers never reached one).
async fn no_handler_ran(srv: &suite::Running) {
    assert!(
        srv.probes.started.lock().await.try_recv().is_err(),
        "a handler ran"
    );
}

/// Sizes around the eager threshold and a 4 MiB payload come back byte-exact over TLS; the
/// server name is checked both as an IP address (the host) and as a DNS name (`tls_name`);
/// the server shuts down gracefully with TLS connections open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip() {
    let pki = Pki::new();
    let srv = suite::start(&pki.server_ep(), Config::default()).await;
    let port = srv.endpoint.port();
    let client = connect(&pki.client_ep(port)).await.expect("TLS client");
    assert!(!client.client().is_closed());
    assert_eq!(client.add(2, 3).await.unwrap(), 5);
    let t = Config::default().eager_threshold;
    for len in [0, 1, t - 1, t, t + 1, 1 << 20, 4 << 20] {
        let data = pattern(len);
        let back = client
            .echo(Payload::from(data.clone()))
            .await
            .expect("echo");
        assert_eq!(back.len(), len);
        assert!(
            back == data,
            "{len} bytes differ after a round trip over TLS"
        );
    }
    // Many calls at once, to exercise both halves of the TLS stream together.
    let calls: Vec<_> = (0..500u64)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { (i, c.add(i, 1).await) })
        })
        .collect();
    for call in calls {
        let (i, r) = call.await.unwrap();
        assert_eq!(r.unwrap(), i + 1);
    }
    let by_name = connect(&pki.client_ep(port).with_option("tls_name", "localhost"))
        .await
        .expect("TLS client checking the DNS name");
    assert_eq!(by_name.add(1, 1).await.unwrap(), 2);
    stop(srv).await;
    tokio::time::timeout(EVENTUALLY, client.client().closed())
        .await
        .expect("the client sees the connection close");
}

/// A plain-text client, and a raw peer sending frames, are dropped before any handler runs;
/// a peer that never starts its handshake holds nobody up; TLS clients go on being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_client_is_refused_by_tls_server() {
    let pki = Pki::new();
    let srv = suite::start(&pki.server_ep(), Config::default()).await;
    let port = srv.endpoint.port();
    let good = connect(&pki.client_ep(port)).await.expect("TLS client");

    let silent = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    // It reads the server's TLS alert as such (or, if the alert is lost, sees the close).
    let e = refused(&plain_ep(port)).await;
    assert!(
        e.contains("the peer speaks TLS") || e.contains("closed") || e.contains("reset"),
        "{e}"
    );

    // Raw rdma-rpc frames: a greeting and a request for a handler.
    let mut raw = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let block = rdma_rpc::__private::method_id("Probe.block");
    let mut bytes = suite::raw::frame(rdma_rpc::core::wire::Kind::Hello, 0, 0, &[1]);
    bytes.extend(suite::raw::frame(
        rdma_rpc::core::wire::Kind::Request,
        1,
        block,
        &[1],
    ));
    raw.write_all(&bytes).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(EVENTUALLY, raw.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection")
        .ok();
    assert!(
        !answer.starts_with(b"RR"),
        "the server answered in plain rdma-rpc"
    );

    // Served before, during and after: a fresh TLS client too, while `silent` is still open.
    assert_eq!(good.add(1, 2).await.unwrap(), 3);
    let fresh = connect(&pki.client_ep(port)).await.expect("TLS client");
    assert_eq!(fresh.add(3, 4).await.unwrap(), 7);
    drop(silent);
    no_handler_ran(&srv).await;
    stop(srv).await;
}

/// A client that does not trust the server's CA, or expects another name, refuses it with
/// the TLS reason in the error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_server_is_refused() {
    let pki = Pki::new();
    let srv = suite::start(&pki.server_ep(), Config::default()).await;
    let port = srv.endpoint.port();

    let wrong_ca = pki
        .client_ep(port)
        .with_option("tls_ca", pki.path("other-ca.pem"));
    let e = refused(&wrong_ca).await;
    assert!(
        e.contains("TLS handshake") && e.contains("certificate"),
        "{e}"
    );
    assert!(e.contains("UnknownIssuer"), "{e}");

    let wrong_name = pki.client_ep(port).with_option("tls_name", "wrong.example");
    let e = refused(&wrong_name).await;
    assert!(
        e.contains("TLS handshake") && e.contains("wrong.example"),
        "{e}"
    );

    // The server is fine.
    let good = connect(&pki.client_ep(port)).await.expect("TLS client");
    assert_eq!(good.add(5, 5).await.unwrap(), 10);
    no_handler_ran(&srv).await;
    stop(srv).await;
}

/// Mutual TLS: a client without a certificate, or with one from another CA, is refused;
/// one with a certificate from the configured CA is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls() {
    let pki = Pki::new();
    let srv = suite::start(&pki.mtls_server_ep(), Config::default()).await;
    let port = srv.endpoint.port();

    // TLS 1.3 clients finish their side of the handshake first; the server's verdict
    // arrives as an alert when they read (or, should the alert be lost, as the close).
    let closed = |e: &str| e.contains("closed") || e.contains("reset");
    let e = refused(&pki.client_ep(port)).await;
    assert!(e.contains("CertificateRequired") || closed(&e), "{e}");
    let e = refused(&pki.client_ep_with_cert(port, "other-client")).await;
    assert!(e.contains("UnknownCA") || closed(&e), "{e}");
    no_handler_ran(&srv).await;

    let good = connect(&pki.client_ep_with_cert(port, "client"))
        .await
        .expect("client with a certificate");
    assert_eq!(good.add(20, 22).await.unwrap(), 42);
    let data = pattern(1 << 20);
    assert!(good.echo(Payload::from(data.clone())).await.unwrap() == data);
    stop(srv).await;
}

/// A TLS client against a plain server fails cleanly (and promptly), naming the handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_client_against_plain_server() {
    let pki = Pki::new();
    let srv = suite::start(&plain_bind(), Config::default()).await;
    let port = srv.endpoint.port();
    let e = refused(&pki.client_ep(port)).await;
    assert!(e.contains("TLS handshake"), "{e}");
    let plain = connect(&plain_ep(port)).await.expect("plain client");
    assert_eq!(plain.add(1, 1).await.unwrap(), 2);
    no_handler_ran(&srv).await;
    stop(srv).await;
}

/// After the server restarts, a TLS client reconnects by itself, again over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_over_tls() {
    let pki = Pki::new();
    let srv = suite::start(&pki.server_ep(), Config::default()).await;
    let port = srv.endpoint.port();
    let client = ProbeClient::from_client(
        Client::connect_with(&pki.client_ep(port), Config::default())
            .await
            .expect("TLS client"),
    );
    assert_eq!(client.add(1, 1).await.unwrap(), 2);
    stop(srv).await;
    tokio::time::timeout(EVENTUALLY, client.client().closed())
        .await
        .expect("the client sees the connection close");
    let again = suite::start(&pki.server_ep().with_port(port), Config::default()).await;
    assert_eq!(client.add(2, 2).await.unwrap(), 4, "reconnected over TLS");
    stop(again).await;
}

/// Bad option values are errors at bind or connect time, saying which option and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_fail_clearly() {
    let pki = Pki::new();
    pki.write("garbage.pem", "not a PEM file\n");

    async fn bind_error(ep: &Endpoint) -> String {
        match Server::bind(ep).await {
            Ok(_) => panic!("{ep}: bound"),
            Err(e) => e.to_string(),
        }
    }
    let cases = [
        (
            plain_bind()
                .with_option("tls_cert", pki.path("missing.pem"))
                .with_option("tls_key", pki.path("server.key")),
            &["tls_cert", "cannot read"][..],
        ),
        (
            plain_bind()
                .with_option("tls_cert", pki.path("server.pem"))
                .with_option("tls_key", pki.path("server.pem")),
            &["tls_key", "no private key"],
        ),
        (
            plain_bind()
                .with_option("tls_cert", pki.path("garbage.pem"))
                .with_option("tls_key", pki.path("server.key")),
            &["tls_cert", "no certificate"],
        ),
        (
            plain_bind()
                .with_option("tls_cert", pki.path("server.pem"))
                .with_option("tls_key", pki.path("client.key")),
            &["tls_key", "unusable"],
        ),
        (
            pki.server_ep()
                .with_option("tls_client_ca", pki.path("server.key")),
            &["tls_client_ca", "no certificate"],
        ),
        (
            plain_bind().with_option("tls_cert", pki.path("server.pem")),
            &["needs tls_key"],
        ),
        (
            pki.server_ep().with_option("tls_ca", pki.path("ca.pem")),
            &["client option"],
        ),
    ];
    for (ep, needles) in cases {
        let e = bind_error(&ep).await;
        for n in needles {
            assert!(e.contains(n), "{ep}: {e}");
        }
    }

    // Clients fail before connecting: nothing needs to listen.
    let port = 1;
    let cases = [
        (
            plain_ep(port).with_option("tls", "1"),
            &["needs tls_ca"][..],
        ),
        (
            pki.client_ep(port)
                .with_option("tls_ca", pki.path("nope.pem")),
            &["tls_ca", "cannot read"],
        ),
        (
            pki.client_ep(port)
                .with_option("tls_ca", pki.path("garbage.pem")),
            &["tls_ca", "no certificate"],
        ),
        (
            pki.client_ep(port)
                .with_option("tls_cert", pki.path("client.pem")),
            &["needs tls_key"],
        ),
        (
            pki.client_ep(port).with_option("tls_name", "not a name!"),
            &["tls_name", "not a valid DNS name"],
        ),
        // A TLS server's endpoint handed to a client as it is: not silently plain text.
        (pki.server_ep().with_port(port), &["add tls=1"]),
    ];
    for (ep, needles) in cases {
        let e = refused(&ep).await;
        for n in needles {
            assert!(e.contains(n), "{ep}: {e}");
        }
    }
}

/// TLS configured in code: `Server::bind_tls` with a `ServerTls`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_tls_in_code() {
    let pki = Pki::new();
    let tls = ServerTls::from_pem_files(
        pki.path("server.pem"),
        pki.path("server.key"),
        None::<&Path>,
    )
    .expect("server TLS");
    let server = Server::bind_tls(&plain_bind(), Config::default(), tls.clone())
        .await
        .expect("bind");
    let port = server.local_endpoint().port();
    let shutdown = server.shutdown_handle();
    let (imp, probes) = suite::probe();
    let serving = tokio::spawn(server.serve(suite::ProbeServer::new(imp)));

    let client = connect(&pki.client_ep(port)).await.expect("TLS client");
    assert_eq!(client.add(6, 7).await.unwrap(), 13);
    refused(&plain_ep(port)).await;
    assert!(probes.started.lock().await.try_recv().is_err());

    // TLS options in the endpoint as well are ambiguous.
    let e = Server::bind_tls(&pki.server_ep(), Config::default(), tls)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("tls_cert"), "{e}");
    let e =
        ServerTls::from_pem_files(pki.path("missing"), pki.path("server.key"), None).unwrap_err();
    assert!(e.to_string().contains("cannot read"), "{e}");

    shutdown.shutdown();
    tokio::time::timeout(EVENTUALLY, serving)
        .await
        .expect("server stops")
        .unwrap()
        .unwrap();
}

/// A connection attempt that times out says which part did not finish: a TLS client against
/// a listener that accepts and then says nothing stalls in the TLS handshake, part of the
/// transport's connection, before any greeting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_timeout_names_the_transport_when_the_peer_is_silent() {
    let pki = Pki::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let silent = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut sink = vec![0u8; 1024];
        while s.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
    });
    let ep = pki.client_ep(port).with_option("connect_timeout_ms", "300");
    let e = refused(&ep).await;
    assert!(e.contains("no connection within 300ms"), "{e}");
    assert!(
        e.contains("the transport's connection was not set up"),
        "{e}"
    );
    silent.abort();
}
