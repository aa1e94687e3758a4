//! The RDMA message protocol, free of I/O: how [`Message`]s travel over a reliable-connected
//! queue pair as SENDs into pre-posted receive slots, and how large ones move by rendezvous.
//!
//! A transport (`transport-rdma`) owns the verbs objects and calls in here:
//! - [`Plan::for_message`] decides whether a message goes eager (one SEND) or by rendezvous.
//! - [`Packet`] is what travels in a receive slot; [`Packet::parse`] validates everything a
//!   peer sends before any buffer is touched.
//! - [`Credits`] keeps the sender from ever overrunning the receiver's posted slots (so no RNR
//!   retries in normal work) and tells the receiver when to return credits.
//! - [`Transfers`] tracks rendezvous transfers in both directions and refuses peer messages
//!   that name a transfer it does not know or lengths that do not match: a forged or stale
//!   message is a [`ProtocolViolation`] on that connection only.
//!
//! # Rendezvous, both directions
//! Receiver-pull (`PullRts`): the sender exposes each attachment's registered buffer (address,
//! length, rkey, read access) in the packet with the frame's inline part (header, table,
//! body). The receiver takes pool buffers, RDMA-READs every segment, delivers the message with
//! the pool buffers as its payloads, and sends `Fin` so the sender releases its buffers.
//!
//! Sender-push (`PushRts` → `Cts` → writes → `PushDone`): the sender announces the segment
//! lengths with the inline part; the receiver grants pool buffers (write access) in `Cts`; the
//! sender RDMA-WRITEs each and then signals `PushDone` (a SEND after the writes on the same
//! queue pair, which RC ordering delivers after the data is placed; on InfiniBand/RoCE a
//! transport may use WRITE_WITH_IMM instead, iWARP has none). The receiver then delivers and
//! revokes the grant.
//!
//! # Ordering
//! A rendezvous message is delivered when its bulk data has arrived, so an eager message sent
//! after it may be delivered first. The rpc layer does not depend on order between messages:
//! responses are matched by request id, and a `Cancel` that overtakes its request only means
//! the late request's answer is dropped by the caller.
//!
//! # Packet layout (little endian)
//! ```text
//!  0     1      2        4        8             16
//!  +-----+------+--------+--------+-------------+------------------------------+
//!  |type |flags |credits |   n    | transfer id | type-specific                |
//!  +-----+------+--------+--------+-------------+------------------------------+
//!  Eager:    the whole rpc frame (wire::Message encoding)
//!  PullRts:  n x (addr u64, len u64, rkey u32), then the frame's inline part
//!  PushRts:  n x (len u64), then the frame's inline part
//!  Cts:      n x (addr u64, len u64, rkey u32)
//!  Fin, PushDone, Credit: nothing;  Refuse: reason u32
//! ```
//! A lone eager frame whose flags are zero and which has at most 255 attachments travels in the
//! short form instead, with both headers folded into 22 bytes (the frame's magic, version and
//! length, and the packet's unused count and transfer id, left out):
//! ```text
//!  0     1      2        4     5        6            14       18     22
//!  +-----+------+--------+-----+--------+------------+--------+------+------------------+
//!  |type |flags |credits |kind |n_attach| request id | method | aux  | table, body, ... |
//!  +-----+------+--------+-----+--------+------------+--------+------+------------------+
//! ```
//! The frame's length is what the packet holds after the 22 bytes. A small call's request and
//! answer (an empty payload: 57 bytes in the long form, 31 in this one) take one SEND each,
//! and under emulation each byte of a SEND costs the device's work in the sender's post:
//! docs/latency.md, "A shorter packet".
//! `credits` returns that many receive slots to the peer on every packet. The frame's inline
//! part is its header, attachment table and body; the attachments are the `n` segments, in
//! order, with exactly the table's lengths.

use std::collections::HashMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::payload::Payload;
use crate::wire::{
    Attachments, FrameError, FrameRef, Header, Kind, Limits, Message, WireHeader, HEADER_LEN,
};

/// Size of the packet header.
pub const PACKET_HEADER_LEN: usize = 16;
/// Size of a short eager packet's header: the packet's and its frame's, folded into one (see
/// the module docs).
pub const SHORT_HEADER_LEN: usize = 22;
/// How many bytes the short form saves over the long one.
const SHORT_SAVES: u64 = (PACKET_HEADER_LEN + HEADER_LEN - SHORT_HEADER_LEN) as u64;
const SEGMENT_LEN: usize = 20;

/// A peer broke the RDMA message protocol. The connection it came on is closed; nothing else
/// is affected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// Fewer bytes than a packet header, or than the packet's type needs.
    #[error("truncated {what}: {len} bytes")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// How many bytes there were.
        len: usize,
    },
    /// Unknown packet type.
    #[error("unknown packet type {0}")]
    UnknownType(u8),
    /// The rpc frame inside is invalid.
    #[error("bad frame: {0}")]
    Frame(#[from] FrameError),
    /// Segment count or lengths do not match the frame's attachment table.
    #[error("transfer {id}: {why}")]
    Mismatch {
        /// The transfer.
        id: u64,
        /// What did not match.
        why: &'static str,
    },
    /// A message names a transfer that is not in progress (stale or forged).
    #[error("transfer {0} is not in progress (stale or forged)")]
    UnknownTransfer(u64),
    /// A transfer id was reused while still in progress.
    #[error("transfer {0} is already in progress")]
    DuplicateTransfer(u64),
    /// The peer sent more than its credits allow (it would overrun the posted slots).
    #[error("peer sent without credit")]
    NoCredit,
    /// The peer refused a transfer.
    #[error("peer refused transfer {id}: {reason}")]
    Refused {
        /// The transfer.
        id: u64,
        /// Its reason code.
        reason: u32,
    },
}

