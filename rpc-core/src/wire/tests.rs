use bytes::{BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use super::*;

fn limits() -> Limits {
    Limits {
        max_message_size: 1 << 20,
        max_attachments: 8,
    }
}

fn sample() -> Message {
    Message {
        header: Header {
            kind: Kind::Request,
            flags: 0,
            id: 0x0102_0304_0506_0708,
            method: 0xdead_beef,
            aux: 250,
        },
        body: Bytes::from_static(b"body bytes"),
        attachments: vec![
            Payload::from(vec![1u8; 100]),
            Payload::new(),
            Payload::from(vec![3u8; 7]),
        ]
        .into(),
    }
}

#[test]
fn round_trip_whole() {
    let m = sample();
    let mut buf = BytesMut::new();
    FrameCodec::new(limits())
        .encode(m.clone(), &mut buf)
        .unwrap();
    assert_eq!(buf.len() as u64, m.wire_len());
    let got = FrameCodec::new(limits()).decode(&mut buf).unwrap().unwrap();
    assert_eq!(got, m);
    assert!(buf.is_empty());
}

#[test]
fn decodes_one_byte_at_a_time_and_back_to_back() {
    let a = sample();
    let mut b = sample();
    b.header.id = 9;
    b.attachments.clear();
    let mut wire = BytesMut::new();
    a.encode_into(&mut wire);
    b.encode_into(&mut wire);
    let mut codec = FrameCodec::new(limits());
    let mut src = BytesMut::new();
    let mut out = Vec::new();
    for byte in wire.iter() {
        src.put_u8(*byte);
        while let Some(m) = codec.decode(&mut src).unwrap() {
            out.push(m);
        }
    }
    assert_eq!(out, vec![a, b]);
}

#[test]
fn attachments_share_the_read_buffer() {
    let m = sample();
    let mut buf = BytesMut::new();
    m.encode_into(&mut buf);
    let base = buf.as_ptr() as usize;
    let end = base + buf.len();
    let got = FrameCodec::new(limits()).decode(&mut buf).unwrap().unwrap();
    let p = got.attachments[0].as_ptr() as usize;
    assert!(
        p >= base && p < end,
        "attachment was copied out of the frame buffer"
    );
}

fn header_bytes(f: impl FnOnce(&mut [u8; HEADER_LEN])) -> BytesMut {
    let mut buf = BytesMut::new();
    sample().encode_head(&mut buf);
    let mut h: [u8; HEADER_LEN] = buf[..HEADER_LEN].try_into().unwrap();
    f(&mut h);
    BytesMut::from(&h[..])
}

fn frame_error(mut buf: BytesMut) -> FrameError {
    let e = FrameCodec::new(limits()).decode(&mut buf).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    FrameError::from_io(&e)
        .cloned()
        .expect("a FrameError inside")
}

#[test]
fn refuses_bad_headers_with_reasons() {
    assert_eq!(
        frame_error(header_bytes(|h| h[0] = b'X')),
        FrameError::BadMagic([b'X', b'R'])
    );
    assert_eq!(
        frame_error(header_bytes(|h| h[2] = 9)),
        FrameError::Version(9)
    );
    assert_eq!(
        frame_error(header_bytes(|h| h[3] = 0)),
        FrameError::UnknownKind(0)
    );
    assert!(matches!(
        frame_error(header_bytes(|h| h[4] = 1)),
        FrameError::Flags { flags: 1, .. }
    ));
    assert!(matches!(
        frame_error(header_bytes(|h| h[6] = 200)),
        FrameError::TooManyAttachments { count: 200, .. }
    ));
}

#[test]
fn refuses_huge_length_before_reserving() {
    let mut buf = header_bytes(|h| h[24..32].copy_from_slice(&(1u64 << 63).to_le_bytes()));
    let cap_before = buf.capacity();
    let e = frame_error(buf.split());
    assert_eq!(
        e,
        FrameError::TooLarge {
            kind: Kind::Request,
            id: 0x0102_0304_0506_0708,
            len: 1 << 63,
            limit: 1 << 20
        }
    );
    assert!(cap_before < 1 << 20);
}

#[test]
fn refuses_attachment_lengths_beyond_the_frame() {
    let m = sample();
    let mut buf = BytesMut::new();
    m.encode_into(&mut buf);
    // First attachment length claims more than the whole frame.
    buf[HEADER_LEN..HEADER_LEN + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(frame_error(buf), FrameError::BadLengths { .. }));
    // Table longer than the frame.
    let buf = header_bytes(|h| {
        h[6] = 3;
        h[24..32].copy_from_slice(&8u64.to_le_bytes())
    });
    assert!(matches!(frame_error(buf), FrameError::BadLengths { .. }));
}

#[test]
fn truncated_frame_waits_for_more() {
    let mut buf = BytesMut::new();
    sample().encode_into(&mut buf);
    let mut part = buf.split_to(buf.len() - 1);
    let mut codec = FrameCodec::new(limits());
    assert!(codec.decode(&mut part).unwrap().is_none());
    part.unsplit(buf);
    assert!(codec.decode(&mut part).unwrap().is_some());
}

#[test]
fn eager_threshold_counts_the_whole_frame() {
    let m = sample();
    let n = m.wire_len() as usize;
    assert!(m.is_eager(n));
    assert!(!m.is_eager(n - 1));
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_message_round_trips_through_any_split(
            id in any::<u64>(),
            method in any::<u32>(),
            aux in any::<u32>(),
            kind in 1u8..=6,
            body in proptest::collection::vec(any::<u8>(), 0..300),
            atts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let m = Message {
                header: Header { kind: Kind::from_u8(kind).unwrap(), flags: 0, id, method, aux },
                body: Bytes::from(body),
                attachments: atts.into_iter().map(Payload::from).collect(),
            };
            let mut wire = BytesMut::new();
            m.encode_into(&mut wire);
            let at = cut.index(wire.len() + 1);
            let rest = wire.split_off(at);
            let mut codec = FrameCodec::new(limits());
            let first = codec.decode(&mut wire).unwrap();
            let got = match first {
                Some(m) => m,
                None => { wire.unsplit(rest); codec.decode(&mut wire).unwrap().unwrap() }
            };
            prop_assert_eq!(got, m);
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut buf = BytesMut::from(&bytes[..]);
            let mut codec = FrameCodec::new(limits());
            // Any outcome but a panic or an unbounded reservation is fine.
            let _ = codec.decode(&mut buf);
            prop_assert!(buf.capacity() <= (1 << 20) + 64);
        }
    }
}
