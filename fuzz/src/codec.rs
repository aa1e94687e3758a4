//! `codec_messages`: the body codec ([`Bincode`]) for every message kind the protocol carries.
//!
//! The first byte picks a mode; the rest is the mode's input:
//! - `0x00..=0x7f` **raw decode**: `Bincode::decode::<T>` of the rest, `T` one of [`RAW_TYPES`]
//!   (`b % RAW_TYPES`). Never panics; allocates at most [`decode_bound`] of the input length;
//!   a decoded value re-encodes to at most as many bytes and decodes back to itself; a decoded
//!   value with payloads also makes the framework round trip below.
//! - `0x80..=0xbf` **framework decode**: the rest is `n` (`% 5`), `n` attachments (length byte
//!   and bytes), then a body, decoded with [`Request::decode`] (attachment indices resolved
//!   against the attachments) as one of five request/response types. Never panics; bounded
//!   memory; every payload in a decoded value is one of the attachments.
//! - `0xc0..=0xff` **structured**: an [`Arbitrary`] request or response value (strings, ints,
//!   nested enums, `Vec`, `Option`, maps, payloads) and a frame kind. The value makes the
//!   framework round trip: payloads lifted out as attachments (indices in the body), framed,
//!   decoded by [`FrameCodec`], resolved by [`Request::decode`], equal to the original; the
//!   framework's own encoder ([`Reply::encode`]) gives the same body; and the plain codec round
//!   trip (payloads as bytes). Error responses (status and UTF-8 message) and control frames
//!   (no body) round trip through the frame codec.

use std::collections::BTreeMap;
use std::fmt::Debug;

use arbitrary::{Arbitrary, Unstructured};
use bytes::{Bytes, BytesMut};
use rpc_core::codec::{Bincode, Codec, MAX_DEPTH};
use rpc_core::wire::{FrameCodec, Header, Kind, Limits, Message};
use rpc_core::{Payload, Reply, Request, ServerErrorKind};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio_util::codec::Decoder;

use crate::alloc::peak_during;

/// A [`Payload`] with an [`Arbitrary`] impl. Serialises exactly as `Payload` does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FPayload(pub Payload);

impl<'a> Arbitrary<'a> for FPayload {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Self> {
        let n = u.int_in_range(0..=300usize)?;
        Ok(FPayload(Payload::copy_from_slice(u.bytes(n.min(u.len()))?)))
    }
}

/// An `f64` compared by its bits (so NaNs round trip as equal).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, Arbitrary)]
#[serde(transparent)]
pub struct F64Bits(pub f64);

impl PartialEq for F64Bits {
    fn eq(&self, o: &Self) -> bool {
        self.0.to_bits() == o.0.to_bits()
    }
}

/// A storage operation: the kind of nested, recursive argument a service takes. `P` is the
/// payload type: [`FPayload`] in values, `u32` (the attachment index) in the framework's
/// encoding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Arbitrary)]
pub enum Op<P> {
    Get {
        key: String,
        version: Option<u64>,
    },
    Put {
        key: String,
        value: P,
        ttl_ms: Option<u32>,
        tags: Vec<String>,
    },
    Delete(String),
    Scan {
        prefix: Vec<u8>,
        limit: u16,
        reverse: bool,
    },
    Cas {
        key: String,
        expect: Option<P>,
        new: P,
    },
    Batch(Vec<Op<P>>),
    Nop,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Arbitrary)]
pub enum Consistency {
    One,
    Quorum {
        n: u8,
    },
    All,
    Bounded {
        staleness_ms: u64,
        fallback: Option<Box<Consistency>>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Arbitrary)]
pub enum Attr {
    Int(i64),
    Text(String),
    Flag(bool),
    List(Vec<i32>),
    Ratio(F64Bits),
}

/// Request arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Arbitrary)]
pub struct Args<P> {
    pub tenant: String,
    pub request_id: u128,
    pub ops: Vec<Op<P>>,
    pub consistency: Consistency,
    pub deadline_us: Option<i64>,
    pub blocks: Vec<P>,
    pub attrs: BTreeMap<String, Attr>,
    pub weight: F64Bits,
    pub initial: char,
    pub tuple: (i16, u8, bool, ()),
}

