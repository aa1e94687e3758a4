//! Decoding untrusted bytes is bounded in memory and stack, whatever the input claims.
//! (Found by the fuzzer: fuzz/regressions/codec_messages/.) A counting allocator measures the
//! peak of live bytes during one decode; this file has only these tests, so nothing else
//! allocates meanwhile except the test harness's own threads, which stay idle.

use peak_alloc::PeakAlloc;
use rpc_core::codec::{Bincode, Codec, MAX_DEPTH};
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = ALLOC.current_usage();
    ALLOC.reset_peak_usage();
    let r = f();
    (r, ALLOC.peak_usage().saturating_sub(base))
}

/// bincode varint for a length: 253 then a u64.
fn claim(len: u64, out: &mut Vec<u8>) {
    out.push(253);
    out.extend_from_slice(&len.to_le_bytes());
}

#[test]
fn nested_length_claims_reserve_nothing_they_do_not_fill() {
    // Four nested sequences each claiming 2^40 elements, in 36 bytes.
    let mut input = Vec::new();
    for _ in 0..4 {
        claim(1 << 40, &mut input);
    }
    let (r, peak) = peak_during(|| Bincode::decode::<Vec<Vec<Vec<Vec<u64>>>>>(&input));
    assert!(r.is_err());
    assert!(
        peak < 64 * 1024,
        "a 36-byte input made the decoder hold {peak} bytes"
    );
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
enum Tree {
    Leaf,
    Node(Box<Tree>),
}

#[test]
fn deep_nesting_is_an_error_not_a_stack_overflow() {
    // Node(Node(...Leaf)) 100,000 deep: variant index 1 repeated, then 0.
    let mut input = vec![1u8; 100_000];
    input.push(0);
    // A tokio worker's stack size: the decode must fail cleanly there.
    let r = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || Bincode::decode::<Tree>(&input).map(|_| ()))
        .unwrap()
        .join()
        .expect("no stack overflow");
    let e = r.unwrap_err();
    assert!(e.0.contains("deeper"), "{e}");
}

#[test]
fn legitimate_values_still_decode() {
    let mut t = Tree::Leaf;
    for _ in 0..MAX_DEPTH - 2 {
        t = Tree::Node(Box::new(t));
    }
    let v = (vec![vec![1u64, 2, 3]; 1000], t, Some("x".to_string()));
    let mut out = Vec::new();
    Bincode::encode(&v, &mut out).unwrap();
    let back: (Vec<Vec<u64>>, Tree, Option<String>) = Bincode::decode(&out).unwrap();
    assert_eq!(back, v);
    let big = vec![7u32; 1 << 20];
    let mut out = Vec::new();
    Bincode::encode(&big, &mut out).unwrap();
    assert_eq!(Bincode::decode::<Vec<u32>>(&out).unwrap(), big);
}
