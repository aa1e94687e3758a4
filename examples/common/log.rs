//! The log set-up of the figure-taking examples (`rpc-perf`, `lossy-link`).

/// Sends the library's warnings (why a connection closed, ...) to stderr; `RUST_LOG` overrides
/// the level. Does nothing if a subscriber is already installed.
pub(crate) fn warnings_to_stderr() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}
