//! Errors of the RDMA transport.

/// An error of the RDMA transport. "No RDMA here" is [`RdmaError::Unavailable`], never a panic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// RDMA cannot be used here: rdma-core is not installed, there is no RDMA device, or no
    /// device serves the requested address.
    #[error("RDMA unavailable: {0}")]
    Unavailable(String),
    /// A verbs or rdma_cm call failed.
    #[error("{op} failed: {source}")]
    Verbs {
        /// the failing call
        op: &'static str,
        /// why
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Connection setup failed (address or route resolution, rejection, timeout).
    #[error("RDMA connection setup failed: {0}")]
    Connect(String),
    /// A work request completed with an error.
    #[error("RDMA {op} completed with an error: {status}")]
    Completion {
        /// SEND, RECV, RDMA WRITE or RDMA READ
        op: &'static str,
        /// the completion status, decoded
        status: String,
    },
    /// The connection is closed (by either side) or broken.
    #[error("RDMA connection closed{}", .0.as_deref().map(|r| format!(": {r}")).unwrap_or_default())]
    Closed(Option<String>),
    /// A buffer is still in use by a posted operation or exposed to the peer.
    #[error("RDMA buffer busy: posted to the device or exposed to the peer")]
    BufferBusy,
    /// Bad argument (range outside a buffer, message too large, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An operation did not complete in time.
    #[error("RDMA operation timed out: {0}")]
    Timeout(String),
}

impl RdmaError {
    /// Whether this error means "RDMA is not usable on this machine" (fall back to TCP).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, RdmaError::Unavailable(_))
    }
}
