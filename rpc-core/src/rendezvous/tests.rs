use std::collections::{HashMap, VecDeque};

use bytes::{Bytes, BytesMut};

use super::*;
use crate::wire::{Header, Kind};
use crate::Payload;

fn limits() -> Limits {
    Limits {
        max_message_size: 1 << 30,
        max_attachments: 16,
    }
}

fn msg(id: u64, body: &[u8], atts: &[usize]) -> Message {
    Message {
        header: Header {
            kind: Kind::Request,
            flags: 0,
            id,
            method: 7,
            aux: 0,
        },
        body: Bytes::copy_from_slice(body),
        attachments: atts
            .iter()
            .enumerate()
            .map(|(i, n)| Payload::from(vec![(i as u8).wrapping_add(1); *n]))
            .collect(),
    }
}

fn parse(b: BytesMut) -> Result<(Packet, u16), ProtocolViolation> {
    Packet::parse(b.freeze(), &limits())
}

/// An eager packet of `m` in the long form, which the encoder leaves to frames the short one
/// cannot carry (and which a receiver still reads).
fn encode_long(out: &mut BytesMut, credits: u16, m: &Message) {
    put_header(out, T_EAGER, credits, 0, 0);
    m.encode_into(out);
}

/// A small call's request and answer go in the short form: both headers in 22 bytes, 26 fewer
/// than the long form's; a frame it cannot carry goes long, and both read back the same.
#[test]
fn lone_eager_frames_go_short_and_read_back_in_either_form() {
    // an empty payload's echo: one byte of body (the payload's index), one empty attachment
    let m = msg(u64::MAX - 5, b"\x00", &[0]);
    let mut short = BytesMut::new();
    Packet::encode_eager(&mut short, 9, &m);
    assert_eq!(short.len(), SHORT_HEADER_LEN + 8 + 1);
    assert_eq!(short.len() as u64, Packet::eager_len(&m));
    assert_eq!(Packet::eager_len(&m), Packet::batch_len(m.wire_len()) - 26);
    assert_eq!(short[0], T_EAGER_SHORT);
    let mut long = BytesMut::new();
    encode_long(&mut long, 9, &m);
    assert_eq!(long.len() as u64, Packet::batch_len(m.wire_len()));
    for b in [short, long] {
        let e = Packet::peek_eager(&b, &limits()).expect("read in place");
        assert_eq!(e.frame.header, m.header);
        assert_eq!(e.frame.to_attachments(), m.attachments);
        assert_eq!(e.credits, 9);
        assert_eq!(parse(b).unwrap(), (Packet::Eager(m.clone()), 9));
    }

    // more attachments than a byte counts: the long form
    let many = Limits {
        max_message_size: 1 << 20,
        max_attachments: 300,
    };
    let m = msg(2, b"many", &[1; 256]);
    let mut b = BytesMut::new();
    Packet::encode_eager(&mut b, 1, &m);
    assert_eq!(b[0], T_EAGER);
    assert_eq!(b.len() as u64, Packet::eager_len(&m));
    assert_eq!(Packet::eager_len(&m), Packet::batch_len(m.wire_len()));
    assert_eq!(
        Packet::parse(b.freeze(), &many).unwrap(),
        (Packet::Eager(m), 1)
    );
    // reserved flags: the long form carries them, and the receiver refuses them as ever
    let mut m = msg(3, b"flags", &[]);
    m.header.flags = 4;
    let mut b = BytesMut::new();
    Packet::encode_eager(&mut b, 1, &m);
    assert_eq!(b[0], T_EAGER);
    assert!(matches!(
        parse(b),
        Err(ProtocolViolation::Frame(FrameError::Flags {
            id: 3,
            flags: 4
        }))
    ));
}

/// A short packet is checked as a long one is: its kind, its counts and lengths against the
/// limits and the packet.
#[test]
fn short_eager_lies_are_violations() {
    let mut good = BytesMut::new();
    Packet::encode_eager(&mut good, 1, &msg(1, &[7; 40], &[2]));
    assert!(parse(good.clone()).is_ok());
    // cut inside the header
    for len in [1, SHORT_HEADER_LEN - 1] {
        assert!(matches!(
            parse(BytesMut::from(&good[..len])),
            Err(ProtocolViolation::Truncated { .. })
        ));
        assert!(Packet::peek_eager(&good[..len], &limits()).is_none());
    }
    // an unknown kind
    let mut b = good.clone();
    b[4] = 0;
    assert!(Packet::peek_eager(&b, &limits()).is_none());
    assert_eq!(
        parse(b),
        Err(ProtocolViolation::Frame(FrameError::UnknownKind(0)))
    );
    // more attachments than the limit
    let mut b = good.clone();
    b[5] = 17;
    assert!(Packet::peek_eager(&b, &limits()).is_none());
    assert!(matches!(
        parse(b),
        Err(ProtocolViolation::Frame(FrameError::TooManyAttachments {
            count: 17,
            ..
        }))
    ));
    // a table longer than the packet, an attachment longer than what follows the table
    let mut b = good.clone();
    b[5] = 9;
    assert!(Packet::peek_eager(&b, &limits()).is_none());
    assert!(parse(b).is_err());
    let mut b = good.clone();
    b[SHORT_HEADER_LEN..SHORT_HEADER_LEN + 8].copy_from_slice(&1000u64.to_le_bytes());
    assert!(Packet::peek_eager(&b, &limits()).is_none());
    assert!(parse(b).is_err());
    // a frame over the size limit
    let small = Limits {
        max_message_size: 10,
        max_attachments: 16,
    };
    assert!(Packet::peek_eager(&good, &small).is_none());
    assert!(matches!(
        Packet::parse(good.freeze(), &small),
        Err(ProtocolViolation::Frame(FrameError::TooLarge { .. }))
    ));
}

