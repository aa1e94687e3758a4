//! `frame_decoder`: arbitrary bytes, cut into arbitrary chunks, fed to [`FrameCodec::decode`].
//!
//! Input layout: 4 config bytes, then the byte stream.
//! - `[0]`: `max_message_size`: `1 << (b % 21)` (1 B .. 1 MiB), or `b & 0xf` when `b >= 0xf0`;
//! - `[1]`: `max_attachments`: `b % 17`, or 1024 (the default) when `b >= 0xf0`;
//! - `[2]`: seed of the chunk-size generator; `[3]`: largest chunk - 1 (`0xff`: whole stream).
//!
//! Checks: no panic; every error carries a [`FrameError`]; the read buffer's capacity and the
//! bytes allocated stay within a bound of the limit and the input (never the claimed length);
//! every decoded message is within the limits and re-encodes to exactly the bytes it was
//! decoded from; the chunked decode gives the same messages and error as decoding the whole
//! stream at once.

use bytes::BytesMut;
use rpc_core::wire::{FrameCodec, FrameError, Limits, Message, HEADER_LEN};
use tokio_util::codec::Decoder;

use crate::alloc::peak_during;

/// The limits the config bytes select.
pub fn limits(b0: u8, b1: u8) -> Limits {
    let max_message_size = if b0 >= 0xf0 {
        (b0 & 0xf) as u64
    } else {
        1u64 << (b0 % 21)
    };
    let max_attachments = if b1 >= 0xf0 { 1024 } else { (b1 % 17) as u16 };
    Limits {
        max_message_size,
        max_attachments,
    }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Message(Message),
    Error(FrameError),
}

/// Decodes `stream` fed in chunks of `chunk(i)` bytes; returns what came out and the bytes
/// left over.
fn decode_all(
    limits: Limits,
    stream: &[u8],
    mut chunk: impl FnMut() -> usize,
) -> (Vec<Outcome>, usize) {
    let mut codec = FrameCodec::new(limits);
    let mut src = BytesMut::new();
    let mut fed = 0;
    let mut frame_start = 0;
    let mut out = Vec::new();
    // A frame never needs more than its header and `limit` bytes of buffer beyond what was fed;
    // `BytesMut` may double, and keeps a small original-capacity hint.
    let cap_bound = |len: usize| 2 * (len + HEADER_LEN + limits.max_message_size as usize) + 4096;
    while fed < stream.len() {
        let n = chunk().clamp(1, stream.len() - fed);
        src.extend_from_slice(&stream[fed..fed + n]);
        fed += n;
        loop {
            let r = codec.decode(&mut src);
            assert!(
                src.capacity() <= cap_bound(src.len()),
                "read buffer capacity {} for {} buffered bytes, limit {}",
                src.capacity(),
                src.len(),
                limits.max_message_size
            );
            match r {
                Ok(Some(m)) => {
                    let end = fed - src.len();
                    check_message(&limits, &m, &stream[frame_start..end]);
                    frame_start = end;
                    out.push(Outcome::Message(m));
                }
                Ok(None) => break,
                Err(e) => {
                    let fe = FrameError::from_io(&e)
                        .unwrap_or_else(|| panic!("decoder error without a FrameError: {e:?}"))
                        .clone();
                    out.push(Outcome::Error(fe));
                    return (out, stream.len() - frame_start);
                }
            }
        }
    }
    (out, stream.len() - frame_start)
}

fn check_message(limits: &Limits, m: &Message, raw: &[u8]) {
    assert_eq!(m.header.flags, 0, "decoded a frame with reserved flags");
    assert!(m.attachments.len() <= limits.max_attachments as usize);
    assert!(m.payload_len() <= limits.max_message_size);
    assert_eq!(
        m.wire_len(),
        raw.len() as u64,
        "wire_len differs from the bytes consumed"
    );
    let mut again = BytesMut::new();
    m.encode_into(&mut again);
    assert_eq!(
        &again[..],
        raw,
        "decoded message does not re-encode to its bytes"
    );
}

/// The target.
pub fn run(data: &[u8]) {
    if data.len() < 4 {
        return;
    }
    let (cfg, stream) = data.split_at(4);
    let limits = limits(cfg[0], cfg[1]);
    let mut rng = cfg[2] as u32 | 0x100;
    let max_chunk = if cfg[3] == 0xff {
        usize::MAX
    } else {
        cfg[3] as usize + 1
    };
    let chunks = move || {
        if max_chunk == usize::MAX {
            return usize::MAX;
        }
        // xorshift32
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        1 + (rng as usize % max_chunk)
    };
    let ((chunked, left), peak) = peak_during(|| decode_all(limits, stream, chunks));
    let bound = 8 * stream.len() + 4 * (HEADER_LEN + limits.max_message_size as usize) + (64 << 10);
    assert!(
        peak <= bound,
        "decoding {} bytes (limit {}) allocated {peak} bytes at once",
        stream.len(),
        limits.max_message_size
    );
    if max_chunk != usize::MAX {
        let (whole, left_whole) = decode_all(limits, stream, || usize::MAX);
        assert_eq!(chunked, whole, "chunking changed what was decoded");
        assert_eq!(left, left_whole);
    }
}