/// A response value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Arbitrary)]
pub struct Stat<P> {
    pub size: u64,
    pub found: Vec<Option<P>>,
    pub versions: BTreeMap<u32, i8>,
}

/// Response: a result the method itself returns (an application error is a value too).
pub type Answer<P> = Result<Stat<P>, String>;

/// Values whose payloads the framework lifts out.
pub trait Lifted: Serialize + DeserializeOwned + PartialEq + Debug + Sized {
    /// The framework's encoding of the value: payloads replaced by attachment indices.
    type Wire: Serialize;
    /// Maps payloads to indices, appending them to `atts` in serialisation order.
    fn lift(&self, atts: &mut Vec<Payload>) -> Self::Wire;
    /// Bounds (lowest, highest) on how deep the decoder's guard counts this value's nesting
    /// (its options, newtypes, sequences, structs, maps and enums; `rpc_core::codec::MAX_DEPTH`
    /// is the most it decodes). The recursive types (`Op::Batch`, `Consistency::Bounded`) can
    /// nest without limit; the others are shallow.
    fn depth_bounds(&self) -> (usize, usize) {
        (0, 8)
    }
}

impl<P> Op<P> {
    /// How many `Batch` levels its deepest path has.
    pub fn levels(&self) -> usize {
        match self {
            Op::Batch(v) => 1 + v.iter().map(Op::levels).max().unwrap_or(0),
            _ => 0,
        }
    }
}

impl Consistency {
    /// How many `Bounded` levels with a fallback it has.
    pub fn levels(&self) -> usize {
        match self {
            Consistency::Bounded {
                fallback: Some(f), ..
            } => 1 + f.levels(),
            _ => 0,
        }
    }
}

/// Whether a decode's outcome fits a value of depth `bounds` ([`Lifted::depth_bounds`]):
/// within the limit it must decode, past it it must be refused as too deep (the guard's
/// error, never a crash), and in between either. `Some` with the value to compare if it
/// decoded.
fn within_depth<T, E: std::fmt::Display>(
    what: &str,
    bounds: (usize, usize),
    decoded: Result<T, E>,
) -> Option<T> {
    let (lowest, highest) = bounds;
    match decoded {
        Ok(v) => {
            assert!(
                lowest <= MAX_DEPTH,
                "{what}: a value nesting at least {lowest} levels decoded (limit {MAX_DEPTH})"
            );
            Some(v)
        }
        Err(e) if highest > MAX_DEPTH && e.to_string().contains("nests deeper than") => None,
        Err(e) => panic!("{what} of an encoded value failed: {e}"),
    }
}

fn lift_one(p: &FPayload, atts: &mut Vec<Payload>) -> u32 {
    atts.push(p.0.clone());
    (atts.len() - 1) as u32
}

impl Op<FPayload> {
    fn lift_op(&self, atts: &mut Vec<Payload>) -> Op<u32> {
        match self {
            Op::Get { key, version } => Op::Get {
                key: key.clone(),
                version: *version,
            },
            Op::Put {
                key,
                value,
                ttl_ms,
                tags,
            } => Op::Put {
                key: key.clone(),
                value: lift_one(value, atts),
                ttl_ms: *ttl_ms,
                tags: tags.clone(),
            },
            Op::Delete(k) => Op::Delete(k.clone()),
            Op::Scan {
                prefix,
                limit,
                reverse,
            } => Op::Scan {
                prefix: prefix.clone(),
                limit: *limit,
                reverse: *reverse,
            },
            Op::Cas { key, expect, new } => {
                let key = key.clone();
                let expect = expect.as_ref().map(|p| lift_one(p, atts));
                let new = lift_one(new, atts);
                Op::Cas { key, expect, new }
            }
            Op::Batch(v) => Op::Batch(v.iter().map(|o| o.lift_op(atts)).collect()),
            Op::Nop => Op::Nop,
        }
    }
}

