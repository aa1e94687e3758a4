//! Errors callers see.

use std::fmt;
use std::io;

use crate::codec::CodecError;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// No answer came before the call's deadline; the server was told to drop the work.
    #[error("deadline exceeded: no answer came before the call's deadline")]
    DeadlineExceeded,
    /// The transport cannot be used here (not built in, no device, nothing listening).
    #[error("transport unavailable: {0}")]
    Unavailable(String),
    /// The connection is gone (closed by the peer, reset, or the peer stopped answering
    /// keep-alives); calls in flight on it fail with this.
    #[error("connection closed")]
    ConnectionClosed,
    /// Arguments or results could not be encoded or decoded on this side.
    #[error("codec error: {0}")]
    Codec(#[from] CodecError),
    /// The server answered with an error (unknown method, bad request, handler panic, ...).
    #[error("server error: {0}")]
    Server(#[from] ServerError),
    /// A message is larger than the configured limit; nothing was sent.
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Size of the refused message.
        size: u64,
        /// The limit in force.
        limit: u64,
    },
    /// A message carries more payloads than the configured limit
    /// ([`Config::max_attachments`](crate::Config::max_attachments)); nothing was sent.
    #[error("message with {count} payloads exceeds the limit of {limit} payloads")]
    TooManyAttachments {
        /// Payloads in the refused message.
        count: usize,
        /// The limit in force.
        limit: u16,
    },
    /// The peer broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// An I/O error while connecting or binding.
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
}

/// What went wrong on the server, as carried back to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ServerErrorKind {
    /// The method id is not served here.
    UnknownMethod,
    /// The request could not be decoded as the method's arguments.
    BadRequest,
    /// The handler panicked.
    Panicked,
    /// The request's deadline passed before the handler finished.
    DeadlineExceeded,
    /// The server is shutting down and takes no new calls.
    ShuttingDown,
    /// The server is over its limits and refused the call.
    Overloaded,
    /// The request was larger than the server accepts.
    TooLarge,
    /// The result could not be encoded, or another server-side failure.
    Internal,
    /// The connection did not present the credentials the server requires.
    Unauthenticated,
}

impl ServerErrorKind {
    /// Wire status code (never 0, which means success).
    pub fn code(self) -> u32 {
        match self {
            ServerErrorKind::UnknownMethod => 1,
            ServerErrorKind::BadRequest => 2,
            ServerErrorKind::Panicked => 3,
            ServerErrorKind::DeadlineExceeded => 4,
            ServerErrorKind::ShuttingDown => 5,
            ServerErrorKind::Overloaded => 6,
            ServerErrorKind::TooLarge => 7,
            ServerErrorKind::Internal => 8,
            ServerErrorKind::Unauthenticated => 9,
        }
    }

    /// The kind for a wire status code; unknown codes map to `Internal`.
    pub fn from_code(code: u32) -> ServerErrorKind {
        match code {
            1 => ServerErrorKind::UnknownMethod,
            2 => ServerErrorKind::BadRequest,
            3 => ServerErrorKind::Panicked,
            4 => ServerErrorKind::DeadlineExceeded,
            5 => ServerErrorKind::ShuttingDown,
            6 => ServerErrorKind::Overloaded,
            7 => ServerErrorKind::TooLarge,
            9 => ServerErrorKind::Unauthenticated,
            _ => ServerErrorKind::Internal,
        }
    }
}

impl fmt::Display for ServerErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServerErrorKind::UnknownMethod => "unknown method",
            ServerErrorKind::BadRequest => "bad request",
            ServerErrorKind::Panicked => "handler panicked",
            ServerErrorKind::DeadlineExceeded => "deadline exceeded",
            ServerErrorKind::ShuttingDown => "shutting down",
            ServerErrorKind::Overloaded => "overloaded",
            ServerErrorKind::TooLarge => "request too large",
            ServerErrorKind::Internal => "internal error",
            ServerErrorKind::Unauthenticated => "not authenticated",
        })
    }
}

/// An error produced on the server and carried back to the caller with its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ServerError {
    /// What went wrong.
    pub kind: ServerErrorKind,
    /// Details in words.
    pub message: String,
}

impl ServerError {
    /// A server error of `kind` with `message`.
    pub fn new(kind: ServerErrorKind, message: impl Into<String>) -> ServerError {
        ServerError {
            kind,
            message: message.into(),
        }
    }

    /// The method id is not served.
    pub fn unknown_method(method: u32) -> ServerError {
        ServerError::new(
            ServerErrorKind::UnknownMethod,
            format!("no method with id {method:#010x} is served here"),
        )
    }
}

impl RpcError {
    /// The server-side error kind, if the server answered with one.
    pub fn server_kind(&self) -> Option<ServerErrorKind> {
        match self {
            RpcError::Server(e) => Some(e.kind),
            _ => None,
        }
    }
}