/// A remote buffer: where, how long, and the key that grants access to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Remote virtual address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// Reason codes of [`Packet::Refuse`].
pub mod refuse {
    /// The message is larger than the receiver accepts.
    pub const TOO_LARGE: u32 = 1;
    /// The receiver has no buffers for it now and will not wait.
    pub const NO_BUFFERS: u32 = 2;
}

/// What travels in one receive slot.
#[derive(Debug, Clone, PartialEq)]
pub enum Packet {
    /// A whole message.
    Eager(Message),
    /// Several whole messages in one slot (a sender with several small messages ready sends
    /// them with one SEND). In order; at least one.
    EagerBatch(Vec<Message>),
    /// Receiver-pull: read these segments, then send `Fin`.
    PullRts {
        /// Transfer id (the sender's).
        id: u64,
        /// The frame's header, table and body; attachments are the segments.
        head: Inline,
        /// The sender's buffers, one per attachment.
        segments: Vec<Segment>,
    },
    /// Sender-push: grant buffers of these lengths with `Cts`.
    PushRts {
        /// Transfer id (the sender's).
        id: u64,
        /// The frame's header, table and body.
        head: Inline,
    },
    /// Grant for a `PushRts`: write the attachments here.
    Cts {
        /// The transfer.
        id: u64,
        /// One buffer per attachment.
        segments: Vec<Segment>,
    },
    /// The receiver has read a pulled transfer: the sender may reuse its buffers.
    Fin {
        /// The transfer.
        id: u64,
    },
    /// The sender has written a pushed transfer.
    PushDone {
        /// The transfer.
        id: u64,
    },
    /// Only returns credits.
    Credit,
    /// The transfer cannot be taken.
    Refuse {
        /// The transfer.
        id: u64,
        /// A [`refuse`] code.
        reason: u32,
    },
}

/// The inline part of a rendezvous message: its header, body and attachment lengths.
#[derive(Debug, Clone, PartialEq)]
pub struct Inline {
    /// The frame's header and lengths.
    pub wire: WireHeader,
    /// The body.
    pub body: Bytes,
    /// Attachment lengths, from the table.
    pub lens: Vec<u64>,
    /// The message's body travels as its last segment, not inline (the announcement carries
    /// [`Packet::mark_body_last`]'s mark; see [`lift_body`]): `body` is empty, and the last
    /// of the attachments becomes the body.
    pub body_last: bool,
}

impl Inline {
    /// Assembles the message once its attachments have arrived (the body too, for one whose
    /// body travelled as its last segment: see [`lift_body`]).
    pub fn into_message(self, attachments: impl Into<Attachments>) -> Message {
        let attachments = attachments.into();
        debug_assert_eq!(attachments.len(), self.lens.len());
        if self.body_last {
            let mut all = attachments.into_vec();
            // (`parse` refuses a mark on an announcement with no segment)
            let body = all.pop().map(Bytes::from).unwrap_or_default();
            return Message {
                header: self.wire.header,
                body,
                attachments: all.into(),
            };
        }
        Message {
            header: self.wire.header,
            body: self.body,
            attachments,
        }
    }

    /// Total bytes of the attachments.
    pub fn bulk_len(&self) -> u64 {
        self.lens.iter().sum()
    }
}

const T_EAGER: u8 = 1;
const T_PULL_RTS: u8 = 2;
const T_PUSH_RTS: u8 = 3;
const T_CTS: u8 = 4;
const T_FIN: u8 = 5;
const T_PUSH_DONE: u8 = 6;
const T_CREDIT: u8 = 7;
const T_REFUSE: u8 = 8;
const T_EAGER_BATCH: u8 = 9;
/// An eager packet of one frame in the short form (see the module docs).
const T_EAGER_SHORT: u8 = 10;

/// Header flag: the sender was blocked on send credits (see [`Packet::mark_starved`]).
const FLAG_STARVED: u8 = 1;
/// Header flag of a rendezvous announcement: the message's body is its last segment (see
/// [`lift_body`] and [`Packet::mark_body_last`]).
const FLAG_BODY_LAST: u8 = 2;

/// `msg` with its body moved to the end of its attachments, for a message whose body does
/// not fit a receive slot beside its header and table ([`Plan::for_message`] says
/// [`InlineTooLarge`]): the body then travels by rendezvous like the attachments, and the
/// receiver puts it back ([`Inline::into_message`]). The announcement that carries it must be
/// marked with [`Packet::mark_body_last`]. Over TCP such a body simply goes inline; over RDMA
/// this is what lets the same call go too.
pub fn lift_body(msg: Message) -> Message {
    let Message {
        header,
        body,
        mut attachments,
    } = msg;
    attachments.push(Payload::from(body));
    Message {
        header,
        body: Bytes::new(),
        attachments,
    }
}

fn put_header<B: BufMut>(out: &mut B, ty: u8, credits: u16, n: u32, id: u64) {
    out.put_u8(ty);
    out.put_u8(0);
    out.put_u16_le(credits);
    out.put_u32_le(n);
    out.put_u64_le(id);
}

fn put_segments(out: &mut BytesMut, segments: &[Segment]) {
    for s in segments {
        out.put_u64_le(s.addr);
        out.put_u64_le(s.len);
        out.put_u32_le(s.rkey);
    }
}