#[test]
fn eager_round_trip() {
    let m = msg(1, b"hello", &[3, 0]);
    let mut b = BytesMut::new();
    Packet::encode_eager(&mut b, 5, &m);
    assert_eq!(parse(b).unwrap(), (Packet::Eager(m), 5));
}

#[test]
fn eager_batch_round_trip() {
    let ms = vec![
        msg(1, b"one", &[]),
        msg(2, b"", &[0, 5]),
        msg(3, &[9; 100], &[7]),
    ];
    let mut b = BytesMut::new();
    Packet::encode_eager_batch(&mut b, 3, &ms);
    let frames: u64 = ms.iter().map(|m| m.wire_len()).sum();
    assert_eq!(b.len() as u64, Packet::batch_len(frames));
    assert_eq!(parse(b).unwrap(), (Packet::EagerBatch(ms), 3));
}

#[test]
fn eager_packets_encode_in_place_into_a_slice_of_their_length() {
    // what a transport does with a send slot: batch_len bytes, filled exactly, the same bytes
    // as into a growing buffer
    let one = msg(1, b"in place", &[2, 0]);
    let many = [msg(2, b"a", &[]), msg(3, &[7; 40], &[1, 3])];
    for batch in [false, true] {
        let msgs = if batch {
            &many[..]
        } else {
            std::slice::from_ref(&one)
        };
        let frames: u64 = msgs.iter().map(|m| m.wire_len()).sum();
        let mut grown = BytesMut::new();
        let mut slot = vec![0xee; Packet::packet_len(msgs, frames) as usize];
        let mut rest = &mut slot[..];
        if batch {
            Packet::encode_eager_batch(&mut grown, 4, msgs);
            Packet::encode_eager_batch(&mut rest, 4, msgs);
        } else {
            Packet::encode_eager(&mut grown, 4, &one);
            Packet::encode_eager(&mut rest, 4, &one);
        }
        assert!(rest.is_empty(), "the slot is filled exactly");
        assert_eq!(&slot[..], &grown[..]);
        if !batch {
            // the small-message path: the same bytes, the frame's length taken from the slot
            let mut exact = vec![0xee; slot.len()];
            Packet::encode_eager_exact(&mut exact, 4, &one);
            assert_eq!(exact, slot);
        }
    }
}

#[test]
fn the_exact_encoder_refuses_a_slot_of_another_length() {
    // a slot one byte short or one byte long would give a frame whose header lies about its
    // length: both panic instead of going out
    let one = msg(1, b"sized", &[3, 0, 5]);
    let len = Packet::eager_len(&one) as usize;
    for wrong in [len - 1, len + 1, 0, PACKET_HEADER_LEN + 3] {
        let got = std::panic::catch_unwind(|| {
            Packet::encode_eager_exact(&mut vec![0; wrong], 0, &one);
        });
        assert!(
            got.is_err(),
            "a slot of {wrong} bytes for a {len}-byte packet"
        );
    }
}

#[test]
fn eager_limit_is_the_plans_eager_test() {
    for (slot, threshold) in [(4096, 4096), (4096, 512), (512, 4096), (4096, 0), (64, 8)] {
        let limit = Plan::eager_limit(slot, threshold);
        for body in 0..600 {
            let m = msg(1, &vec![0; body], &[]);
            let eager = Packet::batch_len(m.wire_len()) <= limit as u64;
            let plan = Plan::for_message(&m, slot, threshold, Direction::Pull);
            assert_eq!(
                eager,
                plan == Ok(Plan::Eager),
                "slot {slot}, threshold {threshold}, body {body}"
            );
        }
    }
}

#[test]
fn eager_batch_lies_are_violations() {
    let ms = vec![msg(1, b"one", &[]), msg(2, b"two", &[4])];
    let mut good = BytesMut::new();
    Packet::encode_eager_batch(&mut good, 1, &ms);
    // a count of more frames than there are, or of none
    for n in [0u32, 3, u32::MAX] {
        let mut b = good.clone();
        b[4..8].copy_from_slice(&n.to_le_bytes());
        assert!(parse(b).is_err(), "count {n} accepted");
    }
    // cut inside the last frame, or a byte after it
    let mut cut = good.clone();
    cut.truncate(good.len() - 1);
    assert!(parse(cut).is_err(), "truncated batch accepted");
    let mut extra = good.clone();
    extra.extend_from_slice(&[0]);
    assert!(parse(extra).is_err(), "trailing byte accepted");
    // a frame claiming more than the limit
    let mut big = BytesMut::new();
    Packet::encode_eager_batch(&mut big, 1, &[msg(1, &[0; 64], &[])]);
    let limits = Limits {
        max_message_size: 10,
        max_attachments: 16,
    };
    assert!(
        Packet::parse(big.freeze(), &limits).is_err(),
        "frame over the limit accepted"
    );
}

/// A frame read in place is owned without a copy when there is nothing to copy (a body of at
/// most one byte, attachments that hold no bytes), and equals what the copy would give;
/// anything longer is left to the copy.
#[test]
fn tiny_frames_are_owned_without_a_copy() {
    for (body, atts, tiny) in [
        (&b""[..], &[][..], true),
        (b"\x00", &[0, 0][..], true),
        (b"\xff", &[][..], true),
        (b"ab", &[][..], false),
        (b"\x01", &[1][..], false),
    ] {
        let m = msg(3, body, atts);
        let mut b = BytesMut::new();
        Packet::encode_eager(&mut b, 0, &m);
        let e = Packet::peek_eager(&b, &limits()).expect("an eager packet");
        let rest = Bytes::copy_from_slice(e.rest);
        match e.frame.owned_if_tiny() {
            Some((body, atts)) => {
                assert!(tiny, "{m:?} taken as tiny");
                assert_eq!((body, atts), e.frame.split_copy(rest));
            }
            None => assert!(!tiny, "{m:?} not taken as tiny"),
        }
    }
    for b in 0..=255u8 {
        assert_eq!(&crate::wire::tiny_body(&[b]).unwrap()[..], &[b]);
    }
    assert!(crate::wire::tiny_body(&[]).unwrap().is_empty());
    assert_eq!(crate::wire::tiny_body(&[1, 2]), None);
}

