//! `cargo bench` at the workspace root.
//!
//! The benchmarks and the peers they compare with (tarpc, ruapc, a raw TCP floor) live in the
//! `rdma-rpc-benches` package (`benches/`), so that the root package's tests never build the
//! peers. This target, the root package's only bench, runs that package's bench: the
//! criterion curves, then the ratio table of `compare` with each target's verdict. Arguments
//! after `--` (a criterion filter, say) are passed on.

use std::process::{exit, Command};

fn main() {
    // cargo gives bench executables `--bench`; the inner `cargo bench` adds its own
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut inner = Command::new(cargo);
    // What cargo set for running this target (the package's name, version, directory) is not
    // the inner build's: build scripts that watch these variables would rebuild every time.
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let ours = key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || key.starts_with("CARGO_BIN_")
            || matches!(
                &*key,
                "CARGO_CRATE_NAME" | "CARGO_PRIMARY_PACKAGE" | "CARGO_TARGET_TMPDIR" | "OUT_DIR"
            );
        if ours {
            inner.env_remove(&*key);
        }
    }
    let status = inner
        .args(["bench", "-p", "rdma-rpc-benches", "--bench", "rpc", "--"])
        .args(&args)
        .status()
        .unwrap_or_else(|e| {
            eprintln!("cargo bench -p rdma-rpc-benches: {e}");
            exit(1)
        });
    exit(status.code().unwrap_or(1));
}