/// Writes a message's inline part (header, table, body).
fn put_inline(out: &mut BytesMut, msg: &Message) {
    msg.encode_head(out);
    out.extend_from_slice(&msg.body);
}

/// Whether `msg` travels alone in the short eager form (see the module docs).
fn is_short(msg: &Message) -> bool {
    msg.header.flags == 0 && msg.attachments.len() <= u8::MAX as usize
}

/// The header of `msg`'s short eager packet (see [`is_short`]).
fn short_head(credits: u16, msg: &Message) -> [u8; SHORT_HEADER_LEN] {
    let h = &msg.header;
    let mut head = [0u8; SHORT_HEADER_LEN];
    head[0] = T_EAGER_SHORT;
    head[2..4].copy_from_slice(&credits.to_le_bytes());
    head[4] = h.kind as u8;
    head[5] = msg.attachments.len() as u8;
    head[6..14].copy_from_slice(&h.id.to_le_bytes());
    head[14..18].copy_from_slice(&h.method.to_le_bytes());
    head[18..22].copy_from_slice(&h.aux.to_le_bytes());
    head
}

/// Reads a short eager packet's header `head` for a frame of `len` bytes after it, checked as
/// [`WireHeader::parse`] checks a frame header.
fn short_wire(
    head: &[u8; SHORT_HEADER_LEN],
    len: usize,
    limits: &Limits,
) -> Result<WireHeader, FrameError> {
    let kind = Kind::from_u8(head[4]).ok_or(FrameError::UnknownKind(head[4]))?;
    let header = Header {
        kind,
        flags: 0,
        id: u64::from_le_bytes(head[6..14].try_into().expect("8 bytes")),
        method: u32::from_le_bytes(head[14..18].try_into().expect("4 bytes")),
        aux: u32::from_le_bytes(head[18..22].try_into().expect("4 bytes")),
    };
    WireHeader::check(header, u16::from(head[5]), len as u64, limits)
}

impl Packet {
    /// Encodes an eager packet carrying all of `msg` ([`Packet::eager_len`] bytes, in the
    /// short form where it can: see the module docs): into a growing buffer, or a slice with
    /// that much room.
    pub fn encode_eager<B: BufMut>(out: &mut B, credits: u16, msg: &Message) {
        if is_short(msg) {
            out.put_slice(&short_head(credits, msg));
            msg.encode_rest_into(out);
        } else {
            put_header(out, T_EAGER, credits, 0, 0);
            msg.encode_into(out);
        }
    }

    /// [`encode_eager`](Self::encode_eager) into `out`, which must be exactly
    /// [`Packet::eager_len`] bytes long (it panics otherwise; see [`Message::encode_exact`]):
    /// a small message's send path.
    #[inline(always)]
    pub fn encode_eager_exact(out: &mut [u8], credits: u16, msg: &Message) {
        if is_short(msg) {
            let (head, rest) = out
                .split_first_chunk_mut::<SHORT_HEADER_LEN>()
                .expect("room for the packet header");
            *head = short_head(credits, msg);
            msg.encode_rest_exact(rest);
            return;
        }
        let (head, frame) = out
            .split_first_chunk_mut::<PACKET_HEADER_LEN>()
            .expect("room for the packet header");
        let mut h = [0u8; PACKET_HEADER_LEN];
        h[0] = T_EAGER;
        h[2..4].copy_from_slice(&credits.to_le_bytes());
        *head = h;
        msg.encode_exact(frame);
    }

    /// Bytes of the eager packet that carries `msg` alone ([`encode_eager`](Self::encode_eager)).
    pub fn eager_len(msg: &Message) -> u64 {
        Packet::packet_len(std::slice::from_ref(msg), msg.wire_len())
    }

    /// Bytes of the eager packet that carries `msgs`, whose frames total `frames` bytes (their
    /// [`Message::wire_len`]s): one alone, as [`eager_len`](Self::eager_len) says, or a batch
    /// ([`batch_len`](Self::batch_len)). At most `batch_len(frames)`, so a test against that
    /// bound holds for the packet too.
    pub fn packet_len(msgs: &[Message], frames: u64) -> u64 {
        match msgs {
            [one] if is_short(one) => Packet::batch_len(frames) - SHORT_SAVES,
            _ => Packet::batch_len(frames),
        }
    }

    /// Encodes an eager packet carrying all of `msgs`, one after the other (see
    /// [`Packet::EagerBatch`]; [`Packet::batch_len`] says how much room they take).
    pub fn encode_eager_batch<B: BufMut>(out: &mut B, credits: u16, msgs: &[Message]) {
        put_header(out, T_EAGER_BATCH, credits, msgs.len() as u32, 0);
        for m in msgs {
            m.encode_into(out);
        }
    }

    /// Bytes of an eager batch packet of messages whose frames total `frames` bytes (their
    /// [`Message::wire_len`]s).
    pub fn batch_len(frames: u64) -> u64 {
        PACKET_HEADER_LEN as u64 + frames
    }

    /// Encodes a receiver-pull announcement of `msg` whose attachments are in `segments`.
    pub fn encode_pull_rts(
        out: &mut BytesMut,
        credits: u16,
        id: u64,
        msg: &Message,
        segments: &[Segment],
    ) {
        debug_assert_eq!(segments.len(), msg.attachments.len());
        put_header(out, T_PULL_RTS, credits, segments.len() as u32, id);
        put_segments(out, segments);
        put_inline(out, msg);
    }

