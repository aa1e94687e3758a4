//! [`Endpoint`]: where to connect or listen, and over which transport.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The transport an endpoint names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Scheme {
    /// `tcp://`: tokio TCP.
    Tcp,
    /// `rdma://`: RDMA verbs (RoCE, InfiniBand, iWARP) through the RDMA connection manager.
    Rdma,
}

impl Scheme {
    /// The scheme as written in an endpoint (`"tcp"`, `"rdma"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Tcp => "tcp",
            Scheme::Rdma => "rdma",
        }
    }
}

/// A transport address: `tcp://HOST:PORT` or `rdma://HOST:PORT[?key=value&...]`.
///
/// `HOST` is a name, an IPv4 address or a bracketed IPv6 address. Options after `?` tune the
/// transport (for RDMA, `device=rxe0` and the like). Parsed with [`FromStr`], printed back the
/// same way with [`Display`](fmt::Display), and (de)serialised with serde as that string, so a
/// config file or an environment variable picks the transport:
///
/// ```
/// use rpc_core::{Endpoint, Scheme};
/// let ep: Endpoint = "rdma://10.0.0.7:7471?device=mlx5_0".parse().unwrap();
/// assert_eq!(ep.scheme(), Scheme::Rdma);
/// assert_eq!(ep.option("device"), Some("mlx5_0"));
/// assert_eq!(ep.to_string(), "rdma://10.0.0.7:7471?device=mlx5_0");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    scheme: Scheme,
    host: String,
    port: u16,
    options: Vec<(String, String)>,
}

/// Why a string is not an endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid endpoint {input:?}: {reason}")]
pub struct EndpointParseError {
    input: String,
    reason: &'static str,
}

impl Endpoint {
    /// An endpoint with no options.
    pub fn new(scheme: Scheme, host: impl Into<String>, port: u16) -> Endpoint {
        Endpoint {
            scheme,
            host: host.into(),
            port,
            options: Vec::new(),
        }
    }

    /// The transport.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The host, without brackets for IPv6.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port (0 when binding means "pick a free one").
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `host:port`, bracketing IPv6 addresses, as socket APIs take it.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The value of option `key`, if given.
    pub fn option(&self, key: &str) -> Option<&str> {
        self.options
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// All options in the order given.
    pub fn options(&self) -> impl Iterator<Item = (&str, &str)> {
        self.options.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The same endpoint with another port.
    pub fn with_port(&self, port: u16) -> Endpoint {
        Endpoint {
            port,
            ..self.clone()
        }
    }

    /// The same endpoint with option `key` set to `value`.
    pub fn with_option(mut self, key: impl Into<String>, value: impl Into<String>) -> Endpoint {
        let key = key.into();
        let value = value.into();
        match self.options.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.options.push((key, value)),
        }
        self
    }
}

impl FromStr for Endpoint {
    type Err = EndpointParseError;

    fn from_str(s: &str) -> Result<Endpoint, EndpointParseError> {
        let err = |reason| EndpointParseError {
            input: s.to_owned(),
            reason,
        };
        let (scheme, rest) = s
            .split_once("://")
            .ok_or_else(|| err("expected SCHEME://HOST:PORT (tcp:// or rdma://)"))?;
        let scheme = match scheme {
            "tcp" => Scheme::Tcp,
            "rdma" => Scheme::Rdma,
            _ => return Err(err("unknown scheme: expected tcp or rdma")),
        };
        let (authority, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| err("unclosed '[' in IPv6 address"))?;
            let port = after
                .strip_prefix(':')
                .ok_or_else(|| err("missing :PORT after the IPv6 address"))?;
            (host, port)
        } else {
            authority
                .rsplit_once(':')
                .ok_or_else(|| err("missing :PORT"))?
        };
        if host.is_empty() {
            return Err(err("empty host"));
        }
        if host.contains(['/', '?', '#', '@', ' '])
            || (!authority.starts_with('[') && host.contains(':'))
        {
            return Err(err(
                "invalid character in host (IPv6 addresses go in brackets)",
            ));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| err("port is not a number from 0 to 65535"))?;
        let mut options = Vec::new();
        if let Some(q) = query {
            for pair in q.split('&').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                if k.is_empty() {
                    return Err(err("empty option name"));
                }
                options.push((k.to_owned(), v.to_owned()));
            }
        }
        Ok(Endpoint {
            scheme,
            host: host.to_owned(),
            port,
            options,
        })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme.as_str(), self.authority())?;
        for (i, (k, v)) in self.options.iter().enumerate() {
            f.write_str(if i == 0 { "?" } else { "&" })?;
            if v.is_empty() {
                f.write_str(k)?;
            } else {
                write!(f, "{k}={v}")?;
            }
        }
        Ok(())
    }
}

impl Serialize for Endpoint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Endpoint {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Endpoint, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for s in [
            "tcp://127.0.0.1:0",
            "tcp://localhost:7000",
            "tcp://[::1]:9000",
            "rdma://10.99.0.1:7471",
            "rdma://10.99.0.1:7471?device=rxe0",
            "rdma://host:1?device=siw0&busy_poll=1&flag",
        ] {
            let ep: Endpoint = s.parse().unwrap();
            assert_eq!(ep.to_string(), s);
        }
        let ep: Endpoint = "tcp://[::1]:9000".parse().unwrap();
        assert_eq!(ep.host(), "::1");
        assert_eq!(ep.authority(), "[::1]:9000");
    }

    #[test]
    fn rejects() {
        for s in [
            "",
            "127.0.0.1:80",
            "udp://1.2.3.4:5",
            "tcp://1.2.3.4",
            "tcp://:80",
            "tcp://1.2.3.4:70000",
            "tcp://::1:80",
            "tcp://[::1:80",
            "tcp://a b:1",
            "tcp://h:1?=v",
        ] {
            let e = s.parse::<Endpoint>().unwrap_err();
            assert!(e.to_string().contains("invalid endpoint"), "{s}: {e}");
        }
    }

    #[test]
    fn serde_as_string() {
        #[derive(Deserialize, Serialize)]
        struct Conf {
            ep: Endpoint,
        }
        use crate::codec::{Bincode, Codec};
        let c = Conf {
            ep: "rdma://h:5?device=x".parse().unwrap(),
        };
        let mut out = Vec::new();
        Bincode::encode(&c, &mut out).unwrap();
        // On the wire it is the string, so any format's config file can carry it.
        let s: String = Bincode::decode(&out).unwrap();
        assert_eq!(s, "rdma://h:5?device=x");
        let back: Conf = Bincode::decode(&out).unwrap();
        assert_eq!(back.ep, c.ep);
        let mut bad = Vec::new();
        Bincode::encode("udp://h:5", &mut bad).unwrap();
        assert!(Bincode::decode::<Conf>(&bad).is_err());
    }

    #[test]
    fn options_replace() {
        let ep: Endpoint = "rdma://h:5?device=x".parse().unwrap();
        let ep = ep.with_option("device", "y").with_option("busy_poll", "1");
        assert_eq!(ep.to_string(), "rdma://h:5?device=y&busy_poll=1");
    }
}