/// The in-place read of an eager packet gives its frame (header, body, attachments) and
/// credits; it leaves every other packet (batches, control packets, anything malformed) to
/// `parse`.
#[test]
fn eager_packets_are_read_in_place() {
    let m = msg(41, b"answer", &[]);
    let mut b = BytesMut::new();
    Packet::encode_eager(&mut b, 6, &m);
    let e = Packet::peek_eager(&b, &limits()).expect("an eager packet");
    assert_eq!(e.frame.header, m.header);
    assert_eq!(e.frame.body, b"answer");
    assert_eq!(e.frame.attachments().count(), 0);
    assert_eq!(e.credits, 6);
    assert!(!e.starved);
    Packet::mark_starved(&mut b);
    assert!(Packet::peek_eager(&b, &limits()).unwrap().starved);

    let m = msg(7, b"x", &[3, 0, 5]);
    let mut att = BytesMut::new();
    Packet::encode_eager(&mut att, 1, &m);
    let e = Packet::peek_eager(&att, &limits()).expect("an eager packet with attachments");
    assert_eq!(e.frame.body, b"x");
    let lent: Vec<&[u8]> = e.frame.attachments().collect();
    let sent: Vec<&[u8]> = m.attachments.iter().map(|a| &a[..]).collect();
    assert_eq!(lent, sent);
    assert_eq!(e.frame.to_attachments(), m.attachments, "copied out whole");

    // not read in place: a batch, a control packet
    let mut batch = BytesMut::new();
    Packet::encode_eager_batch(&mut batch, 1, &[msg(1, b"x", &[])]);
    assert_eq!(Packet::peek_eager(&batch, &limits()), None);
    let mut credit = BytesMut::new();
    Packet::encode_control(&mut credit, 2, &Packet::Credit);
    assert_eq!(Packet::peek_eager(&credit, &limits()), None);
    // malformed, in the long form (the short one: `short_eager_lies_are_violations`): cut
    // short, a byte too many, a bad magic, a body over the limit, attachments longer than the
    // frame
    let mut good = BytesMut::new();
    encode_long(&mut good, 1, &msg(1, &[7; 40], &[2]));
    assert!(Packet::peek_eager(&good, &limits()).is_some());
    assert!(Packet::peek_eager(&good[..good.len() - 1], &limits()).is_none());
    let mut long = good.clone();
    long.extend_from_slice(&[0]);
    assert!(Packet::peek_eager(&long, &limits()).is_none());
    let mut magic = good.clone();
    magic[PACKET_HEADER_LEN] = b'X';
    assert!(Packet::peek_eager(&magic, &limits()).is_none());
    let small = Limits {
        max_message_size: 10,
        max_attachments: 16,
    };
    assert!(Packet::peek_eager(&good, &small).is_none());
    let mut lie = good.clone();
    let table = PACKET_HEADER_LEN + HEADER_LEN;
    lie[table..table + 8].copy_from_slice(&1000u64.to_le_bytes());
    assert!(Packet::peek_eager(&lie, &limits()).is_none());
    assert!(parse(lie).is_err(), "and parse refuses it too");
    assert!(Packet::peek_eager(&good[..3], &limits()).is_none());
}

#[test]
fn pull_rts_round_trip_and_mismatches() {
    let m = msg(2, b"body", &[100, 200]);
    let segs = [
        Segment {
            addr: 0x1000,
            len: 100,
            rkey: 9,
        },
        Segment {
            addr: 0x2000,
            len: 200,
            rkey: 9,
        },
    ];
    let mut b = BytesMut::new();
    Packet::encode_pull_rts(&mut b, 1, 42, &m, &segs);
    let (p, credits) = parse(b).unwrap();
    assert_eq!(credits, 1);
    match p {
        Packet::PullRts { id, head, segments } => {
            assert_eq!(id, 42);
            assert_eq!(segments, segs);
            assert_eq!(head.lens, vec![100, 200]);
            assert_eq!(&head.body[..], b"body");
            assert_eq!(head.wire.header, m.header);
        }
        other => panic!("{other:?}"),
    }
    // A segment whose length disagrees with the table.
    let mut bad = segs;
    bad[1].len = 201;
    let mut b = BytesMut::new();
    Packet::encode_pull_rts(&mut b, 0, 42, &m, &bad);
    assert!(matches!(
        parse(b),
        Err(ProtocolViolation::Mismatch { id: 42, .. })
    ));
    // One segment fewer than attachments: the count field says 1, the table says 2.
    let mut b = BytesMut::new();
    Packet::encode_pull_rts(&mut b, 0, 43, &m, &segs);
    b[4] = 1;
    assert!(parse(b).is_err());
}

/// Segments for the attachments of `m`, as a sender exposes them.
fn segments_of(m: &Message) -> Vec<Segment> {
    m.attachments
        .iter()
        .map(|a| Segment {
            addr: 0x1000,
            len: a.len() as u64,
            rkey: 3,
        })
        .collect()
}