    /// Encodes a sender-push announcement of `msg`.
    pub fn encode_push_rts(out: &mut BytesMut, credits: u16, id: u64, msg: &Message) {
        put_header(out, T_PUSH_RTS, credits, msg.attachments.len() as u32, id);
        for a in &msg.attachments {
            out.put_u64_le(a.len() as u64);
        }
        put_inline(out, msg);
    }

    /// Encodes a grant of `segments` for push transfer `id`.
    pub fn encode_cts(out: &mut BytesMut, credits: u16, id: u64, segments: &[Segment]) {
        put_header(out, T_CTS, credits, segments.len() as u32, id);
        put_segments(out, segments);
    }

    /// Encodes a packet with no payload (`Fin`, `PushDone`, `Credit`).
    pub fn encode_control(out: &mut BytesMut, credits: u16, packet: &Packet) {
        let (ty, id) = match packet {
            Packet::Fin { id } => (T_FIN, *id),
            Packet::PushDone { id } => (T_PUSH_DONE, *id),
            Packet::Credit => (T_CREDIT, 0),
            Packet::Refuse { id, reason } => {
                put_header(out, T_REFUSE, credits, 0, *id);
                out.put_u32_le(*reason);
                return;
            }
            _ => panic!("encode_control takes Fin, PushDone, Credit or Refuse"),
        };
        put_header(out, ty, credits, 0, id);
    }

    /// Marks an encoded packet (`out`, from one of the `encode_*` functions) as sent by a peer
    /// that has been blocked on send credits since its previous packet: a receiver that sizes
    /// its window at run time widens it ([`Credits::grow`]).
    pub fn mark_starved(out: &mut [u8]) {
        if let Some(flags) = out.get_mut(1) {
            *flags |= FLAG_STARVED;
        }
    }

    /// Marks an encoded rendezvous announcement (`out`, from [`encode_pull_rts`] or
    /// [`encode_push_rts`] of a message made by [`lift_body`]) as carrying the message's body
    /// as its last segment.
    ///
    /// [`encode_pull_rts`]: Self::encode_pull_rts
    /// [`encode_push_rts`]: Self::encode_push_rts
    pub fn mark_body_last(out: &mut [u8]) {
        if let Some(flags) = out.get_mut(1) {
            *flags |= FLAG_BODY_LAST;
        }
    }

    /// Whether a received packet carries [`Packet::mark_starved`]'s mark (unchecked: a
    /// malformed packet is refused by [`Packet::parse`]).
    pub fn is_starved(slot: &[u8]) -> bool {
        slot.get(1).is_some_and(|f| f & FLAG_STARVED != 0)
    }

    /// Parses a received slot. Returns the packet and the credits it returns. Nothing in
    /// `slot` is trusted: every count and length is checked against `limits` and the slot.
    pub fn parse(mut slot: Bytes, limits: &Limits) -> Result<(Packet, u16), ProtocolViolation> {
        if slot.first() == Some(&T_EAGER_SHORT) {
            return parse_short(slot, limits);
        }
        if slot.len() < PACKET_HEADER_LEN {
            return Err(ProtocolViolation::Truncated {
                what: "packet header",
                len: slot.len(),
            });
        }
        let ty = slot.get_u8();
        let flags = slot.get_u8();
        let credits = slot.get_u16_le();
        let n = slot.get_u32_le();
        let id = slot.get_u64_le();
        if ty == T_EAGER_BATCH {
            return Ok((Packet::EagerBatch(parse_batch(slot, n, limits)?), credits));
        }
        if n > limits.max_attachments as u32 {
            return Err(ProtocolViolation::Frame(FrameError::TooManyAttachments {
                id,
                count: n.min(u16::MAX as u32) as u16,
                limit: limits.max_attachments,
            }));
        }
        let n = n as usize;
        let packet = match ty {
            T_EAGER => {
                let wire = parse_wire(&slot, limits)?;
                let frame_len = HEADER_LEN as u64 + wire.len;
                if slot.len() as u64 != frame_len {
                    return Err(ProtocolViolation::Truncated {
                        what: "eager frame",
                        len: slot.len(),
                    });
                }
                slot.advance(HEADER_LEN);
                Packet::Eager(wire.split(slot)?)
            }
            T_PULL_RTS => {
                let segments = take_segments(&mut slot, n)?;
                let head = parse_inline(slot, id, flags, limits)?;
                check_lens(id, &head, segments.iter().map(|s| s.len))?;
                Packet::PullRts { id, head, segments }
            }
            T_PUSH_RTS => {
                need(&slot, 8 * n, "push lengths")?;
                let lens: Vec<u64> = (0..n).map(|_| slot.get_u64_le()).collect();
                let head = parse_inline(slot, id, flags, limits)?;
                check_lens(id, &head, lens.iter().copied())?;
                Packet::PushRts { id, head }
            }
            T_CTS => {
                let segments = take_segments(&mut slot, n)?;
                Packet::Cts { id, segments }
            }
            T_FIN => Packet::Fin { id },
            T_PUSH_DONE => Packet::PushDone { id },
            T_CREDIT => Packet::Credit,
            T_REFUSE => {
                need(&slot, 4, "refuse reason")?;
                Packet::Refuse {
                    id,
                    reason: slot.get_u32_le(),
                }
            }
            other => return Err(ProtocolViolation::UnknownType(other)),
        };
        Ok((packet, credits))
    }

