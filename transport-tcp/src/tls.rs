//! TLS for TCP connections: rustls with the *ring* provider, certificates and keys from PEM
//! files.
//!
//! Endpoints turn it on, so a configuration file switches it without code changes:
//! - server: `tcp://0.0.0.0:7000?tls_cert=/etc/svc/cert.pem&tls_key=/etc/svc/key.pem`, plus
//!   `&tls_client_ca=/etc/svc/clients-ca.pem` to require client certificates (mutual TLS);
//! - client: `tcp://svc.example:7000?tls=1&tls_ca=/etc/svc/ca.pem`, plus `&tls_name=NAME` to
//!   check another name than the endpoint's host and `&tls_cert=…&tls_key=…` to present a
//!   client certificate. Only the CAs in `tls_ca` are trusted: there are no system roots.
//!
//! A client-side `tls_*` option without `tls=1`, an option meant for the other side or a
//! misspelt `tls_*` option is an error at bind or connect time, never a silent fall back to
//! plain text. Files are read when binding, and at every connection attempt of a client (so a
//! renewed certificate is picked up on reconnection).
//!
//! The server's handshake runs in [`Transport::establish`](rpc_core::Transport::establish), in
//! the connection's own task and bounded by `connect_timeout`: a peer that fails it (plain
//! text, an untrusted or missing client certificate) is dropped before any frame is read.

use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

pub use tokio_rustls::rustls;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

use crate::options::{ClientOptions, Opt, ServerOptions};

/// The crypto provider every configuration made here uses: *ring* (no cmake or NASM needed
/// to build, unlike aws-lc-rs). Named explicitly, so nothing depends on a process-wide default.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A server configuration from PEM files: the certificate chain (leaf first) and its private
/// key, and, for mutual TLS, the CAs whose client certificates are accepted (then a client
/// without one is refused).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> io::Result<Arc<ServerConfig>> {
    let cert = lossy("tls_cert", cert);
    let key = lossy("tls_key", key);
    let client_ca = client_ca.map(|p| lossy("tls_client_ca", p));
    server_from_options(&ServerOptions {
        cert: cert.opt(),
        key: key.opt(),
        client_ca: client_ca.as_ref().map(Owned::opt),
    })
}

/// A client configuration from PEM files: the CAs to trust and, optionally, a client
/// certificate chain and its key.
pub fn client_config(ca: &Path, cert_key: Option<(&Path, &Path)>) -> io::Result<Arc<ClientConfig>> {
    let ca = lossy("tls_ca", ca);
    let cert_key = cert_key.map(|(c, k)| (lossy("tls_cert", c), lossy("tls_key", k)));
    client_builder(ca.opt(), cert_key.as_ref().map(|(c, k)| (c.opt(), k.opt())))
}

/// The server name to check a server's certificate against: a DNS name or an IP address.
pub fn server_name(name: &str) -> io::Result<ServerName<'static>> {
    ServerName::try_from(name.to_owned()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a valid DNS name or IP address for TLS"),
        )
    })
}

struct Owned {
    key: &'static str,
    value: String,
}

impl Owned {
    fn opt(&self) -> Opt<'_> {
        Opt {
            key: self.key,
            value: &self.value,
        }
    }
}

fn lossy(key: &'static str, p: &Path) -> Owned {
    Owned {
        key,
        value: p.to_string_lossy().into_owned(),
    }
}

pub(crate) fn server_from_options(o: &ServerOptions<'_>) -> io::Result<Arc<ServerConfig>> {
    let certs = read_certs(o.cert)?;
    let key = read_key(o.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| o.cert.error(e))?;
    let builder = match o.client_ca {
        Some(ca) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(read_roots(ca)?), provider())
                    .build()
                    .map_err(|e| ca.error(e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        o.key
            .error(format!("unusable with the certificate of tls_cert: {e}"))
    })?;
    Ok(Arc::new(config))
}

pub(crate) fn client_from_options(
    o: &ClientOptions<'_>,
) -> io::Result<(Arc<ClientConfig>, ServerName<'static>)> {
    let name = ServerName::try_from(o.name.value.to_owned())
        .map_err(|_| o.name.error("not a valid DNS name or IP address"))?;
    Ok((client_builder(o.ca, o.cert_key)?, name))
}

fn client_builder(
    ca: Opt<'_>,
    cert_key: Option<(Opt<'_>, Opt<'_>)>,
) -> io::Result<Arc<ClientConfig>> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| ca.error(e))?
        .with_root_certificates(read_roots(ca)?);
    let config = match cert_key {
        Some((cert, key)) => builder
            .with_client_auth_cert(read_certs(cert)?, read_key(key)?)
            .map_err(|e| key.error(format!("unusable with the certificate of tls_cert: {e}")))?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

fn read(o: Opt<'_>) -> io::Result<Vec<u8>> {
    std::fs::read(o.value).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "endpoint option {}={:?}: cannot read the file: {e}",
                o.key, o.value
            ),
        )
    })
}

fn pem_error(o: Opt<'_>, e: impl fmt::Display) -> io::Error {
    o.error(format!("not a valid PEM file: {e}"))
}

fn read_certs(o: Opt<'_>) -> io::Result<Vec<CertificateDer<'static>>> {
    let pem = read(o)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(o, e))?;
    if certs.is_empty() {
        return Err(o.error("no certificate (BEGIN CERTIFICATE) in the file"));
    }
    Ok(certs)
}

fn read_key(o: Opt<'_>) -> io::Result<PrivateKeyDer<'static>> {
    let pem = read(o)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => o.error(
            "no private key in the file (expected BEGIN PRIVATE KEY, RSA PRIVATE KEY or EC \
             PRIVATE KEY)",
        ),
        e => pem_error(o, e),
    })
}

fn read_roots(o: Opt<'_>) -> io::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(o)? {
        roots
            .add(cert)
            .map_err(|e| o.error(format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// Adds the TLS reason to a failed handshake's error.
pub(crate) fn handshake_error(with: &str, e: io::Error) -> io::Error {
    let hint = match e.kind() {
        io::ErrorKind::UnexpectedEof => " (the peer closed the connection: does it speak TLS?)",
        _ => "",
    };
    io::Error::new(
        e.kind(),
        format!("TLS handshake with {with} failed: {e}{hint}"),
    )
}
