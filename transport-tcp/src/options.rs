//! The TLS options of a `tcp://` endpoint, checked without touching the file system.
//!
//! Server (`bind`): `tls_cert=PATH&tls_key=PATH` turn TLS on; `tls_client_ca=PATH` also
//! requires a client certificate issued by those CAs (mutual TLS).
//!
//! Client (`connect`): `tls=1` turns TLS on and needs `tls_ca=PATH` (the CAs to trust: there
//! are no system roots); `tls_name=NAME` is the name to check in the server's certificate
//! (default: the endpoint's host); `tls_cert=PATH&tls_key=PATH` present a client certificate.
//!
//! Anything ambiguous is an error rather than a silent fallback to plain text: a `tls_*`
//! option on a client without `tls=1`, an option of the other side, a misspelt `tls_*` option.

use std::io;

use rpc_core::Endpoint;

/// One option as written in the endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Opt<'a> {
    pub(crate) key: &'static str,
    pub(crate) value: &'a str,
}

impl Opt<'_> {
    /// An error about this option.
    pub(crate) fn error(&self, reason: impl std::fmt::Display) -> io::Error {
        option_error(self.key, self.value, reason)
    }
}

/// What a server endpoint asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServerOptions<'a> {
    pub(crate) cert: Opt<'a>,
    pub(crate) key: Opt<'a>,
    pub(crate) client_ca: Option<Opt<'a>>,
}

/// What a client endpoint asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClientOptions<'a> {
    pub(crate) ca: Opt<'a>,
    /// The server name to verify (`tls_name`, or the host).
    pub(crate) name: Opt<'a>,
    pub(crate) cert_key: Option<(Opt<'a>, Opt<'a>)>,
}

const SERVER_ONLY: &[&str] = &["tls_client_ca"];
const CLIENT_ONLY: &[&str] = &["tls_ca", "tls_name"];
const SHARED: &[&str] = &["tls", "tls_cert", "tls_key"];

fn option_error(key: &str, value: &str, reason: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("endpoint option {key}={value:?}: {reason}"),
    )
}

/// Every `tls*` option must be known; returns `tls=` as a flag.
fn check_keys(ep: &Endpoint, other_side: &[&str], other_name: &str) -> io::Result<Option<bool>> {
    for (k, v) in ep.options() {
        if !k.starts_with("tls") {
            continue;
        }
        if other_side.contains(&k) {
            return Err(option_error(
                k,
                v,
                format!("is a {other_name} option, not valid here"),
            ));
        }
        if !SHARED.contains(&k) && !SERVER_ONLY.contains(&k) && !CLIENT_ONLY.contains(&k) {
            return Err(option_error(
                k,
                v,
                "unknown TLS option (expected tls, tls_cert, tls_key, tls_client_ca, tls_ca \
                 or tls_name)",
            ));
        }
    }
    match ep.option("tls") {
        None => Ok(None),
        Some("1" | "true") => Ok(Some(true)),
        Some("0" | "false") => Ok(Some(false)),
        Some(v) => Err(option_error("tls", v, "expected 0 or 1")),
    }
}

fn path<'a>(ep: &'a Endpoint, key: &'static str) -> io::Result<Option<Opt<'a>>> {
    match ep.option(key) {
        None => Ok(None),
        Some("") => Err(option_error(key, "", "expected a file path")),
        Some(value) => Ok(Some(Opt { key, value })),
    }
}

fn pair<'a>(ep: &'a Endpoint) -> io::Result<Option<(Opt<'a>, Opt<'a>)>> {
    match (path(ep, "tls_cert")?, path(ep, "tls_key")?) {
        (Some(c), Some(k)) => Ok(Some((c, k))),
        (None, None) => Ok(None),
        (Some(c), None) => Err(c.error("needs tls_key=PATH too (the certificate's private key)")),
        (None, Some(k)) => Err(k.error("needs tls_cert=PATH too (the key's certificate chain)")),
    }
}

/// The TLS a server endpoint asks for, if any.
pub(crate) fn server(ep: &Endpoint) -> io::Result<Option<ServerOptions<'_>>> {
    let flag = check_keys(ep, CLIENT_ONLY, "client")?;
    let client_ca = path(ep, "tls_client_ca")?;
    match (pair(ep)?, flag) {
        (Some((c, _)), Some(false)) => Err(c.error("contradicts tls=0")),
        (Some((cert, key)), _) => Ok(Some(ServerOptions {
            cert,
            key,
            client_ca,
        })),
        (None, Some(true)) => Err(option_error(
            "tls",
            "1",
            "a TLS server needs tls_cert=PATH and tls_key=PATH",
        )),
        (None, _) => match client_ca {
            Some(ca) => Err(ca.error("needs tls_cert=PATH and tls_key=PATH (TLS is off)")),
            None => Ok(None),
        },
    }
}

