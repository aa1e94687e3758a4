//! Tunables shared by client, server and transports.

use std::time::Duration;

use crate::wire::Limits;
use crate::Endpoint;

/// Limits and timings of a connection. Every limit is enforced before memory is reserved.
///
/// Endpoint options override the defaults by name (`tcp://h:p?max_in_flight=64`), see
/// [`Config::from_endpoint`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// Messages up to this many bytes (header included) go inline in one eager message;
    /// larger ones send their payloads on the bulk path (TCP: streamed after the header
    /// without a copy; RDMA: rendezvous). Default 8 KiB.
    pub eager_threshold: usize,
    /// Largest message accepted or sent (bytes after the header). Default 1 GiB.
    pub max_message_size: u64,
    /// Most payloads attached to one message. Default 1024.
    pub max_attachments: u16,
    /// Client: calls in flight on one connection; further calls wait for a slot. Default 1024.
    pub max_in_flight: usize,
    /// Server: handlers running at once across all connections; further requests wait
    /// (their connection stops being read). Default 4096.
    pub max_concurrent_handlers: usize,
    /// Server: connections open at once. One more is answered with an `Overloaded` error and
    /// closed, before anything is read from it or reserved for it (on RDMA, the connection's
    /// registered pools are set up and freed at once). Default 10,000.
    pub max_connections: usize,
    /// A connection with no traffic for this long is probed with a ping. Default 5 s.
    pub keepalive_interval: Duration,
    /// A peer silent for this long is declared dead; its calls fail. Default 15 s.
    pub keepalive_timeout: Duration,
    /// Client: time allowed to establish a connection (and the server's time limit for a new
    /// connection's greeting). Default 10 s.
    pub connect_timeout: Duration,
    /// A shared secret. A server with one drops every connection whose greeting does not carry
    /// it, before any handler runs; a client with one presents it. Default none. Not read from
    /// endpoint options, since endpoints are logged.
    pub auth_token: Option<Secret>,
    /// Client: after the connection is lost, the next call connects again. Default on.
    pub reconnect: bool,
    /// Client: while reconnecting, calls wait for the connection (bounded by their deadline,
    /// or by `connect_timeout` when they have none) rather than failing at once with
    /// `Unavailable`. Default on.
    pub wait_for_reconnect: bool,
    /// Client: first pause between failed connection attempts; it doubles up to
    /// `reconnect_backoff_max`. Default 50 ms.
    pub reconnect_backoff: Duration,
    /// Client: longest pause between connection attempts. Default 2 s.
    pub reconnect_backoff_max: Duration,
}

/// A secret that `Debug` does not print and that compares in constant time.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// Wraps secret bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Secret {
        Secret(bytes.into())
    }

    /// The secret bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    /// Whether `candidate` equals the secret, in time independent of where they differ.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        if candidate.len() != self.0.len() {
            return false;
        }
        candidate
            .iter()
            .zip(&self.0)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            eager_threshold: 8 * 1024,
            max_message_size: 1 << 30,
            max_attachments: 1024,
            max_in_flight: 1024,
            max_concurrent_handlers: 4096,
            max_connections: 10_000,
            keepalive_interval: Duration::from_secs(5),
            keepalive_timeout: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(10),
            auth_token: None,
            reconnect: true,
            wait_for_reconnect: true,
            reconnect_backoff: Duration::from_millis(50),
            reconnect_backoff_max: Duration::from_secs(2),
        }
    }
}

/// An endpoint option that is not a valid value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("endpoint option {key}={value:?}: {reason}")]
pub struct ConfigError {
    key: String,
    value: String,
    reason: &'static str,
}

