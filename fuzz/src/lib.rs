//! Fuzz targets for rpc-core, as plain functions so that the libFuzzer binaries
//! (`fuzz_targets/*.rs`), the regression replay and the seed-corpus test share them.
//!
//! Each `run(data)` must never panic on any input; a panic or abort is a finding.

pub mod alloc;
pub mod codec;
pub mod direct;
pub mod frame;
pub mod reader;
pub mod rendezvous;
pub mod seeds;
pub mod stack;

/// A target: runs one input.
pub type Target = fn(&[u8]);

/// The targets by name, as used for `corpus/<name>` and `regressions/<name>`.
pub const TARGETS: &[(&str, Target)] = &[
    ("frame_decoder", frame::run),
    ("codec_messages", codec::run),
    ("direct_bodies", direct::run),
    ("rendezvous", rendezvous::run),
];