/// A body too large for a slot beside its header travels as the last segment of a marked
/// announcement, pulled or pushed, and comes back as the body; unmarked, the same packet
/// would deliver it as an attachment; a mark that cannot be true is refused.
#[test]
fn a_lifted_body_comes_back_as_the_body() {
    let slot = 16 * 1024;
    let m = msg(9, &[0xab; 20_000], &[100, 0]);
    for d in [Direction::Pull, Direction::Push] {
        assert!(Plan::for_message(&m, slot, 8192, d).is_err());
    }
    let lifted = lift_body(m.clone());
    assert!(lifted.body.is_empty());
    assert_eq!(lifted.attachments.len(), 3);
    assert_eq!(&lifted.attachments[2][..], &m.body[..]);
    for d in [Direction::Pull, Direction::Push] {
        assert_eq!(
            Plan::for_message(&lifted, slot, 8192, d),
            Ok(Plan::Rendezvous(d))
        );
    }
    let segs = segments_of(&lifted);
    for push in [false, true] {
        let mut b = BytesMut::new();
        if push {
            Packet::encode_push_rts(&mut b, 0, 5, &lifted);
        } else {
            Packet::encode_pull_rts(&mut b, 0, 5, &lifted, &segs);
        }
        let unmarked = b.clone();
        Packet::mark_body_last(&mut b);
        let head = match parse(b).unwrap().0 {
            Packet::PullRts { head, .. } | Packet::PushRts { head, .. } => head,
            other => panic!("{other:?}"),
        };
        assert!(head.body_last);
        assert_eq!(head.lens, vec![100, 0, 20_000]);
        assert_eq!(
            head.into_message(lifted.attachments.clone()),
            m,
            "push {push}"
        );
        let head = match parse(unmarked).unwrap().0 {
            Packet::PullRts { head, .. } | Packet::PushRts { head, .. } => head,
            other => panic!("{other:?}"),
        };
        assert!(!head.body_last);
        assert_eq!(head.into_message(lifted.attachments.clone()), lifted);
    }
    // a body inline beside the mark
    let small = msg(6, b"body", &[10]);
    let mut b = BytesMut::new();
    Packet::encode_pull_rts(&mut b, 0, 6, &small, &segments_of(&small));
    Packet::mark_body_last(&mut b);
    assert!(matches!(
        parse(b),
        Err(ProtocolViolation::Mismatch { id: 6, .. })
    ));
    // the mark with no segment to be the body
    let none = msg(7, b"", &[]);
    let mut b = BytesMut::new();
    Packet::encode_push_rts(&mut b, 0, 7, &none);
    Packet::mark_body_last(&mut b);
    assert!(matches!(
        parse(b),
        Err(ProtocolViolation::Mismatch { id: 7, .. })
    ));
}

#[test]
fn push_round_trip() {
    let m = msg(3, b"", &[5000]);
    let mut b = BytesMut::new();
    Packet::encode_push_rts(&mut b, 0, 7, &m);
    let (p, _) = parse(b).unwrap();
    let Packet::PushRts { id: 7, head } = p else {
        panic!("{p:?}")
    };
    assert_eq!(head.lens, vec![5000]);
    let segs = [Segment {
        addr: 1,
        len: 5000,
        rkey: 3,
    }];
    let mut b = BytesMut::new();
    Packet::encode_cts(&mut b, 2, 7, &segs);
    assert_eq!(
        parse(b).unwrap(),
        (
            Packet::Cts {
                id: 7,
                segments: segs.to_vec()
            },
            2
        )
    );
    for p in [
        Packet::Fin { id: 9 },
        Packet::PushDone { id: 9 },
        Packet::Credit,
        Packet::Refuse {
            id: 9,
            reason: refuse::TOO_LARGE,
        },
    ] {
        let mut b = BytesMut::new();
        Packet::encode_control(&mut b, 3, &p);
        assert_eq!(parse(b).unwrap(), (p, 3));
    }
}

#[test]
fn refuses_malformed_packets() {
    assert!(matches!(
        parse(BytesMut::from(&[1u8, 0, 0][..])),
        Err(ProtocolViolation::Truncated { .. })
    ));
    let mut b = BytesMut::new();
    Packet::encode_control(&mut b, 0, &Packet::Credit);
    b[0] = 99;
    assert_eq!(parse(b), Err(ProtocolViolation::UnknownType(99)));
    // Eager whose frame claims more than the slot holds (the long form: the short one has no
    // length but the packet's).
    let mut b = BytesMut::new();
    encode_long(&mut b, 0, &msg(1, b"abc", &[]));
    b.truncate(b.len() - 1);
    assert!(parse(b).is_err());
    // Segment count beyond the limit: refused before reading segments.
    let mut b = BytesMut::new();
    Packet::encode_cts(&mut b, 0, 1, &[]);
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        parse(b),
        Err(ProtocolViolation::Frame(
            FrameError::TooManyAttachments { .. }
        ))
    ));
    // Inline frame whose length field disagrees with its table and body.
    let mut b = BytesMut::new();
    Packet::encode_push_rts(&mut b, 0, 1, &msg(1, b"xy", &[10]));
    let len_at = PACKET_HEADER_LEN + 8 + 24;
    b[len_at..len_at + 8].copy_from_slice(&9u64.to_le_bytes());
    assert!(matches!(parse(b), Err(ProtocolViolation::Mismatch { .. })));
}

#[test]
fn plan_picks_eager_then_rendezvous_and_refuses_fat_inline() {
    let small = msg(1, b"x", &[10]);
    assert_eq!(
        Plan::for_message(&small, 4096, 4096, Direction::Pull),
        Ok(Plan::Eager)
    );
    let big = msg(1, b"x", &[10_000]);
    assert_eq!(
        Plan::for_message(&big, 4096, 4096, Direction::Push),
        Ok(Plan::Rendezvous(Direction::Push))
    );
    // The threshold wins over the slot size when smaller.
    assert_eq!(
        Plan::for_message(&msg(1, b"x", &[1000]), 4096, 512, Direction::Pull),
        Ok(Plan::Rendezvous(Direction::Pull))
    );
    let fat_body = msg(1, &[0u8; 5000], &[]);
    assert!(Plan::for_message(&fat_body, 4096, 4096, Direction::Pull).is_err());
}