impl Config {
    /// The defaults with the endpoint's options applied: `eager_threshold`, `max_message_size`,
    /// `max_in_flight`, `max_concurrent_handlers`, `max_connections` (numbers), `keepalive_ms`,
    /// `keepalive_timeout_ms`, `connect_timeout_ms`, `reconnect_backoff_ms`,
    /// `reconnect_backoff_max_ms` (milliseconds), `reconnect` (`0` or `1`) and `when_down`
    /// (`wait` or `fail`). Other options belong to the transport and are ignored here.
    pub fn from_endpoint(ep: &Endpoint) -> Result<Config, ConfigError> {
        Config::default().with_endpoint_options(ep)
    }

    /// This config with the endpoint's options applied (see [`Config::from_endpoint`]).
    pub fn with_endpoint_options(mut self, ep: &Endpoint) -> Result<Config, ConfigError> {
        for (k, v) in ep.options() {
            let num = || -> Result<u64, ConfigError> {
                v.parse::<u64>().map_err(|_| ConfigError {
                    key: k.to_owned(),
                    value: v.to_owned(),
                    reason: "expected a whole number",
                })
            };
            let positive = || -> Result<u64, ConfigError> {
                match num()? {
                    0 => Err(ConfigError {
                        key: k.to_owned(),
                        value: v.to_owned(),
                        reason: "must be at least 1",
                    }),
                    n => Ok(n),
                }
            };
            match k {
                "eager_threshold" => self.eager_threshold = positive()? as usize,
                "max_message_size" => self.max_message_size = positive()?,
                "max_in_flight" => self.max_in_flight = positive()? as usize,
                "max_concurrent_handlers" => self.max_concurrent_handlers = positive()? as usize,
                "max_connections" => self.max_connections = positive()? as usize,
                "keepalive_ms" => self.keepalive_interval = Duration::from_millis(positive()?),
                "keepalive_timeout_ms" => {
                    self.keepalive_timeout = Duration::from_millis(positive()?)
                }
                "connect_timeout_ms" => self.connect_timeout = Duration::from_millis(positive()?),
                "reconnect_backoff_ms" => {
                    self.reconnect_backoff = Duration::from_millis(positive()?)
                }
                "reconnect_backoff_max_ms" => {
                    self.reconnect_backoff_max = Duration::from_millis(positive()?)
                }
                "reconnect" => {
                    self.reconnect = match v {
                        "1" | "true" => true,
                        "0" | "false" => false,
                        _ => {
                            return Err(ConfigError {
                                key: k.to_owned(),
                                value: v.to_owned(),
                                reason: "expected 0 or 1",
                            })
                        }
                    }
                }
                "when_down" => {
                    self.wait_for_reconnect = match v {
                        "wait" => true,
                        "fail" => false,
                        _ => {
                            return Err(ConfigError {
                                key: k.to_owned(),
                                value: v.to_owned(),
                                reason: "expected wait or fail",
                            })
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(self)
    }

    /// The frame limits decoders enforce.
    pub fn limits(&self) -> Limits {
        Limits {
            max_message_size: self.max_message_size,
            max_attachments: self.max_attachments,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_override_defaults() {
        let ep: Endpoint = "tcp://h:1?max_in_flight=7&keepalive_ms=20&device=x"
            .parse()
            .unwrap();
        let c = Config::from_endpoint(&ep).unwrap();
        assert_eq!(c.max_in_flight, 7);
        assert_eq!(c.keepalive_interval, Duration::from_millis(20));
        assert_eq!(c.eager_threshold, Config::default().eager_threshold);
        let bad: Endpoint = "tcp://h:1?max_in_flight=0".parse().unwrap();
        assert!(Config::from_endpoint(&bad).is_err());
        let bad: Endpoint = "tcp://h:1?eager_threshold=lots".parse().unwrap();
        let e = Config::from_endpoint(&bad).unwrap_err();
        assert!(e.to_string().contains("eager_threshold"), "{e}");
    }

    #[test]
    fn secrets_compare_and_hide() {
        let s = Secret::new("hunter2");
        assert!(s.matches(b"hunter2"));
        assert!(!s.matches(b"hunter3"));
        assert!(!s.matches(b"hunter"));
        let c = Config {
            auth_token: Some(s),
            ..Config::default()
        };
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