impl Lifted for Op<FPayload> {
    type Wire = Op<u32>;
    fn lift(&self, atts: &mut Vec<Payload>) -> Op<u32> {
        self.lift_op(atts)
    }
    fn depth_bounds(&self) -> (usize, usize) {
        // each `Batch` level is an enum and a sequence; the innermost operation adds an enum,
        // its struct and an option at most
        let n = 2 * self.levels();
        (n, n + 4)
    }
}

impl Lifted for Args<FPayload> {
    type Wire = Args<u32>;
    fn depth_bounds(&self) -> (usize, usize) {
        // inside the struct: the operations' sequence, then as `Op`'s; the consistency's
        // enum, struct variant and option per `Bounded` level, and its innermost enum
        let ops = self.ops.iter().map(Op::levels).max().map_or(0, |l| 2 * l);
        let consistency = 3 * self.consistency.levels();
        let n = ops.max(consistency);
        (n, n + 8)
    }
    fn lift(&self, atts: &mut Vec<Payload>) -> Args<u32> {
        // Field order: ops before blocks, as serde visits them.
        let ops = self.ops.iter().map(|o| o.lift_op(atts)).collect();
        let blocks = self.blocks.iter().map(|p| lift_one(p, atts)).collect();
        Args {
            tenant: self.tenant.clone(),
            request_id: self.request_id,
            ops,
            consistency: self.consistency.clone(),
            deadline_us: self.deadline_us,
            blocks,
            attrs: self.attrs.clone(),
            weight: self.weight,
            initial: self.initial,
            tuple: self.tuple,
        }
    }
}

impl Lifted for Answer<FPayload> {
    type Wire = Answer<u32>;
    fn lift(&self, atts: &mut Vec<Payload>) -> Answer<u32> {
        self.as_ref()
            .map(|s| Stat {
                size: s.size,
                found: s
                    .found
                    .iter()
                    .map(|o| o.as_ref().map(|p| lift_one(p, atts)))
                    .collect(),
                versions: s.versions.clone(),
            })
            .map_err(Clone::clone)
    }
}

impl Lifted for Vec<FPayload> {
    type Wire = Vec<u32>;
    fn lift(&self, atts: &mut Vec<Payload>) -> Vec<u32> {
        self.iter().map(|p| lift_one(p, atts)).collect()
    }
}

impl Lifted for FPayload {
    type Wire = u32;
    fn lift(&self, atts: &mut Vec<Payload>) -> u32 {
        lift_one(self, atts)
    }
}

/// Most bytes a decode of `len` input bytes may hold at once. `Bincode` documents a claim
/// limit of the next power of two above twice the input (at least 4 KiB); serde's `Vec`
/// visitor may in addition pre-allocate up to 1 MiB from a length prefix before reading the
/// elements. This bound allows 16x the claim limit and two such pre-allocations.
pub fn decode_bound(len: usize) -> usize {
    16 * (2 * len).next_power_of_two().max(4096) + (2 << 20)
}

fn limits() -> Limits {
    Limits {
        max_message_size: 1 << 30,
        max_attachments: u16::MAX,
    }
}

fn kind_of(b: u8) -> Kind {
    [Kind::Request, Kind::Response][(b & 1) as usize]
}

/// Frames `msg`, decodes it with [`FrameCodec`] and checks it comes back whole.
fn through_frame_codec(msg: &Message) -> Message {
    let mut buf = BytesMut::new();
    msg.encode_into(&mut buf);
    let got = FrameCodec::new(limits())
        .decode(&mut buf)
        .expect("framing a valid message")
        .expect("a whole frame");
    assert!(buf.is_empty());
    assert_eq!(&got, msg, "frame codec round trip");
    got
}