#[test]
fn credits_never_overrun_and_always_return() {
    let mut a = Credits::new(4);
    let mut sent = 0;
    while a.can_send() {
        a.take().unwrap();
        sent += 1;
    }
    assert_eq!(sent, 3, "one credit is kept for credit returns");
    assert!(
        a.take().is_some(),
        "the reserved credit serves a credit return"
    );
    assert!(a.take().is_none());
    // Returning more than the window is a violation.
    assert_eq!(a.on_receive(5), Err(ProtocolViolation::NoCredit));
    a.on_receive(3).unwrap();
    a.on_receive(1).unwrap();
    assert_eq!(a.available(), 4);
    assert_eq!(a.held(), 2);
    assert!(!a.should_return(), "held packets are not owed yet");
    for _ in 0..2 {
        a.on_slot_reposted();
    }
    assert_eq!(a.held(), 0);
    assert!(a.should_return());
    assert_eq!(a.take(), Some(2));
    assert_eq!(a.owed(), 0);
}

/// Packets received but not yet consumed count against the window: a peer cannot push more
/// than `slots` messages past a reader that has stopped.
#[test]
fn held_packets_bound_what_the_peer_may_send() {
    let mut me = Credits::new(4);
    for _ in 0..4 {
        me.on_receive(0).unwrap();
    }
    assert_eq!(me.held(), 4);
    assert_eq!(me.owed(), 0);
    assert_eq!(me.on_receive(0), Err(ProtocolViolation::NoCredit));
    // The reader takes one: its credit is owed back, still no room for the peer until returned.
    me.on_slot_reposted();
    assert_eq!(me.on_receive(0), Err(ProtocolViolation::NoCredit));
    assert_eq!(me.take(), Some(1));
    me.on_receive(0).unwrap();
    assert_eq!(me.held(), 4);
}

/// Found by the fuzzer (fuzz/regressions/rendezvous/): a peer that keeps sending after its
/// credits ran out must be caught, not counted past the window.
#[test]
fn sending_without_credit_is_a_violation() {
    let mut me = Credits::new(2);
    for _ in 0..2 {
        me.on_receive(0).unwrap();
        me.on_slot_reposted();
    }
    // Both slots are owed back and the peer has returned nothing: it had no credit left.
    assert_eq!(me.on_receive(0), Err(ProtocolViolation::NoCredit));
}

#[test]
fn transfers_refuse_stale_and_forged_ids() {
    let mut t: Transfers<u32> = Transfers::new();
    let id = t.start_pull(vec![1, 2]);
    assert_eq!(
        t.on_fin(id + 1),
        Err(ProtocolViolation::UnknownTransfer(id + 1))
    );
    assert_eq!(t.on_fin(id), Ok(vec![1, 2]));
    assert_eq!(
        t.on_fin(id),
        Err(ProtocolViolation::UnknownTransfer(id)),
        "a replayed Fin"
    );
    let push = t.start_push(vec![3]);
    let seg = [Segment {
        addr: 0,
        len: 10,
        rkey: 1,
    }];
    assert!(matches!(
        t.on_cts(push, &seg, [11u64].into_iter()),
        Err(ProtocolViolation::Mismatch { .. })
    ));
    assert_eq!(t.on_cts(push, &seg, [10u64].into_iter()), Ok(vec![3]));
    let head = Inline {
        wire: WireHeader {
            header: Header::new(Kind::Request, 1),
            n_attach: 1,
            len: 18,
        },
        body: Bytes::new(),
        lens: vec![10],
        body_last: false,
    };
    t.begin_incoming(
        5,
        Incoming::Pulling {
            head: head.clone(),
            bufs: vec![7, 8],
            pending: 2,
        },
    )
    .unwrap();
    assert_eq!(
        t.begin_incoming(
            5,
            Incoming::Granted {
                head: head.clone(),
                bufs: vec![9]
            }
        ),
        Err(ProtocolViolation::DuplicateTransfer(5))
    );
    assert_eq!(
        t.on_push_done(5),
        Err(ProtocolViolation::UnknownTransfer(5)),
        "wrong kind"
    );
    assert_eq!(t.on_read_done(5).unwrap(), None);
    let (_, bufs) = t.on_read_done(5).unwrap().unwrap();
    assert_eq!(bufs, vec![7, 8]);
    assert!(t.on_read_done(5).is_err());
    t.start_pull(vec![10]);
    t.begin_incoming(
        6,
        Incoming::Granted {
            head,
            bufs: vec![11],
        },
    )
    .unwrap();
    let mut all = t.drain();
    all.sort();
    assert_eq!(all, vec![10, 11]);
    assert!(t.is_empty());
}

/// A simulated pair of endpoints over an in-process FAKE of the verbs layer (a map from rkey
/// to memory, and queues for SENDs). It exercises the protocol logic only; the real verbs path
/// is tested on rxe and siw in the guest.
mod fake_nic {
    use super::*;

    /// A registered buffer in fake memory.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub(super) struct Buf(u32);

    #[derive(Default)]
    pub(super) struct Nic {
        memory: HashMap<u32, Vec<u8>>,
        next_key: u32,
        pub(super) live: usize,
    }

