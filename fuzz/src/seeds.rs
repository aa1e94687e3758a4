//! The checked-in seed corpus (`fuzz/corpus/<target>/<name>`), generated here so it stays
//! valid as the wire format evolves: `FUZZ_WRITE_SEEDS=1 cargo test --test seeds` rewrites it,
//! a plain `cargo test` checks that the files are current. Small valid inputs only.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use rpc_core::codec::{Bincode, Codec};
use rpc_core::wire::{Header, Kind, Message};
use rpc_core::Payload;

use crate::codec::{Args, Attr, Consistency, F64Bits, FPayload, Lifted, Op as COp, Stat};
use crate::reader::Writer;
use crate::rendezvous::{write_op, IdSel, MsgSpec, Op};

/// One seed: target, file name, bytes.
pub type Seed = (&'static str, String, Vec<u8>);

fn frame(kind: Kind, id: u64, method: u32, aux: u32, body: &[u8], atts: &[&[u8]]) -> Message {
    Message {
        header: Header {
            kind,
            flags: 0,
            id,
            method,
            aux,
        },
        body: Bytes::copy_from_slice(body),
        attachments: atts.iter().map(|a| Payload::copy_from_slice(a)).collect(),
    }
}

fn wire(msgs: &[&Message]) -> Vec<u8> {
    let mut b = BytesMut::new();
    for m in msgs {
        m.encode_into(&mut b);
    }
    b.to_vec()
}

fn frame_seeds() -> Vec<Seed> {
    let req = frame(
        Kind::Request,
        1,
        0xdead_beef,
        250,
        b"args",
        &[b"block-0", b"", b"b2"],
    );
    let resp = frame(Kind::Response, 1, 0, 0, b"result", &[b"value"]);
    let err = frame(Kind::Response, 2, 0, 2, b"bad request: no such key", &[]);
    let ping = Message::control(Kind::Ping, 3);
    let cancel = Message::control(Kind::Cancel, 1);
    let away = Message::control(Kind::GoAway, 0);
    let mut bad_magic = wire(&[&ping]);
    bad_magic[0] = b'X';
    let mut huge = wire(&[&req]);
    huge[24..32].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let mut bad_table = wire(&[&resp]);
    bad_table[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    let truncated = {
        let w = wire(&[&req]);
        w[..w.len() - 3].to_vec()
    };
    let with = |cfg: [u8; 4], stream: Vec<u8>| {
        let mut v = cfg.to_vec();
        v.extend(stream);
        v
    };
    // cfg: 20 -> 1 MiB limit, 8 attachments; chunk seed; 0xff = whole stream.
    vec![
        ("request_whole", with([20, 8, 0, 0xff], wire(&[&req]))),
        ("request_bytewise", with([20, 8, 1, 0], wire(&[&req]))),
        (
            "conversation_chunked",
            with([20, 8, 7, 5], wire(&[&req, &resp, &err, &ping])),
        ),
        (
            "control_frames",
            with([16, 0, 3, 2], wire(&[&cancel, &away, &ping])),
        ),
        ("error_response", with([12, 1, 0, 0xff], wire(&[&err]))),
        ("bad_magic", with([20, 8, 0, 0xff], bad_magic)),
        ("too_large", with([20, 8, 0, 0xff], huge)),
        ("bad_table", with([20, 8, 5, 9], bad_table)),
        ("truncated", with([20, 8, 2, 30], truncated)),
        ("small_limit", with([6, 2, 0, 0xff], wire(&[&resp]))),
    ]
    .into_iter()
    .map(|(n, v)| ("frame_decoder", n.to_string(), v))
    .collect()
}

fn sample_args() -> Args<FPayload> {
    let p = |b: &[u8]| FPayload(Payload::copy_from_slice(b));
    let mut attrs = BTreeMap::new();
    attrs.insert("region".to_string(), Attr::Text("eu-1".into()));
    attrs.insert("replicas".to_string(), Attr::Int(3));
    Args {
        tenant: "acme".into(),
        request_id: 42,
        ops: vec![
            COp::Get {
                key: "k1".into(),
                version: Some(7),
            },
            COp::Put {
                key: "k2".into(),
                value: p(b"v2"),
                ttl_ms: None,
                tags: vec!["hot".into()],
            },
            COp::Batch(vec![COp::Delete("k3".into()), COp::Nop]),
        ],
        consistency: Consistency::Bounded {
            staleness_ms: 10,
            fallback: Some(Box::new(Consistency::Quorum { n: 2 })),
        },
        deadline_us: Some(-1),
        blocks: vec![p(b"block"), p(b"")],
        attrs,
        weight: F64Bits(0.5),
        initial: 'é',
        tuple: (-3, 4, true, ()),
    }
}

fn enc<T: serde::Serialize + ?Sized>(v: &T) -> Vec<u8> {
    let mut out = Vec::new();
    Bincode::encode(v, &mut out).expect("encode");
    out
}

fn codec_seeds() -> Vec<Seed> {
    let args = sample_args();
    let op = COp::Cas {
        key: "c".into(),
        expect: Some(FPayload(Payload::from_static(b"old"))),
        new: FPayload(Payload::from_static(b"new")),
    };
    let answer: Result<Stat<FPayload>, String> = Ok(Stat {
        size: 3,
        found: vec![Some(FPayload(Payload::from_static(b"abc"))), None],
        versions: [(1, -1)].into_iter().collect(),
    });
    let raw: Vec<(u8, &str, Vec<u8>)> = vec![
        (0, "string", enc("hello")),
        (1, "bytes", enc(&vec![1u8, 2, 3])),
        (2, "strings", enc(&vec!["a".to_string(), "bc".into()])),
        (3, "option_u64s", enc(&Some(vec![1u64, u64::MAX]))),
        (4, "tuple", enc(&(9u64, "x".to_string(), true, 'z'))),
        (
            5,
            "map",
            enc(&[("k".to_string(), vec![1u32, 2])]
                .into_iter()
                .collect::<BTreeMap<_, _>>()),
        ),
        (6, "nested_vecs", enc(&vec![vec![1u64], vec![]])),
        (
            7,
            "enums",
            enc(&(-1i128, Consistency::All, Attr::List(vec![1, -1]))),
        ),
        (8, "payload", enc(&FPayload(Payload::from_static(b"bulk")))),
        (
            9,
            "payloads",
            enc(&vec![
                FPayload(Payload::from_static(b"a")),
                FPayload(Payload::new()),
            ]),
        ),
        (10, "op", enc(&op)),
        (11, "args", enc(&args)),
        (12, "answer", enc(&answer)),
    ];
    let mut out: Vec<Seed> = raw
        .into_iter()
        .map(|(sel, n, b)| {
            let mut v = vec![sel];
            v.extend(b);
            ("codec_messages", format!("raw_{n}"), v)
        })
        .collect();
    // Framework mode: attachments, then the body with indices.
    let fw = |sel: u8, body_wire: Vec<u8>, atts: Vec<Payload>| {
        let mut v = vec![0x80 + sel, atts.len() as u8];
        for a in &atts {
            v.push(a.len() as u8);
            v.extend_from_slice(a);
        }
        v.extend(body_wire);
        v
    };
    let mut atts = Vec::new();
    let w = args.lift(&mut atts);
    out.push((
        "codec_messages",
        "framework_args".into(),
        fw(0, enc(&w), atts),
    ));
    let mut atts = Vec::new();
    let w = op.lift(&mut atts);
    out.push((
        "codec_messages",
        "framework_op".into(),
        fw(1, enc(&w), atts),
    ));
    let mut atts = Vec::new();
    let w = answer.lift(&mut atts);
    out.push((
        "codec_messages",
        "framework_answer".into(),
        fw(4, enc(&w), atts),
    ));
    // Structured mode: any bytes make some value; a few fixed patterns.
    for (i, pat) in [
        [0x11u8, 0x5a, 0xc3, 0x07],
        [0xff, 0x00, 0x80, 0x42],
        [1, 2, 3, 4],
    ]
    .iter()
    .enumerate()
    {
        let mut v = vec![0xc0 + i as u8];
        for k in 0..64u8 {
            v.push(pat[k as usize % 4].wrapping_mul(k.wrapping_add(1)));
        }
        out.push(("codec_messages", format!("structured_{i}"), v));
    }
    out
}

fn m(atts: &[u16]) -> MsgSpec {
    MsgSpec {
        kind: 0,
        id: 1,
        body: 4,
        atts: atts.to_vec(),
    }
}

fn rendezvous_seeds() -> Vec<Seed> {
    use IdSel::{Any, Known};
    // slots 8, 16 attachments, 1 MiB.
    let head = [6u8, 16, 10];
    let scripts: Vec<(&str, Vec<Op>)> = vec![
        (
            "pull_out",
            vec![
                Op::SendPull(m(&[100, 0])),
                Op::PeerFin {
                    credits: 1,
                    id: Known(0),
                },
                Op::SendPull(m(&[3000])),
                Op::PeerCredit { credits: 1 },
                Op::PeerFin {
                    credits: 0,
                    id: Known(1),
                },
            ],
        ),
        (
            "push_out",
            vec![
                Op::SendPush(m(&[5000])),
                Op::PeerCts {
                    credits: 1,
                    id: Known(0),
                    exact: true,
                    lens: vec![],
                },
                Op::SendPush(m(&[1, 2])),
                Op::PeerCts {
                    credits: 1,
                    id: Known(1),
                    exact: false,
                    lens: vec![1, 3],
                },
            ],
        ),
        (
            "pull_in",
            vec![
                Op::PeerPullRts {
                    credits: 0,
                    id: Any(42),
                    msg: m(&[10, 20]),
                    addr: 0x1000,
                    rkey: 5,
                    tamper: false,
                },
                Op::ReadDone(Known(0)),
                Op::ReadDone(Known(0)),
                Op::ReadDone(Known(0)),
                Op::ReturnCredits,
            ],
        ),
        (
            "push_in",
            vec![
                Op::PeerPushRts {
                    credits: 0,
                    id: Any(7),
                    msg: m(&[300]),
                },
                Op::PeerPushDone {
                    credits: 0,
                    id: Known(0),
                },
                Op::PeerEager {
                    credits: 0,
                    msg: m(&[1]),
                },
            ],
        ),
        (
            "forged",
            vec![
                Op::SendPull(m(&[9])),
                Op::PeerFin {
                    credits: 0,
                    id: Any(12345),
                },
                Op::PeerRaw(vec![5, 0, 1, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0]),
                Op::PeerEager {
                    credits: 9,
                    msg: m(&[]),
                },
            ],
        ),
        (
            "eager_batch",
            vec![
                Op::PeerEagerBatch {
                    credits: 1,
                    msgs: vec![m(&[]), m(&[3]), m(&[0, 2])],
                },
                Op::PeerEagerBatch {
                    credits: 0,
                    msgs: vec![],
                },
            ],
        ),
        (
            "refuse_and_disconnect",
            vec![
                Op::SendPull(m(&[64])),
                Op::SendPush(m(&[65])),
                Op::PeerRefuse {
                    credits: 1,
                    id: Known(0),
                    reason: 2,
                },
                Op::SendPull(m(&[66, 67])),
                Op::Disconnect,
                Op::SendPush(m(&[1])),
            ],
        ),
        (
            "duplicate_incoming",
            vec![
                Op::PeerPushRts {
                    credits: 0,
                    id: Any(5),
                    msg: m(&[10]),
                },
                Op::PeerPullRts {
                    credits: 0,
                    id: Any(5),
                    msg: m(&[10]),
                    addr: 0,
                    rkey: 1,
                    tamper: false,
                },
                Op::PeerPullRts {
                    credits: 0,
                    id: Any(6),
                    msg: m(&[10, 11]),
                    addr: 0,
                    rkey: 1,
                    tamper: true,
                },
            ],
        ),
        (
            "plans",
            vec![
                Op::Plan {
                    msg: m(&[10]),
                    slot: 4096,
                    threshold: 4096,
                    pull: true,
                },
                Op::Plan {
                    msg: m(&[10_000]),
                    slot: 512,
                    threshold: 512,
                    pull: false,
                },
                Op::Plan {
                    msg: m(&[1000]),
                    slot: 4096,
                    threshold: 512,
                    pull: true,
                },
                Op::Plan {
                    msg: m(&[1, 2, 3, 4, 5]),
                    slot: 100,
                    threshold: 64,
                    pull: true,
                },
            ],
        ),
    ];
    scripts
        .into_iter()
        .map(|(n, ops)| {
            let mut w = Writer::default();
            w.bytes(&head);
            for op in &ops {
                write_op(&mut w, op);
            }
            ("rendezvous", n.to_string(), w.0)
        })
        .collect()
}

/// `direct_bodies`: a type byte, the attachments (count, then each one's length and bytes),
/// the body.
fn direct_seeds() -> Vec<Seed> {
    let seed = |name: &str, ty: u8, atts: &[&[u8]], body: &[u8]| {
        let mut w = Writer(Vec::new());
        w.u8(ty).u8(atts.len() as u8);
        for a in atts {
            w.u8(a.len() as u8).bytes(a);
        }
        w.bytes(body);
        ("direct_bodies", name.to_string(), w.0)
    };
    vec![
        seed("u64-at-tags", 3, &[], &[252, 0, 0, 1, 0]),
        seed("payload", 7, &[b"block"], &[0]),
        seed("key-and-value", 9, &[b"value"], &[3, b'k', b'e', b'y', 0]),
        seed("some-payload", 8, &[b"", b"x"], &[1, 1]),
        seed("mixed", 10, &[], &[251, 0, 1, 7, 1, 1, 2, b'o', b'k']),
        seed("missing-attachment", 11, &[b"a"], &[0, 1, 5]),
    ]
}

/// All seeds.
pub fn all() -> Vec<Seed> {
    let mut v = frame_seeds();
    v.extend(codec_seeds());
    v.extend(direct_seeds());
    v.extend(rendezvous_seeds());
    v
}