/// The framework path for `v`: payloads out as attachments, body by the codec, framed,
/// decoded, indices resolved: must give `v` back.
pub fn framework_round_trip<T: Lifted>(v: &T, kind: Kind, id: u64, method: u32) {
    let mut atts = Vec::new();
    let wire = v.lift(&mut atts);
    let mut body = Vec::new();
    Bincode::encode(&wire, &mut body).expect("encoding a value");
    let body = Bytes::from(body);
    let msg = Message {
        header: Header {
            kind,
            flags: 0,
            id,
            method,
            aux: 0,
        },
        body: body.clone(),
        attachments: atts.into(),
    };
    let got = through_frame_codec(&msg);
    let decoded = Request::new(got.body, got.attachments).decode::<Bincode, T>("fuzz");
    let Some(back) = within_depth("framework decode", v.depth_bounds(), decoded) else {
        // refused as nesting too deep: bounded, as documented
        return;
    };
    assert_eq!(&back, v, "framework round trip");
    // The framework's own encoder must produce the same body (attachment indices in the
    // order the codec meets the payloads). `Reply` keeps its fields private; its Debug shows
    // the body.
    let reply = Reply::encode::<Bincode, T>(v).expect("Reply::encode");
    let dbg = format!("{reply:?}");
    assert!(
        dbg.contains(&format!("{body:?}")),
        "Reply::encode gave another body than the lifted encoding: {dbg} vs {body:?}"
    );
}

/// The plain codec round trip (payloads as bytes).
pub fn plain_round_trip<T: Lifted>(v: &T) {
    let mut out = Vec::new();
    Bincode::encode(v, &mut out).expect("encoding a value");
    if let Some(back) = within_depth("plain decode", v.depth_bounds(), Bincode::decode::<T>(&out)) {
        assert_eq!(&back, v, "plain round trip");
    }
}

/// `Bincode::decode::<T>` of arbitrary bytes.
fn raw<T: Serialize + DeserializeOwned + PartialEq + Debug>(bytes: &[u8]) -> Option<T> {
    let (r, peak) = peak_during(|| Bincode::decode::<T>(bytes));
    assert!(
        peak <= decode_bound(bytes.len()),
        "decoding {} bytes as {} held {peak} bytes at once (bound {})",
        bytes.len(),
        std::any::type_name::<T>(),
        decode_bound(bytes.len())
    );
    let v = r.ok()?;
    let mut again = Vec::new();
    Bincode::encode(&v, &mut again).expect("re-encoding a decoded value");
    assert!(
        again.len() <= bytes.len(),
        "re-encoding is longer than the input"
    );
    let back: T = Bincode::decode(&again).expect("decoding a re-encoded value");
    assert_eq!(back, v, "decode(encode(decode(x))) != decode(x)");
    Some(v)
}

fn raw_lifted<T: Lifted + Send>(bytes: &[u8], kind: Kind) {
    if let Some(v) = on_worker_stack(|| raw::<T>(bytes)) {
        framework_round_trip(&v, kind, 1, 0x1234_5678);
    }
}

use crate::stack::on_worker_stack;

/// Number of types of the raw-decode mode.
pub const RAW_TYPES: u8 = 13;

fn raw_mode(sel: u8, rest: &[u8]) {
    let kind = kind_of(sel >> 4);
    match sel % RAW_TYPES {
        0 => drop(raw::<String>(rest)),
        1 => drop(raw::<Vec<u8>>(rest)),
        2 => drop(raw::<Vec<String>>(rest)),
        3 => drop(raw::<Option<Vec<u64>>>(rest)),
        4 => drop(raw::<(u64, String, bool, char)>(rest)),
        5 => drop(raw::<BTreeMap<String, Vec<u32>>>(rest)),
        6 => drop(raw::<Vec<Vec<u64>>>(rest)),
        7 => drop(raw::<(i128, Consistency, Attr)>(rest)),
        8 => raw_lifted::<FPayload>(rest, kind),
        9 => raw_lifted::<Vec<FPayload>>(rest, kind),
        10 => raw_lifted::<Op<FPayload>>(rest, kind),
        11 => raw_lifted::<Args<FPayload>>(rest, kind),
        _ => raw_lifted::<Answer<FPayload>>(rest, kind),
    }
}