    impl Nic {
        pub(super) fn alloc(&mut self, data: Vec<u8>) -> Buf {
            self.next_key += 1;
            self.memory.insert(self.next_key, data);
            self.live += 1;
            Buf(self.next_key)
        }
        pub(super) fn free(&mut self, b: Buf) {
            assert!(self.memory.remove(&b.0).is_some(), "double free of {b:?}");
            self.live -= 1;
        }
        pub(super) fn segment(&self, b: Buf) -> Segment {
            Segment {
                addr: 0,
                len: self.memory[&b.0].len() as u64,
                rkey: b.0,
            }
        }
        /// RDMA READ or WRITE: the key must name a live buffer of the right length.
        pub(super) fn copy(&mut self, from: u32, to: u32) -> Result<(), &'static str> {
            let data = self.memory.get(&from).ok_or("bad source key")?.clone();
            let dst = self.memory.get_mut(&to).ok_or("bad destination key")?;
            if dst.len() != data.len() {
                return Err("length mismatch");
            }
            dst.copy_from_slice(&data);
            Ok(())
        }
        pub(super) fn take(&mut self, b: Buf) -> Vec<u8> {
            self.live -= 1;
            self.memory.remove(&b.0).expect("live buffer")
        }
    }

    pub(super) struct Side {
        pub(super) credits: Credits,
        pub(super) transfers: Transfers<Buf>,
        pub(super) delivered: Vec<Message>,
    }

    impl Side {
        pub(super) fn new() -> Side {
            Side {
                credits: Credits::new(8),
                transfers: Transfers::new(),
                delivered: Vec::new(),
            }
        }
    }

    /// Sends `m` from `me` towards the queue `wire` by `dir`.
    pub(super) fn send(
        nic: &mut Nic,
        me: &mut Side,
        wire: &mut VecDeque<Bytes>,
        m: &Message,
        dir: Direction,
    ) {
        let mut out = BytesMut::new();
        let credits = me.credits.take().expect("credit");
        match Plan::for_message(m, 512, 512, dir).unwrap() {
            Plan::Eager => Packet::encode_eager(&mut out, credits, m),
            Plan::Rendezvous(Direction::Pull) => {
                let bufs: Vec<Buf> = m
                    .attachments
                    .iter()
                    .map(|a| nic.alloc(a.to_vec()))
                    .collect();
                let segs: Vec<Segment> = bufs.iter().map(|b| nic.segment(*b)).collect();
                let id = me.transfers.start_pull(bufs);
                Packet::encode_pull_rts(&mut out, credits, id, m, &segs);
            }
            Plan::Rendezvous(Direction::Push) => {
                let bufs: Vec<Buf> = m
                    .attachments
                    .iter()
                    .map(|a| nic.alloc(a.to_vec()))
                    .collect();
                let id = me.transfers.start_push(bufs);
                Packet::encode_push_rts(&mut out, credits, id, m);
            }
        }
        wire.push_back(out.freeze());
    }

    /// Handles one packet arriving at `me`; replies go to `back`.
    pub(super) fn receive(
        nic: &mut Nic,
        me: &mut Side,
        back: &mut VecDeque<Bytes>,
        slot: Bytes,
    ) -> Result<(), ProtocolViolation> {
        let (packet, credits) = Packet::parse(slot, &limits())?;
        me.credits.on_receive(credits)?;
        me.credits.on_slot_reposted();
        let mut reply = |me: &mut Side, p: Packet| {
            let mut out = BytesMut::new();
            let c = me.credits.take().expect("credit");
            match &p {
                Packet::Cts { id, segments } => Packet::encode_cts(&mut out, c, *id, segments),
                _ => Packet::encode_control(&mut out, c, &p),
            }
            back.push_back(out.freeze());
        };
        match packet {
            Packet::Eager(m) => me.delivered.push(m),
            Packet::EagerBatch(ms) => me.delivered.extend(ms),
            Packet::PullRts { id, head, segments } => {
                let bufs: Vec<Buf> = head
                    .lens
                    .iter()
                    .map(|l| nic.alloc(vec![0; *l as usize]))
                    .collect();
                let n = bufs.len();
                for (s, b) in segments.iter().zip(&bufs) {
                    nic.copy(s.rkey, b.0)
                        .map_err(|_| ProtocolViolation::UnknownTransfer(id))?;
                }
                me.transfers.begin_incoming(
                    id,
                    Incoming::Pulling {
                        head,
                        bufs,
                        pending: n,
                    },
                )?;
                let mut done = None;
                for _ in 0..n {
                    done = me.transfers.on_read_done(id)?;
                }
                let (head, bufs) = done.expect("all reads done");
                let atts: Vec<Payload> = bufs
                    .into_iter()
                    .map(|b| Payload::from(nic.take(b)))
                    .collect();
                me.delivered.push(head.into_message(atts));
                reply(me, Packet::Fin { id });
            }
            Packet::PushRts { id, head } => {
                let bufs: Vec<Buf> = head
                    .lens
                    .iter()
                    .map(|l| nic.alloc(vec![0; *l as usize]))
                    .collect();
                let segments = bufs.iter().map(|b| nic.segment(*b)).collect();
                me.transfers
                    .begin_incoming(id, Incoming::Granted { head, bufs })?;
                reply(me, Packet::Cts { id, segments });
            }
            Packet::Cts { id, segments } => {
                // Lengths we announced: the fake NIC knows them from our buffers.
                let lens: Vec<u64> = me.transfers_lens(id, nic);
                let bufs = me.transfers.on_cts(id, &segments, lens.into_iter())?;
                for (b, s) in bufs.iter().zip(&segments) {
                    nic.copy(b.0, s.rkey)
                        .map_err(|_| ProtocolViolation::UnknownTransfer(id))?;
                }
                for b in bufs {
                    nic.free(b);
                }
                reply(me, Packet::PushDone { id });
            }
            Packet::PushDone { id } => {
                let (head, bufs) = me.transfers.on_push_done(id)?;
                let atts: Vec<Payload> = bufs
                    .into_iter()
                    .map(|b| Payload::from(nic.take(b)))
                    .collect();
                me.delivered.push(head.into_message(atts));
            }
            Packet::Fin { id } => {
                for b in me.transfers.on_fin(id)? {
                    nic.free(b);
                }
            }
            Packet::Credit => {}
            Packet::Refuse { id, reason } => return Err(ProtocolViolation::Refused { id, reason }),
        }
        Ok(())
    }

    impl Side {
        fn transfers_lens(&self, id: u64, nic: &Nic) -> Vec<u64> {
            self.transfers
                .announced
                .get(&id)
                .map(|bufs| bufs.iter().map(|b| nic.memory[&b.0].len() as u64).collect())
                .unwrap_or_default()
        }
    }
}

