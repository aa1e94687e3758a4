//! `direct_bodies`: the direct body path (`rpc_core::codec::direct`), which reads request and
//! answer bodies of plain types without serde, against serde's path with [`Bincode`], on
//! arbitrary input.
//!
//! Layout: a type byte (`% TYPES`), `n` (`% 4`) attachments (a length byte and that many
//! bytes), then the body. For the type picked, [`Request::decode_via`] through the direct path
//! and through serde's must agree: both refuse the body, or both decode values that encode
//! (through either path) to the same body and attachments. Never panics.

use std::fmt::Debug;

use bytes::Bytes;
use rpc_core::codec::direct::{Direct, DirectBincode, EncodeBody, Serde};
use rpc_core::codec::Bincode;
use rpc_core::{Payload, Request};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::reader::Reader;

/// How many types the type byte picks from.
pub const TYPES: u8 = 13;

/// A body and its attachments' bytes, to compare.
type Encoded = (Vec<u8>, Vec<Vec<u8>>);

fn encoded<E: EncodeBody<T>, T>(value: &T) -> Encoded {
    let (body, atts) = E::encode(value).expect("a decoded value encodes");
    (body.to_vec(), atts.iter().map(|p| p.to_vec()).collect())
}

fn check<T>(body: &[u8], atts: &[Payload])
where
    T: Direct + Serialize + DeserializeOwned + Debug,
{
    let request = || Request::new(Bytes::copy_from_slice(body), atts.to_vec());
    let direct = request().decode_via::<_, T>(DirectBincode, "fuzz");
    let serde = request().decode_via::<_, T>(Serde::<Bincode>::new(), "fuzz");
    match (direct, serde) {
        (Ok(d), Ok(s)) => {
            let from_direct = encoded::<DirectBincode, T>(&d);
            assert_eq!(
                from_direct,
                encoded::<Serde<Bincode>, T>(&s),
                "{}: the two paths decoded {body:?} to different values ({d:?}, {s:?})",
                std::any::type_name::<T>()
            );
            assert_eq!(
                from_direct,
                encoded::<Serde<Bincode>, T>(&d),
                "{}: the two paths encode {d:?} differently",
                std::any::type_name::<T>()
            );
        }
        (Err(_), Err(_)) => {}
        (d, s) => panic!(
            "{}: {body:?} with {} attachments: direct {d:?}, serde {s:?}",
            std::any::type_name::<T>(),
            atts.len()
        ),
    }
}

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let mut r = Reader::new(data);
    let sel = r.u8();
    let n = r.u8() % 4;
    let atts = crate::codec::read_attachments(&mut r, n);
    let body = r.rest();
    match sel % TYPES {
        0 => check::<u8>(body, &atts),
        1 => check::<u16>(body, &atts),
        2 => check::<u32>(body, &atts),
        3 => check::<u64>(body, &atts),
        4 => check::<(i8, i16, i32, i64, isize)>(body, &atts),
        5 => check::<(bool, usize, ())>(body, &atts),
        6 => check::<String>(body, &atts),
        7 => check::<Payload>(body, &atts),
        8 => check::<Option<Payload>>(body, &atts),
        9 => check::<(String, Payload)>(body, &atts),
        10 => check::<(u64, u32, bool, Option<String>)>(body, &atts),
        11 => check::<(Payload, Payload, u64)>(body, &atts),
        _ => check::<Option<(u16, Option<Payload>)>>(body, &atts),
    }
}