    /// Reads a received slot in place, without copying or taking ownership of it, if it holds
    /// the most common packet: an eager packet of one frame (a small call's request or
    /// answer). Returns that frame, borrowed from `slot`, the credits the packet returns, and
    /// whether it carries [`Packet::mark_starved`]'s mark. `None` for anything else, a
    /// malformed packet included: [`Packet::parse`] then handles it (and refuses what is
    /// malformed), so a caller that falls back to it loses nothing. What this accepts, `parse`
    /// accepts as [`Packet::Eager`] with the same header, body and attachments.
    #[inline(always)]
    pub fn peek_eager<'s>(slot: &'s [u8], limits: &Limits) -> Option<Eager<'s>> {
        if slot.first() == Some(&T_EAGER_SHORT) {
            let (head, rest) = slot.split_first_chunk::<SHORT_HEADER_LEN>()?;
            let wire = short_wire(head, rest.len(), limits).ok()?;
            return Some(Eager {
                frame: wire.split_ref(rest).ok()?,
                credits: u16::from_le_bytes([head[2], head[3]]),
                starved: head[1] & FLAG_STARVED != 0,
                rest,
            });
        }
        let (head, frame) = slot.split_first_chunk::<PACKET_HEADER_LEN>()?;
        // type, flags, credits, count (unused by eager packets), id (unused)
        if head[0] != T_EAGER
            || u32::from_le_bytes([head[4], head[5], head[6], head[7]])
                > limits.max_attachments as u32
        {
            return None;
        }
        let (raw, rest) = frame.split_first_chunk::<HEADER_LEN>()?;
        let wire = WireHeader::parse(raw, limits).ok()?;
        if wire.len != rest.len() as u64 {
            return None;
        }
        Some(Eager {
            frame: wire.split_ref(rest).ok()?,
            credits: u16::from_le_bytes([head[2], head[3]]),
            starved: head[1] & FLAG_STARVED != 0,
            rest,
        })
    }
}

/// Parses a short eager packet (see the module docs): one frame, with the credits it returns.
fn parse_short(mut slot: Bytes, limits: &Limits) -> Result<(Packet, u16), ProtocolViolation> {
    let Some(head) = slot.first_chunk::<SHORT_HEADER_LEN>() else {
        return Err(ProtocolViolation::Truncated {
            what: "short eager packet header",
            len: slot.len(),
        });
    };
    let credits = u16::from_le_bytes([head[2], head[3]]);
    let wire = short_wire(head, slot.len() - SHORT_HEADER_LEN, limits)?;
    slot.advance(SHORT_HEADER_LEN);
    Ok((Packet::Eager(wire.split(slot)?), credits))
}

/// A small eager packet read in place by [`Packet::peek_eager`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eager<'s> {
    /// Its frame, borrowed from the slot.
    pub frame: FrameRef<'s>,
    /// The credits the packet returns.
    pub credits: u16,
    /// Whether the sender was starved of credits ([`Packet::mark_starved`]).
    pub starved: bool,
    /// The frame's bytes after its header (attachment table, body, attachments): what
    /// [`FrameRef::split_copy`](crate::wire::FrameRef::split_copy) wants a copy of.
    pub rest: &'s [u8],
}

/// The `n` frames of an eager batch, which must fill `slot` exactly.
fn parse_batch(
    mut slot: Bytes,
    n: u32,
    limits: &Limits,
) -> Result<Vec<Message>, ProtocolViolation> {
    // every frame has at least its header: a count beyond that is a lie (checked before
    // reserving room for it)
    if n == 0 || n as usize > slot.len() / HEADER_LEN {
        return Err(ProtocolViolation::Truncated {
            what: "eager batch",
            len: slot.len(),
        });
    }
    let mut msgs = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let wire = parse_wire(&slot, limits)?;
        let frame_len = HEADER_LEN as u64 + wire.len;
        if (slot.len() as u64) < frame_len {
            return Err(ProtocolViolation::Truncated {
                what: "frame of an eager batch",
                len: slot.len(),
            });
        }
        let mut frame = slot.split_to(frame_len as usize);
        frame.advance(HEADER_LEN);
        msgs.push(wire.split(frame)?);
    }
    if !slot.is_empty() {
        return Err(ProtocolViolation::Truncated {
            what: "eager batch (bytes after its last frame)",
            len: slot.len(),
        });
    }
    Ok(msgs)
}

fn need(b: &Bytes, n: usize, what: &'static str) -> Result<(), ProtocolViolation> {
    if b.len() < n {
        return Err(ProtocolViolation::Truncated { what, len: b.len() });
    }
    Ok(())
}

fn parse_wire(b: &Bytes, limits: &Limits) -> Result<WireHeader, ProtocolViolation> {
    need(b, HEADER_LEN, "frame header")?;
    let raw: &[u8; HEADER_LEN] = b[..HEADER_LEN].try_into().expect("length checked");
    Ok(WireHeader::parse(raw, limits)?)
}

fn take_segments(b: &mut Bytes, n: usize) -> Result<Vec<Segment>, ProtocolViolation> {
    need(b, SEGMENT_LEN * n, "segments")?;
    Ok((0..n)
        .map(|_| Segment {
            addr: b.get_u64_le(),
            len: b.get_u64_le(),
            rkey: b.get_u32_le(),
        })
        .collect())
}