use fake_nic::{receive, send, Nic, Side};

/// Messages in request-id order: a rendezvous message is delivered when its bulk data has
/// arrived, so eager messages sent after it may overtake it (the rpc layer matches by id).
fn by_id(mut v: Vec<Message>) -> Vec<Message> {
    v.sort_by_key(|m| m.header.id);
    v
}

fn run_pair(messages: Vec<(Message, Direction)>) -> (Nic, Side, Side) {
    let mut nic = Nic::default();
    let (mut a, mut b) = (Side::new(), Side::new());
    let (mut a_to_b, mut b_to_a) = (VecDeque::new(), VecDeque::new());
    let mut queue: VecDeque<_> = messages.into();
    loop {
        let mut progressed = false;
        if a.credits.can_send() {
            if let Some((m, dir)) = queue.pop_front() {
                send(&mut nic, &mut a, &mut a_to_b, &m, dir);
                progressed = true;
            }
        }
        if let Some(slot) = a_to_b.pop_front() {
            receive(&mut nic, &mut b, &mut b_to_a, slot).unwrap();
            progressed = true;
        }
        if let Some(slot) = b_to_a.pop_front() {
            receive(&mut nic, &mut a, &mut a_to_b, slot).unwrap();
            progressed = true;
        }
        for (me, out) in [(&mut a, &mut a_to_b), (&mut b, &mut b_to_a)] {
            if me.credits.should_return() && out.is_empty() {
                let mut buf = BytesMut::new();
                let c = me.credits.take().unwrap();
                Packet::encode_control(&mut buf, c, &Packet::Credit);
                out.push_back(buf.freeze());
                progressed = true;
            }
        }
        if !progressed {
            break;
        }
    }
    assert!(
        queue.is_empty(),
        "stalled with {} messages unsent (credit deadlock?)",
        queue.len()
    );
    (nic, a, b)
}

#[test]
fn pair_moves_messages_both_ways_and_frees_every_buffer() {
    let mut sent = Vec::new();
    for i in 0..40u64 {
        let dir = if i % 2 == 0 {
            Direction::Pull
        } else {
            Direction::Push
        };
        let atts: &[usize] = match i % 4 {
            0 => &[],
            1 => &[10],
            2 => &[1000, 3],
            _ => &[5000],
        };
        sent.push((msg(i, b"b", atts), dir));
    }
    let expected: Vec<Message> = sent.iter().map(|(m, _)| m.clone()).collect();
    let (nic, a, b) = run_pair(sent);
    assert_eq!(by_id(b.delivered), expected);
    assert!(a.transfers.is_empty() && b.transfers.is_empty());
    assert_eq!(nic.live, 0, "buffers leaked");
}

#[test]
fn forged_fin_and_cts_are_violations_on_that_connection() {
    let mut nic = Nic::default();
    let mut a = Side::new();
    let mut back = VecDeque::new();
    let mut out = BytesMut::new();
    Packet::encode_control(&mut out, 0, &Packet::Fin { id: 12345 });
    assert_eq!(
        receive(&mut nic, &mut a, &mut back, out.freeze()),
        Err(ProtocolViolation::UnknownTransfer(12345))
    );
    // A pull announcement naming a key that grants nothing: the read fails, no delivery.
    let mut b = Side::new();
    let mut out = BytesMut::new();
    let m = msg(1, b"", &[600]);
    Packet::encode_pull_rts(
        &mut out,
        0,
        1,
        &m,
        &[Segment {
            addr: 0,
            len: 600,
            rkey: 999,
        }],
    );
    assert!(receive(&mut nic, &mut b, &mut back, out.freeze()).is_err());
    assert!(b.delivered.is_empty());
}

mod props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn any_sequence_is_delivered_whole_without_leaks(
            spec in proptest::collection::vec(
                (proptest::collection::vec(0usize..3000, 0..4), any::<bool>()), 0..60)
        ) {
            let sent: Vec<(Message, Direction)> = spec.iter().enumerate().map(|(i, (atts, pull))| {
                (msg(i as u64, b"z", atts), if *pull { Direction::Pull } else { Direction::Push })
            }).collect();
            let expected: Vec<Message> = sent.iter().map(|(m, _)| m.clone()).collect();
            let (nic, _a, b) = run_pair(sent);
            prop_assert_eq!(by_id(b.delivered), expected);
            prop_assert_eq!(nic.live, 0);
        }

        /// The small-message encoder writes the bytes of the general one, for any message.
        #[test]
        fn the_exact_encoder_writes_what_the_growing_one_does(
            id in any::<u64>(),
            credits in any::<u16>(),
            body in proptest::collection::vec(any::<u8>(), 0..200),
            atts in proptest::collection::vec(0usize..100, 0..6),
        ) {
            let m = msg(id, &body, &atts);
            let mut grown = BytesMut::new();
            Packet::encode_eager(&mut grown, credits, &m);
            let mut exact = vec![0x5a; Packet::eager_len(&m) as usize];
            Packet::encode_eager_exact(&mut exact, credits, &m);
            prop_assert_eq!(&exact[..], &grown[..]);
            prop_assert_eq!(parse(grown).unwrap(), (Packet::Eager(m), credits));
        }

        #[test]
        fn arbitrary_slots_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = Packet::parse(Bytes::from(bytes), &limits());
        }

        /// Whatever `peek_eager` reads in place, `parse` reads as the same eager frame, for
        /// packets with one byte changed anywhere (the header's counts, lengths, kind, the
        /// attachment table).
        #[test]
        fn peek_agrees_with_parse(
            body in proptest::collection::vec(any::<u8>(), 0..64),
            atts in proptest::collection::vec(0usize..40, 0..3),
            at in 0usize..300,
            to in any::<u8>(),
            starved in any::<bool>(),
            short in any::<bool>(),
        ) {
            let mut b = BytesMut::new();
            if short {
                Packet::encode_eager(&mut b, 3, &msg(9, &body, &atts));
            } else {
                encode_long(&mut b, 3, &msg(9, &body, &atts));
            }
            if starved {
                Packet::mark_starved(&mut b);
            }
            let at = at % b.len();
            b[at] = to;
            let slot = b.freeze();
            if let Some(e) = Packet::peek_eager(&slot, &limits()) {
                let (packet, credits) = Packet::parse(slot.clone(), &limits())
                    .expect("what peek reads, parse reads");
                let Packet::Eager(m) = packet else {
                    panic!("peek read a packet that parse does not call eager: {packet:?}");
                };
                prop_assert_eq!(e.frame.header, m.header);
                prop_assert_eq!(e.frame.body, &m.body[..]);
                prop_assert_eq!(e.frame.to_attachments(), m.attachments);
                prop_assert_eq!(e.credits, credits);
                prop_assert_eq!(e.starved, Packet::is_starved(&slot));
            } else if let Ok((Packet::Eager(m), _)) = Packet::parse(slot.clone(), &limits()) {
                panic!("parse read an eager packet that peek did not: {m:?}");
            }
        }
    }
}

