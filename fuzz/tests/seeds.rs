//! Without libFuzzer: the seed corpus is current and passes every target, and every saved
//! regression input passes its target (a crash found by fuzzing stays a test).
//!
//! `FUZZ_WRITE_SEEDS=1 cargo test --test seeds` rewrites `corpus/<target>/` from
//! `rdma_rpc_fuzz::seeds`.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use rdma_rpc_fuzz::{seeds, TARGETS};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn target(name: &str) -> rdma_rpc_fuzz::Target {
    TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .expect("a target")
        .1
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.is_file() && !p.file_name().unwrap().to_string_lossy().starts_with('.'));
    v.sort();
    v
}

#[test]
fn seed_corpus_is_current_and_passes() {
    let write = std::env::var_os("FUZZ_WRITE_SEEDS").is_some();
    for (t, name, bytes) in seeds::all() {
        target(t)(&bytes);
        let path = root().join("corpus").join(t).join(&name);
        if write {
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(&path, &bytes).unwrap();
        } else {
            let on_disk = fs::read(&path).unwrap_or_default();
            assert!(
                on_disk == bytes,
                "{} is not current: FUZZ_WRITE_SEEDS=1 cargo test --test seeds",
                path.display()
            );
        }
    }
}

#[test]
fn corpus_and_regressions_replay() {
    for (t, run) in TARGETS {
        for dir in ["corpus", "regressions"] {
            for f in files(&root().join(dir).join(t)) {
                // Not captured by the test harness: still shown if the input aborts.
                let _ = writeln!(std::io::stderr(), "replaying {}", f.display());
                run(&fs::read(&f).unwrap());
            }
        }
    }
}