/// Parses an inline part: frame header, table, body (what follows the table up to the end of
/// the slot). The attachments are not here. `flags` are the announcement's (see
/// [`FLAG_BODY_LAST`]).
fn parse_inline(
    mut b: Bytes,
    id: u64,
    flags: u8,
    limits: &Limits,
) -> Result<Inline, ProtocolViolation> {
    let wire = parse_wire(&b, limits)?;
    b.advance(HEADER_LEN);
    let n = wire.n_attach as usize;
    need(&b, 8 * n, "attachment table")?;
    let lens: Vec<u64> = (0..n).map(|_| b.get_u64_le()).collect();
    let mut total = 8 * n as u64 + b.len() as u64;
    for l in &lens {
        total = total.checked_add(*l).ok_or(ProtocolViolation::Mismatch {
            id,
            why: "attachment lengths overflow",
        })?;
    }
    if total != wire.len {
        return Err(ProtocolViolation::Mismatch {
            id,
            why: "frame length does not match its table and body",
        });
    }
    let body_last = flags & FLAG_BODY_LAST != 0;
    if body_last && (lens.is_empty() || !b.is_empty()) {
        return Err(ProtocolViolation::Mismatch {
            id,
            why: "a body marked as the last segment, with no segment or with a body inline",
        });
    }
    Ok(Inline {
        wire,
        body: b,
        lens,
        body_last,
    })
}

fn check_lens(
    id: u64,
    head: &Inline,
    lens: impl ExactSizeIterator<Item = u64>,
) -> Result<(), ProtocolViolation> {
    if lens.len() != head.lens.len() {
        return Err(ProtocolViolation::Mismatch {
            id,
            why: "segment count differs from the attachment count",
        });
    }
    if lens.zip(&head.lens).any(|(a, b)| a != *b) {
        return Err(ProtocolViolation::Mismatch {
            id,
            why: "segment length differs from the attachment length",
        });
    }
    Ok(())
}

/// How a message will travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// One SEND with everything.
    Eager,
    /// Inline part by SEND, attachments by rendezvous.
    Rendezvous(Direction),
}

/// Which side moves the bulk bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The receiver RDMA-READs from the sender's exposed buffers.
    Pull,
    /// The sender RDMA-WRITEs into buffers the receiver granted.
    Push,
}

/// Why a message cannot be sent on this connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the message's header and body take {inline} bytes; a slot holds {slot} (put bulk data in Payloads)")]
pub struct InlineTooLarge {
    /// Bytes of header, table and body.
    pub inline: usize,
    /// Slot size.
    pub slot: usize,
}

impl Plan {
    /// The longest packet that goes eager, for receive slots of `slot_size` bytes and an
    /// eager threshold of `eager_threshold` (at least a bare frame's packet, and never more
    /// than a slot): a message goes eager ([`Plan::Eager`]) if its packet, alone
    /// ([`Packet::batch_len`] of its [`Message::wire_len`]), is no longer.
    pub fn eager_limit(slot_size: usize, eager_threshold: usize) -> usize {
        slot_size.min(eager_threshold.max(PACKET_HEADER_LEN + HEADER_LEN))
    }

    /// Chooses how `msg` travels through slots of `slot_size` bytes: eager when the whole
    /// frame fits (and is at most `eager_threshold`), otherwise a rendezvous in `direction`
    /// if the inline part fits a slot.
    pub fn for_message(
        msg: &Message,
        slot_size: usize,
        eager_threshold: usize,
        direction: Direction,
    ) -> Result<Plan, InlineTooLarge> {
        let whole = PACKET_HEADER_LEN as u64 + msg.wire_len();
        if whole <= Plan::eager_limit(slot_size, eager_threshold) as u64 {
            return Ok(Plan::Eager);
        }
        let per_segment = match direction {
            Direction::Pull => SEGMENT_LEN,
            Direction::Push => 8,
        };
        let inline = PACKET_HEADER_LEN
            + per_segment * msg.attachments.len()
            + HEADER_LEN
            + 8 * msg.attachments.len()
            + msg.body.len();
        if inline > slot_size {
            return Err(InlineTooLarge {
                inline,
                slot: slot_size,
            });
        }
        Ok(Plan::Rendezvous(direction))
    }
}

/// Send credits: how many SENDs the peer's posted receive slots can take, and how many slots we
/// owe the peer.
///
/// A packet received holds its slot's credit until the transport has handed it on
/// ([`Credits::on_slot_reposted`]): only then is the credit owed back to the peer. So the
/// packets a receiver has taken in but not yet consumed are bounded by the window, and a reader
/// that falls behind slows the peer down instead of queueing without bound. The receiver must
/// keep taking packets in (and their piggybacked credits) while its reader is behind, or two
/// peers that both wait for the other's credits would stop for good.
///
/// One credit is kept back for packets that only return credits, so two peers that both ran
/// out can always tell each other about freed slots: a data packet needs two credits, a pure
/// credit return one.
#[derive(Debug, Clone)]
pub struct Credits {
    available: u32,
    owed: u32,
    /// received, not yet consumed: neither usable by the peer nor owed to it
    held: u32,
    /// our receive window: the slots the peer may fill (usable by it, in flight, held, owed)
    window: u32,
    /// the most credits the peer may ever have given us (its largest window)
    peer_max: u32,
}

/// The window each side may assume of its peer at the start of a connection
/// ([`Credits::starting`]); the rest of a window is granted by the first packet.
pub const START_WINDOW: u32 = 2;

impl Credits {
    /// Both sides post `slots` receive slots at start-up, and each knows the other has them.
    pub fn new(slots: u32) -> Credits {
        assert!(slots >= 2, "at least two receive slots");
        Credits {
            available: slots,
            owed: 0,
            held: 0,
            window: slots,
            peer_max: slots,
        }
    }

