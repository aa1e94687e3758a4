//! The direct path holds to [`Bincode`]'s format: the same bodies and attachments for every
//! value, and the same answer (the same value, or an error) for every input.

use super::*;
use proptest::prelude::*;

/// A body and its attachments' bytes, to compare.
type Encoded = (Vec<u8>, Vec<Vec<u8>>);

fn parts((body, attachments): (Bytes, Attachments)) -> Encoded {
    (
        body.to_vec(),
        attachments.iter().map(|p| p.to_vec()).collect(),
    )
}

fn via_serde<T: Serialize>(v: &T) -> Encoded {
    parts(<Serde<Bincode> as EncodeBody<T>>::encode(v).expect("serde encodes"))
}

fn via_direct<T: Direct>(v: &T) -> Encoded {
    parts(<DirectBincode as EncodeBody<T>>::encode(v).expect("direct encodes"))
}

/// Both paths encode `v` alike, and each decodes what it encoded to a value that encodes alike
/// again.
fn same_encoding<T: Direct + Serialize + DeserializeOwned>(v: &T) {
    let direct = via_direct(v);
    assert_eq!(direct, via_serde(v), "bodies differ");
    let attachments: Attachments = direct.1.iter().map(|b| Payload::from(b.clone())).collect();
    let back: T = <DirectBincode as DecodeBody<T>>::decode(&direct.0, attachments.clone())
        .expect("direct decodes its own body");
    assert_eq!(via_serde(&back), direct, "direct decode differs");
    let back: T = <Serde<Bincode> as DecodeBody<T>>::decode(&direct.0, attachments)
        .expect("serde decodes the direct body");
    assert_eq!(via_direct(&back), direct, "serde decode differs");
}

/// Both paths decode `body` (with `n` attachments) alike: the same value, or both an error.
fn same_decoding<T: Direct + Serialize + DeserializeOwned>(body: &[u8], n: usize) {
    let attachments: Attachments = (0..n).map(|i| Payload::from(vec![i as u8; i])).collect();
    let direct = <DirectBincode as DecodeBody<T>>::decode(body, attachments.clone());
    let serde = <Serde<Bincode> as DecodeBody<T>>::decode(body, attachments);
    match (direct, serde) {
        (Ok(d), Ok(s)) => assert_eq!(via_serde(&d), via_serde(&s), "values differ for {body:?}"),
        (Err(_), Err(_)) => {}
        (d, s) => panic!(
            "{body:?} with {n} attachments: direct {:?}, serde {:?}",
            d.map(|v| via_serde(&v)),
            s.map(|v| via_serde(&v))
        ),
    }
}

fn payload() -> impl Strategy<Value = Payload> {
    proptest::collection::vec(any::<u8>(), 0..40).prop_map(Payload::from)
}

/// Integers near bincode's tag boundaries (250, 251, 2^16, 2^32) and anywhere.
fn near_tags() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..300,
        (1u64 << 16) - 3..(1u64 << 16) + 3,
        (1u64 << 32) - 3..(1u64 << 32) + 3,
        any::<u64>(),
    ]
}

