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

pub mod direct;
mod guard;

pub use guard::MAX_DEPTH;

/// A bincode reader over a slice that reports how much is left through `left`.
struct CountingReader<'a> {
    rest: &'a [u8],
    left: &'a std::cell::Cell<usize>,
}

impl bincode::de::read::Reader for CountingReader<'_> {
    fn read(&mut self, bytes: &mut [u8]) -> Result<(), bincode::error::DecodeError> {
        if bytes.len() > self.rest.len() {
            return Err(bincode::error::DecodeError::UnexpectedEnd {
                additional: bytes.len() - self.rest.len(),
            });
        }
        let (head, tail) = self.rest.split_at(bytes.len());
        bytes.copy_from_slice(head);
        self.rest = tail;
        self.left.set(tail.len());
        Ok(())
    }
}

/// Decodes through the [`guard`] adapter with a bincode claim limit of `LIMIT` bytes.
fn decode_limited<T: DeserializeOwned, const LIMIT: usize>(bytes: &[u8]) -> Result<T, CodecError> {
    let config = bincode::config::standard().with_limit::<LIMIT>();
    let left = std::cell::Cell::new(bytes.len());
    let reader = CountingReader {
        rest: bytes,
        left: &left,
    };
    let mut decoder = bincode::serde::OwnedSerdeDecoder::from_reader(reader, config);
    let depth = std::cell::Cell::new(0);
    let value = T::deserialize(guard::Guard {
        inner: decoder.as_deserializer(),
        depth: &depth,
    })
    .map_err(|e| CodecError(e.to_string()))?;
    let left = left.get();
    if left != 0 {
        return Err(CodecError(format!("{left} trailing bytes after the value")));
    }
    Ok(value)
}

impl Codec for Bincode {
    fn encode<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        bincode::serde::encode_into_std_write(value, out, bincode::config::standard())
            .map(|_| ())
            .map_err(|e| CodecError(e.to_string()))
    }

    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        // bincode's claim limit in size classes: at least twice the input, so strings and byte
        // buffers cannot claim more than the input could hold.
        match bytes.len().saturating_mul(2) {
            n if n <= 1 << 12 => decode_limited::<T, { 1 << 12 }>(bytes),
            n if n <= 1 << 16 => decode_limited::<T, { 1 << 16 }>(bytes),
            n if n <= 1 << 20 => decode_limited::<T, { 1 << 20 }>(bytes),
            n if n <= 1 << 24 => decode_limited::<T, { 1 << 24 }>(bytes),
            n if n <= 1 << 28 => decode_limited::<T, { 1 << 28 }>(bytes),
            _ => decode_limited::<T, { 1 << 31 }>(bytes),
        }
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