fn framework_decode<T: Lifted + Send>(body: &[u8], atts: &[Payload]) {
    let req = Request::new(Bytes::copy_from_slice(body), atts.to_vec());
    let r = on_worker_stack(|| {
        let (r, peak) = peak_during(|| req.decode::<Bincode, T>("fuzz"));
        assert!(
            peak <= decode_bound(body.len()),
            "decoding a {}-byte body as {} held {peak} bytes at once (bound {})",
            body.len(),
            std::any::type_name::<T>(),
            decode_bound(body.len())
        );
        r
    });
    if let Ok(v) = r {
        let mut seen = Vec::new();
        v.lift(&mut seen);
        for p in &seen {
            assert!(
                atts.contains(p),
                "a decoded payload is none of the frame's attachments"
            );
        }
        framework_round_trip(&v, Kind::Request, 7, 7);
    }
}

/// `n` attachments off `r`, each a length byte and that many bytes.
pub fn read_attachments(r: &mut crate::reader::Reader<'_>, n: u8) -> Vec<Payload> {
    (0..n)
        .map(|_| {
            let len = r.u8() as usize;
            Payload::copy_from_slice(r.bytes(len))
        })
        .collect()
}

fn framework_mode(sel: u8, rest: &[u8]) {
    let mut r = crate::reader::Reader::new(rest);
    let n = r.u8() % 5;
    let atts = read_attachments(&mut r, n);
    let body = r.rest();
    match sel % 5 {
        0 => framework_decode::<Args<FPayload>>(body, &atts),
        1 => framework_decode::<Op<FPayload>>(body, &atts),
        2 => framework_decode::<Vec<FPayload>>(body, &atts),
        3 => framework_decode::<FPayload>(body, &atts),
        _ => framework_decode::<Answer<FPayload>>(body, &atts),
    }
}

/// One structured message of each kind.
#[derive(Debug, Arbitrary)]
enum Structured {
    Request {
        id: u64,
        method: u32,
        args: Args<FPayload>,
    },
    RequestOp {
        id: u64,
        op: Op<FPayload>,
    },
    Response {
        id: u64,
        answer: Answer<FPayload>,
    },
    ResponseBlocks {
        id: u64,
        blocks: Vec<FPayload>,
    },
    ErrorResponse {
        id: u64,
        status: u32,
        message: String,
    },
    Control {
        kind: u8,
        id: u64,
    },
}

fn structured_mode(rest: &[u8]) {
    let Ok(s) = Structured::arbitrary_take_rest(Unstructured::new(rest)) else {
        return;
    };
    match s {
        Structured::Request { id, method, args } => {
            framework_round_trip(&args, Kind::Request, id, method);
            plain_round_trip(&args);
        }
        Structured::RequestOp { id, op } => {
            framework_round_trip(&op, Kind::Request, id, 1);
            plain_round_trip(&op);
        }
        Structured::Response { id, answer } => {
            framework_round_trip(&answer, Kind::Response, id, 0);
            plain_round_trip(&answer);
        }
        Structured::ResponseBlocks { id, blocks } => {
            framework_round_trip(&blocks, Kind::Response, id, 0);
            plain_round_trip(&blocks);
        }
        Structured::ErrorResponse {
            id,
            status,
            message,
        } => {
            let status = status.max(1);
            let mut msg = Message::control(Kind::Response, id);
            msg.header.aux = status;
            msg.body = Bytes::from(message.clone().into_bytes());
            let got = through_frame_codec(&msg);
            // What a client makes of it.
            let kind = ServerErrorKind::from_code(got.header.aux);
            if (1..=9).contains(&status) {
                assert_eq!(kind.code(), status, "status code round trip");
            } else {
                assert_eq!(kind, ServerErrorKind::Internal);
            }
            assert_eq!(String::from_utf8_lossy(&got.body), message);
        }
        Structured::Control { kind, id } => {
            let kind = [Kind::Cancel, Kind::Ping, Kind::Pong, Kind::GoAway][kind as usize % 4];
            let got = through_frame_codec(&Message::control(kind, id));
            assert!(got.body.is_empty() && got.attachments.is_empty());
        }
    }
}

/// The target.
pub fn run(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    match sel {
        0x00..=0x7f => raw_mode(sel, rest),
        0x80..=0xbf => framework_mode(sel, rest),
        _ => structured_mode(rest),
    }
}