/// The TLS a client endpoint asks for, if any.
pub(crate) fn client(ep: &Endpoint) -> io::Result<Option<ClientOptions<'_>>> {
    let flag = check_keys(ep, SERVER_ONLY, "server")?;
    let ca = path(ep, "tls_ca")?;
    let cert_key = pair(ep)?;
    let name = match ep.option("tls_name") {
        Some("") => return Err(option_error("tls_name", "", "expected a server name")),
        Some(value) => Some(Opt {
            key: "tls_name",
            value,
        }),
        None => None,
    };
    if flag != Some(true) {
        // Any TLS option without tls=1 is a mistake; connecting in plain text would hide it.
        let stray = ca.or(name).or(cert_key.map(|(c, _)| c));
        return match stray {
            Some(o) => Err(o.error("TLS is off: add tls=1 to connect with TLS")),
            None => Ok(None),
        };
    }
    let ca = ca.ok_or_else(|| {
        option_error(
            "tls",
            "1",
            "needs tls_ca=PATH, the PEM file of the certificate authorities to trust",
        )
    })?;
    Ok(Some(ClientOptions {
        ca,
        name: name.unwrap_or(Opt {
            key: "tls_name",
            value: ep.host(),
        }),
        cert_key,
    }))
}

/// The error for an endpoint that asks for TLS in a build without it.
#[cfg(not(feature = "tls"))]
pub(crate) fn no_tls() -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        "the endpoint asks for TLS, but this build has none (transport-tcp built without its \
         `tls` feature)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(s: &str) -> Endpoint {
        s.parse().unwrap()
    }

    fn err(r: io::Result<impl std::fmt::Debug>) -> String {
        let e = r.expect_err("an error");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        e.to_string()
    }

    #[test]
    fn plain_endpoints_have_no_tls() {
        let e = ep("tcp://h:1?max_in_flight=3&device=x&tls=0");
        assert_eq!(server(&e).unwrap(), None);
        assert_eq!(client(&e).unwrap(), None);
    }

    #[test]
    fn server_options() {
        let e = ep("tcp://h:1?tls_cert=/c&tls_key=/k");
        let o = server(&e).unwrap().unwrap();
        assert_eq!((o.cert.value, o.key.value, o.client_ca), ("/c", "/k", None));
        let e = ep("tcp://h:1?tls=1&tls_cert=/c&tls_key=/k&tls_client_ca=/a");
        let o = server(&e).unwrap().unwrap();
        assert_eq!(o.client_ca.unwrap().value, "/a");

        for (s, needle) in [
            ("tcp://h:1?tls_cert=/c", "needs tls_key"),
            ("tcp://h:1?tls_key=/k", "needs tls_cert"),
            ("tcp://h:1?tls=1", "needs tls_cert"),
            ("tcp://h:1?tls_client_ca=/a", "TLS is off"),
            (
                "tcp://h:1?tls=0&tls_cert=/c&tls_key=/k",
                "contradicts tls=0",
            ),
            (
                "tcp://h:1?tls=yes&tls_cert=/c&tls_key=/k",
                "expected 0 or 1",
            ),
            (
                "tcp://h:1?tls_cert=/c&tls_key=/k&tls_ca=/a",
                "client option",
            ),
            (
                "tcp://h:1?tls_cert=/c&tls_key=/k&tls_name=x",
                "client option",
            ),
            (
                "tcp://h:1?tls_cert=/c&tls_key=/k&tls_certs=/x",
                "unknown TLS option",
            ),
            ("tcp://h:1?tls_cert=&tls_key=/k", "expected a file path"),
        ] {
            let msg = err(server(&ep(s)));
            assert!(msg.contains(needle), "{s}: {msg}");
        }
    }

    #[test]
    fn client_options() {
        let e = ep("tcp://server.example:1?tls=1&tls_ca=/ca");
        let o = client(&e).unwrap().unwrap();
        assert_eq!(
            (o.ca.value, o.name.value, o.cert_key),
            ("/ca", "server.example", None)
        );
        let e = ep("tcp://[::1]:1?tls=true&tls_ca=/ca&tls_name=n&tls_cert=/c&tls_key=/k");
        let o = client(&e).unwrap().unwrap();
        assert_eq!(o.name.value, "n");
        assert_eq!(
            o.cert_key.map(|(c, k)| (c.value, k.value)),
            Some(("/c", "/k"))
        );
        assert_eq!(
            client(&ep("tcp://[::1]:1?tls=1&tls_ca=/ca"))
                .unwrap()
                .unwrap()
                .name
                .value,
            "::1"
        );

        for (s, needle) in [
            ("tcp://h:1?tls=1", "needs tls_ca"),
            ("tcp://h:1?tls_ca=/ca", "add tls=1"),
            ("tcp://h:1?tls=0&tls_ca=/ca", "add tls=1"),
            // A server's endpoint handed to a client as it is.
            ("tcp://h:1?tls_cert=/c&tls_key=/k", "add tls=1"),
            ("tcp://h:1?tls=1&tls_ca=/ca&tls_cert=/c", "needs tls_key"),
            (
                "tcp://h:1?tls=1&tls_ca=/ca&tls_client_ca=/x",
                "server option",
            ),
            (
                "tcp://h:1?tls=1&tls_ca=/ca&tls_name=",
                "expected a server name",
            ),
            ("tcp://h:1?tls=2&tls_ca=/ca", "expected 0 or 1"),
        ] {
            let msg = err(client(&ep(s)));
            assert!(msg.contains(needle), "{s}: {msg}");
        }
    }
}
