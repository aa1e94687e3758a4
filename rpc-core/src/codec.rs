//! Codecs turn arguments and results into message bodies. [`Bincode`] is the default; any
//! other serde format can replace it by implementing [`Codec`] and naming it in
//! `#[rdma_service(codec = MyCodec)]`.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// An error from a codec, with the format's own message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CodecError(pub String);

/// A serde format for message bodies.
///
/// Implementations must decode exactly what they encoded and must not reserve memory beyond a
/// small multiple of the input length while decoding: the input comes from the network.
pub trait Codec: Send + Sync + 'static {
    /// Appends the encoding of `value` to `out`.
    fn encode<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError>;
    /// Decodes a `T` that must use all of `bytes`.
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError>;
}

/// bincode 2 (serde mode, standard config: little endian, varints).
///
/// Decoding is bounded: the decoder may claim at most the next power of two above twice the
/// input length (at least 4 KiB), so a forged length prefix cannot make it reserve gigabytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Bincode;

macro_rules! decode_with_limit {
    ($bytes:expr, $($limit:expr),*) => {{
        let n = $bytes.len().saturating_mul(2);
        $(
            if n <= $limit {
                let cfg = bincode::config::standard().with_limit::<{ $limit }>();
                return finish(bincode::serde::decode_from_slice($bytes, cfg), $bytes.len());
            }
        )*
        let cfg = bincode::config::standard().with_limit::<{ 1usize << 40 }>();
        finish(bincode::serde::decode_from_slice($bytes, cfg), $bytes.len())
    }};
}

fn finish<T>(
    r: Result<(T, usize), bincode::error::DecodeError>,
    len: usize,
) -> Result<T, CodecError> {
    match r {
        Ok((v, used)) if used == len => Ok(v),
        Ok((_, used)) => Err(CodecError(format!(
            "{} trailing bytes after the value",
            len - used
        ))),
        Err(e) => Err(CodecError(e.to_string())),
    }
}

impl Codec for Bincode {
    fn encode<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        bincode::serde::encode_into_std_write(value, out, bincode::config::standard())
            .map(|_| ())
            .map_err(|e| CodecError(e.to_string()))
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        decode_with_limit!(bytes, 1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_trailing_bytes() {
        let mut out = Vec::new();
        Bincode::encode(&("key".to_string(), 42u64), &mut out).unwrap();
        let v: (String, u64) = Bincode::decode(&out).unwrap();
        assert_eq!(v, ("key".to_string(), 42));
        out.push(0);
        let e = Bincode::decode::<(String, u64)>(&out).unwrap_err();
        assert!(e.0.contains("trailing"), "{e}");
    }

    #[test]
    fn forged_length_prefix_is_refused_without_reserving_it() {
        // A Vec<u8> claiming 2^40 elements, in 10 bytes: must fail, not allocate a terabyte.
        let mut out = Vec::new();
        Bincode::encode(&(1u64 << 40), &mut out).unwrap();
        let e = Bincode::decode::<Vec<u8>>(&out).unwrap_err();
        assert!(!e.0.is_empty());
        let e = Bincode::decode::<String>(&out).unwrap_err();
        assert!(!e.0.is_empty());
    }
}