/// A connection that grants its window (`Credits::starting`) may be sent only the start window
/// until its grant arrives, and the grant is owed at once.
#[test]
fn a_granted_window_starts_at_two() {
    let mut me = Credits::starting(8, 8);
    assert_eq!(me.available(), START_WINDOW);
    assert_eq!(
        me.owed(),
        6,
        "the rest of the window is owed to the peer at once"
    );
    assert!(me.should_return());
    // the peer may send two packets before our grant reaches it, not three
    me.on_receive(0).unwrap();
    me.on_receive(0).unwrap();
    assert_eq!(me.on_receive(0), Err(ProtocolViolation::NoCredit));
    // the peer's own grant may take our credits up to its largest window, not past it
    let mut other = Credits::starting(4, 4);
    other.on_receive(2).unwrap();
    assert_eq!(other.available(), 4);
    assert_eq!(other.on_receive(1), Err(ProtocolViolation::NoCredit));
}

/// Growing a window lets the peer send more; shrinking takes back only owed slots and never
/// goes below the start window.
#[test]
fn windows_grow_and_shrink_within_bounds() {
    let mut me = Credits::starting(START_WINDOW, 32);
    assert_eq!(me.owed(), 0);
    me.grow(4);
    assert_eq!((me.window(), me.owed()), (6, 4));
    // nothing is owed that has not been returned: all 4 can be taken back
    assert_eq!(me.shrink(10), 4);
    assert_eq!((me.window(), me.owed()), (2, 0));
    assert_eq!(me.shrink(1), 0, "never below the start window");
    me.grow(2);
    assert_eq!(me.take(), Some(2));
    // returned credits belong to the peer: shrinking waits for them to come back as owed
    assert_eq!(me.shrink(2), 0);
    for _ in 0..2 {
        me.on_receive(0).unwrap();
        me.on_slot_reposted();
    }
    assert_eq!(me.shrink(2), 2);
    assert_eq!(me.window(), 2);
}

proptest::proptest! {
    /// Connections of one shared receive queue, each admitted with the start window and
    /// borrowing, giving back and ending at random: the windows together never exceed the
    /// budget, every window stays at least the start window, and the budget is whole again
    /// once every connection ended.
    #[test]
    fn shared_windows_never_exceed_the_budget(
        total in 2u32..64,
        ops in proptest::collection::vec((0u8..4, 0usize..8, 0u32..6), 0..200),
    ) {
        let budget = RecvBudget::new(total);
        let mut conns: Vec<Credits> = Vec::new();
        for (op, i, n) in ops {
            match op {
                0 if budget.try_take(START_WINDOW) => {
                    conns.push(Credits::starting(START_WINDOW, 32));
                }
                1 if !conns.is_empty() => {
                    let at = i % conns.len();
                    let c = &mut conns[at];
                    let got = budget.take_up_to(n);
                    c.grow(got);
                }
                2 if !conns.is_empty() => {
                    let at = i % conns.len();
                    let c = &mut conns[at];
                    let k = c.shrink(n);
                    budget.give(k);
                }
                3 if !conns.is_empty() => {
                    let c = conns.swap_remove(i % conns.len());
                    budget.give(c.window());
                }
                _ => {}
            }
            let granted: u32 = conns.iter().map(Credits::window).sum();
            proptest::prop_assert_eq!(granted + budget.free(), total);
            proptest::prop_assert!(conns.iter().all(|c| c.window() >= START_WINDOW));
        }
        for c in conns.drain(..) {
            budget.give(c.window());
        }
        proptest::prop_assert_eq!(budget.free(), total);
    }
}

#[test]
fn a_budget_lends_what_it_has() {
    let b = RecvBudget::new(6);
    assert_eq!(b.low_mark(), START_WINDOW);
    assert!(b.try_take(2));
    assert!(!b.try_take(5), "all or nothing");
    assert_eq!(b.take_up_to(10), 2, "lending leaves the low mark free");
    assert_eq!(b.take_up_to(1), 0);
    assert!(!b.is_low());
    assert!(b.try_take(2), "room for one more connection is kept");
    assert!(b.is_low());
    b.give(6);
    assert_eq!(b.free(), 6);
}