    /// The start of a connection whose windows are granted, not assumed: we may send
    /// [`START_WINDOW`] packets, and owe the peer the rest of our `window` (the first packet we
    /// send grants it). The peer's window never grows past `peer_max`.
    ///
    /// This lets a receiver size its window at run time: a server whose connections share one
    /// receive queue grants each what its [`RecvBudget`] allows.
    pub fn starting(window: u32, peer_max: u32) -> Credits {
        assert!(
            window >= START_WINDOW && peer_max >= START_WINDOW,
            "at least {START_WINDOW} receive slots"
        );
        Credits {
            available: START_WINDOW,
            owed: window - START_WINDOW,
            held: 0,
            window,
            peer_max,
        }
    }

    /// Whether a data packet (anything but a pure credit return) may be sent now.
    pub fn can_send(&self) -> bool {
        self.available >= 2
    }

    /// Whether a pure credit return should be sent now: we owe at least half the window and
    /// have the reserved credit for it.
    pub fn should_return(&self) -> bool {
        self.owed >= (self.window / 2).max(1) && self.available >= 1
    }

    /// Takes one credit for a packet and the owed credits to piggyback on it.
    pub fn take(&mut self) -> Option<u16> {
        if self.available == 0 {
            return None;
        }
        self.available -= 1;
        let back = self.owed.min(u16::MAX as u32);
        self.owed -= back;
        Some(back as u16)
    }

    /// A packet arrived (taking one of our slots) returning `credits` of the peer's. Its slot's
    /// credit is held until [`Credits::on_slot_reposted`].
    pub fn on_receive(&mut self, credits: u16) -> Result<(), ProtocolViolation> {
        // Every slot is held or already owed back: the peer sent with no credit, so this
        // packet landed in no slot it was allowed to use.
        if self.owed + self.held >= self.window {
            return Err(ProtocolViolation::NoCredit);
        }
        let available = self.available + credits as u32;
        if available > self.peer_max {
            return Err(ProtocolViolation::NoCredit);
        }
        self.available = available;
        self.held += 1;
        Ok(())
    }

    /// A received packet was consumed and its slot is posted again: owe the peer one credit.
    pub fn on_slot_reposted(&mut self) {
        debug_assert!(self.held > 0, "more packets consumed than received");
        self.held = self.held.saturating_sub(1);
        self.owed += 1;
        debug_assert!(self.owed <= self.window);
    }

    /// Widens our window by `n` slots (granted with the next packet).
    pub fn grow(&mut self, n: u32) {
        self.window += n;
        self.owed += n;
    }

    /// Narrows our window by up to `n` slots that are owed and not yet returned, never below
    /// [`START_WINDOW`]; returns by how many (those slots are no longer the peer's).
    pub fn shrink(&mut self, n: u32) -> u32 {
        let k = n
            .min(self.owed)
            .min(self.window.saturating_sub(START_WINDOW));
        self.owed -= k;
        self.window -= k;
        k
    }

    /// Packets received and not yet consumed.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Credits available now.
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Credits owed to the peer.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// Our receive window now.
    pub fn window(&self) -> u32 {
        self.window
    }
}

/// Receive slots shared by many connections (a shared receive queue): the windows granted to
/// all of them together never exceed the slots posted, so no sender ever finds the queue empty
/// (on iWARP that would end its connection; on InfiniBand/RoCE it would stall in RNR retries).
///
/// Each connection holds [`START_WINDOW`] slots for its whole life (so it always makes
/// progress: [`RecvBudget::try_take`] at admission) and borrows more while it is busy
/// ([`RecvBudget::take_up_to`]); it gives slots back when the budget runs low and when it ends
/// ([`RecvBudget::give`]).
#[derive(Debug)]
pub struct RecvBudget {
    total: u32,
    free: std::sync::atomic::AtomicU32,
}

impl RecvBudget {
    /// A budget of `total` posted slots, all free.
    pub fn new(total: u32) -> RecvBudget {
        RecvBudget {
            total,
            free: std::sync::atomic::AtomicU32::new(total),
        }
    }

    /// The slots the budget was made with.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Slots not granted to any connection now.
    pub fn free(&self) -> u32 {
        self.free.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The free slots that borrowing leaves alone (an eighth of the total, at least what
    /// admitting one connection takes), so that a new connection finds its start window.
    pub fn low_mark(&self) -> u32 {
        (self.total / 8).max(START_WINDOW)
    }

    /// Whether the free slots are below [`RecvBudget::low_mark`]: connections should then give
    /// back what they do not need.
    pub fn is_low(&self) -> bool {
        self.free() < self.low_mark()
    }

    /// Takes `n` slots if that many are free (all or none): a connection's admission.
    pub fn try_take(&self, n: u32) -> bool {
        use std::sync::atomic::Ordering;
        self.free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| f.checked_sub(n))
            .is_ok()
    }

    /// Lends up to `n` slots to a busy connection, leaving [`RecvBudget::low_mark`] free;
    /// returns how many.
    pub fn take_up_to(&self, n: u32) -> u32 {
        use std::sync::atomic::Ordering;
        let keep = self.low_mark();
        match self
            .free
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
                let k = f.saturating_sub(keep).min(n);
                (k > 0).then(|| f - k)
            }) {
            Ok(before) => before.saturating_sub(keep).min(n),
            Err(_) => 0,
        }
    }

    /// Gives `n` slots back.
    pub fn give(&self, n: u32) {
        let before = self.free.fetch_add(n, std::sync::atomic::Ordering::AcqRel);
        debug_assert!(before + n <= self.total, "more slots given back than taken");
    }
}

/// State of a rendezvous transfer we receive.
#[derive(Debug)]
pub enum Incoming<B> {
    /// Reading the sender's segments into `bufs`; `pending` reads outstanding.
    Pulling {
        /// Frame head.
        head: Inline,
        /// Our buffers, one per segment.
        bufs: Vec<B>,
        /// Reads not yet completed.
        pending: usize,
    },
    /// Granted `bufs` to the sender; waiting for `PushDone`.
    Granted {
        /// Frame head.
        head: Inline,
        /// Our buffers, exposed to the peer for writing.
        bufs: Vec<B>,
    },
}