proptest! {
    #[test]
    fn integers_encode_as_bincode(v in near_tags(), s in any::<i64>()) {
        same_encoding(&v);
        same_encoding(&(v as u32));
        same_encoding(&(v as u16));
        same_encoding(&(v as u8));
        same_encoding(&(v as usize));
        same_encoding(&s);
        same_encoding(&(s as i32));
        same_encoding(&(s as i16));
        same_encoding(&(s as i8));
        same_encoding(&(s as isize));
        same_encoding(&(-(v as i64)));
    }

    #[test]
    fn payloads_strings_options_and_tuples_encode_as_bincode(
        a in payload(),
        b in payload(),
        key in ".{0,300}",
        n in near_tags(),
        flag in any::<bool>(),
        some in any::<bool>(),
    ) {
        same_encoding(&a);
        same_encoding(&(a.clone(),));
        same_encoding(&key);
        same_encoding(&(key.clone(), a.clone()));
        same_encoding(&(n, a.clone(), flag, b.clone(), key.clone()));
        same_encoding(&some.then(|| a.clone()));
        same_encoding(&some.then(|| key.clone()));
        same_encoding(&some.then_some(n));
        same_encoding(&((), flag));
        // the same payload twice: two attachments, as serde lifts them
        same_encoding(&(a.clone(), a));
    }

    #[test]
    fn any_input_decodes_as_bincode_decodes_it(
        body in proptest::collection::vec(any::<u8>(), 0..24),
        n in 0usize..3,
    ) {
        same_decoding::<u8>(&body, n);
        same_decoding::<u16>(&body, n);
        same_decoding::<u32>(&body, n);
        same_decoding::<u64>(&body, n);
        same_decoding::<usize>(&body, n);
        same_decoding::<i8>(&body, n);
        same_decoding::<i16>(&body, n);
        same_decoding::<i32>(&body, n);
        same_decoding::<i64>(&body, n);
        same_decoding::<bool>(&body, n);
        same_decoding::<()>(&body, n);
        same_decoding::<String>(&body, n);
        same_decoding::<Payload>(&body, n);
        same_decoding::<(Payload,)>(&body, n);
        same_decoding::<Option<Payload>>(&body, n);
        same_decoding::<Option<String>>(&body, n);
        same_decoding::<(String, Payload)>(&body, n);
        same_decoding::<(u64, u32, bool)>(&body, n);
        same_decoding::<(u16, Option<u64>, i32)>(&body, n);
    }

    #[test]
    fn tag_bytes_followed_by_anything_decode_as_bincode(
        tag in 248u8..=255,
        rest in proptest::collection::vec(any::<u8>(), 0..10),
    ) {
        let mut body = vec![tag];
        body.extend(rest);
        same_decoding::<u16>(&body, 1);
        same_decoding::<u32>(&body, 1);
        same_decoding::<u64>(&body, 1);
        same_decoding::<i64>(&body, 1);
        same_decoding::<String>(&body, 1);
        same_decoding::<Payload>(&body, 1);
    }
}

#[test]
fn wrong_input_says_what_is_wrong() {
    let none = Attachments::new();
    let e = <DirectBincode as DecodeBody<(u64,)>>::decode(&[7, 0], none.clone()).unwrap_err();
    assert!(e.0.contains("1 trailing bytes"), "{e}");
    let e = <DirectBincode as DecodeBody<u32>>::decode(&[253, 0], none.clone()).unwrap_err();
    assert!(e.0.contains("tag 253"), "{e}");
    let e = <DirectBincode as DecodeBody<u32>>::decode(&[252, 1], none.clone()).unwrap_err();
    assert!(e.0.contains("end of the body"), "{e}");
    let e = <DirectBincode as DecodeBody<Payload>>::decode(&[2], none.clone()).unwrap_err();
    assert!(e.0.contains("attachment 2, but the frame has 0"), "{e}");
    let e = <DirectBincode as DecodeBody<String>>::decode(&[2, 0xff, 0xfe], none).unwrap_err();
    assert!(e.0.contains("UTF-8"), "{e}");
}

/// A codec other than bincode: its bodies never take the direct path.
struct Other;

impl Codec for Other {
    fn encode<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        Bincode::encode(value, out)
    }
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        Bincode::decode(bytes)
    }
}

#[test]
#[allow(clippy::needless_borrow)] // (the two borrows are how the probe picks)
fn the_probe_picks_direct_only_for_direct_types_under_bincode() {
    // (the types are the assertion: each line compiles only with the path named)
    let _: DirectBincode = (&&Probe::<Bincode, (u64, Payload)>::new()).body();
    let _: DirectBincode = (&&Probe::<Bincode, Option<String>>::new()).body();
    let _: Serde<Bincode> = (&&Probe::<Bincode, (u64, Vec<u8>)>::new()).body();
    let _: Serde<Bincode> = (&&Probe::<Bincode, Result<u64, String>>::new()).body();
    let _: Serde<Bincode> = (&&Probe::<Bincode, str>::new()).body();
    let _: Serde<Other> = (&&Probe::<Other, u64>::new()).body();
}