/// The rendezvous transfers of one connection, both directions. `B` is the transport's buffer
/// handle (a registered pool buffer): the table holds it until the transfer ends, so a buffer
/// the NIC may still touch is never freed or reused.
#[derive(Debug)]
pub struct Transfers<B> {
    next_id: u64,
    /// Ours, sent by pull: buffers exposed until the peer's `Fin`.
    exposed: HashMap<u64, Vec<B>>,
    /// Ours, sent by push: waiting for the peer's `Cts`.
    announced: HashMap<u64, Vec<B>>,
    /// Theirs.
    incoming: HashMap<u64, Incoming<B>>,
}

impl<B> Default for Transfers<B> {
    fn default() -> Self {
        Transfers {
            next_id: 1,
            exposed: HashMap::new(),
            announced: HashMap::new(),
            incoming: HashMap::new(),
        }
    }
}

impl<B> Transfers<B> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers an outgoing pull transfer whose source buffers are `bufs`; returns its id.
    pub fn start_pull(&mut self, bufs: Vec<B>) -> u64 {
        let id = self.fresh_id();
        self.exposed.insert(id, bufs);
        id
    }

    /// Registers an outgoing push transfer whose source buffers are `bufs`; returns its id.
    pub fn start_push(&mut self, bufs: Vec<B>) -> u64 {
        let id = self.fresh_id();
        self.announced.insert(id, bufs);
        id
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }

    /// The peer read our pull transfer `id`: its buffers may be released.
    pub fn on_fin(&mut self, id: u64) -> Result<Vec<B>, ProtocolViolation> {
        self.exposed
            .remove(&id)
            .ok_or(ProtocolViolation::UnknownTransfer(id))
    }

    /// The peer granted buffers for our push transfer `id`: returns our source buffers, to
    /// write from and hold until the writes complete.
    pub fn on_cts(
        &mut self,
        id: u64,
        segments: &[Segment],
        lens: impl ExactSizeIterator<Item = u64>,
    ) -> Result<Vec<B>, ProtocolViolation> {
        if !self.announced.contains_key(&id) {
            return Err(ProtocolViolation::UnknownTransfer(id));
        }
        if segments.len() != lens.len() || segments.iter().map(|s| s.len).ne(lens) {
            return Err(ProtocolViolation::Mismatch {
                id,
                why: "granted buffers do not match the announced lengths",
            });
        }
        Ok(self.announced.remove(&id).expect("checked"))
    }

    /// The peer refused our transfer `id`: returns its buffers.
    pub fn on_refuse(&mut self, id: u64) -> Result<Vec<B>, ProtocolViolation> {
        self.exposed
            .remove(&id)
            .or_else(|| self.announced.remove(&id))
            .ok_or(ProtocolViolation::UnknownTransfer(id))
    }

    /// The peer announced transfer `id`: we read into `bufs` (pull) or granted them (push).
    pub fn begin_incoming(&mut self, id: u64, state: Incoming<B>) -> Result<(), ProtocolViolation> {
        if self.incoming.contains_key(&id) {
            return Err(ProtocolViolation::DuplicateTransfer(id));
        }
        self.incoming.insert(id, state);
        Ok(())
    }

    /// One read of pull transfer `id` completed; when it was the last, returns the head and
    /// buffers to deliver (and the caller sends `Fin`).
    pub fn on_read_done(&mut self, id: u64) -> Result<Option<(Inline, Vec<B>)>, ProtocolViolation> {
        match self.incoming.get_mut(&id) {
            Some(Incoming::Pulling { pending, .. }) if *pending > 1 => {
                *pending -= 1;
                Ok(None)
            }
            Some(Incoming::Pulling { .. }) => match self.incoming.remove(&id) {
                Some(Incoming::Pulling { head, bufs, .. }) => Ok(Some((head, bufs))),
                _ => unreachable!("matched above"),
            },
            _ => Err(ProtocolViolation::UnknownTransfer(id)),
        }
    }

    /// The peer finished writing push transfer `id`: returns the head and buffers to deliver.
    pub fn on_push_done(&mut self, id: u64) -> Result<(Inline, Vec<B>), ProtocolViolation> {
        match self.incoming.remove(&id) {
            Some(Incoming::Granted { head, bufs }) => Ok((head, bufs)),
            Some(other) => {
                self.incoming.insert(id, other);
                Err(ProtocolViolation::UnknownTransfer(id))
            }
            None => Err(ProtocolViolation::UnknownTransfer(id)),
        }
    }

    /// Transfers in progress (ours and theirs).
    pub fn len(&self) -> usize {
        self.exposed.len() + self.announced.len() + self.incoming.len()
    }

    /// Whether no transfer is in progress.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every transfer (the connection is gone) and hands back all buffers. The caller
    /// must not return to the pool any buffer the NIC may still access until the queue pair
    /// has been moved to the error state and its work requests flushed.
    pub fn drain(&mut self) -> Vec<B> {
        let mut out = Vec::new();
        out.extend(self.exposed.drain().flat_map(|(_, b)| b));
        out.extend(self.announced.drain().flat_map(|(_, b)| b));
        for (_, t) in self.incoming.drain() {
            match t {
                Incoming::Pulling { bufs, .. } | Incoming::Granted { bufs, .. } => out.extend(bufs),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
