//! `rendezvous`: arbitrary packet sequences into [`Packet::parse`] and a [`Credits`] +
//! [`Transfers<u32>`] model of one end of a connection, driven as the transport drives it (and
//! as the fake-NIC pair in `rpc-core/src/rendezvous/tests.rs` does), against an independent
//! reference model of what the table must hold.
//!
//! The peer is arbitrary: it sends structured packets built with the `Packet::encode_*`
//! functions from arbitrary fields (naming transfers that exist, or not), or raw bytes. Our
//! side starts pull and push transfers, completes reads, and returns credits.
//!
//! Checks: no panic; `parse` of a well-formed encoding gives back what was encoded, of a
//! malformed one an error; `peek_eager` reads exactly the eager packets `parse` reads, as the
//! same frames; every `Transfers`/`Credits` answer is what the reference model
//! says (a forged or stale id is an error, never a panic, and changes nothing); a protocol
//! violation ends the connection, and then (and at the end of the input) `drain()` returns
//! exactly the buffers the model says are still held: none lost, none duplicated, none that
//! was already given back.
//!
//! Input layout ([`Reader`]): `slots` (`2 + b % 15`), `max_attachments` (`b % 17`),
//! `max_message_size` (`1 << (10 + b % 21)`), then operations, each an opcode byte
//! (`b % OPS`) and its fields; see [`Op`] and `read_op`.

use std::collections::{BTreeSet, HashMap};

use bytes::{Bytes, BytesMut};
use rpc_core::rendezvous::{
    Credits, Direction, Incoming, Inline, Packet, Plan, ProtocolViolation, Segment, Transfers,
    PACKET_HEADER_LEN,
};
use rpc_core::wire::{Header, Kind, Limits, Message, HEADER_LEN};
use rpc_core::Payload;

use crate::reader::{Reader, Writer};

static ZEROS: [u8; 1 << 16] = [0; 1 << 16];

/// Operations an input is made of (opcode = index).
#[derive(Debug, Clone)]
pub enum Op {
    /// 0: we send a message by receiver-pull (exposing one buffer per attachment).
    SendPull(MsgSpec),
    /// 1: we send a message by sender-push (announcing it).
    SendPush(MsgSpec),
    /// 2: the peer sends an eager message.
    PeerEager { credits: u16, msg: MsgSpec },
    /// 3: the peer announces a pull transfer; `tamper` alters one segment length.
    PeerPullRts {
        credits: u16,
        id: IdSel,
        msg: MsgSpec,
        addr: u64,
        rkey: u32,
        tamper: bool,
    },
    /// 4: the peer announces a push transfer.
    PeerPushRts {
        credits: u16,
        id: IdSel,
        msg: MsgSpec,
    },
    /// 5: the peer grants buffers for our push transfer `id` (`exact`: the announced lengths).
    PeerCts {
        credits: u16,
        id: IdSel,
        exact: bool,
        lens: Vec<u16>,
    },
    /// 6: the peer has read our pull transfer.
    PeerFin { credits: u16, id: IdSel },
    /// 7: the peer has written our... its push transfer into our grant.
    PeerPushDone { credits: u16, id: IdSel },
    /// 8: the peer returns credits.
    PeerCredit { credits: u16 },
    /// 9: the peer refuses our transfer.
    PeerRefuse {
        credits: u16,
        id: IdSel,
        reason: u32,
    },
    /// 10: raw bytes in a slot.
    PeerRaw(Vec<u8>),
    /// 11: one RDMA READ of an incoming pull transfer completed.
    ReadDone(IdSel),
    /// 12: we return credits if we should.
    ReturnCredits,
    /// 13: the connection goes away.
    Disconnect,
    /// 14: the sender's plan for a message and slot size: the packet must fit the slot.
    Plan {
        msg: MsgSpec,
        slot: u16,
        threshold: u16,
        pull: bool,
    },
    /// 15: the peer sends several eager messages in one packet.
    PeerEagerBatch { credits: u16, msgs: Vec<MsgSpec> },
}

/// Number of opcodes.
pub const OPS: u8 = 16;

/// A transfer id: one seen so far (`Known(i)`: the `i % n`-th), or any.
#[derive(Debug, Clone, Copy)]
pub enum IdSel {
    Known(u8),
    Any(u64),
}

/// A message: header fields, body length and attachment lengths (the bytes are zeros).
#[derive(Debug, Clone)]
pub struct MsgSpec {
    pub kind: u8,
    pub id: u64,
    pub body: u8,
    pub atts: Vec<u16>,
}

impl MsgSpec {
    fn message(&self) -> Message {
        Message {
            header: Header {
                kind: [
                    Kind::Request,
                    Kind::Response,
                    Kind::Cancel,
                    Kind::Ping,
                    Kind::Pong,
                    Kind::GoAway,
                ][self.kind as usize % 6],
                flags: 0,
                id: self.id,
                method: 0x5eed,
                aux: 0,
            },
            body: Bytes::from_static(&ZEROS[..self.body as usize]),
            attachments: self
                .atts
                .iter()
                .map(|l| Payload::from_static(&ZEROS[..*l as usize]))
                .collect(),
        }
    }
    fn read(r: &mut Reader) -> MsgSpec {
        let kind = r.u8();
        let id = r.u8() as u64;
        let body = r.u8();
        let n = r.u8() % 6;
        let atts = (0..n).map(|_| r.u16()).collect();
        MsgSpec {
            kind,
            id,
            body,
            atts,
        }
    }
    fn write(&self, w: &mut Writer) {
        w.u8(self.kind)
            .u8(self.id as u8)
            .u8(self.body)
            .u8(self.atts.len() as u8);
        for a in &self.atts {
            w.u16(*a);
        }
    }
}

fn read_credits(r: &mut Reader) -> u16 {
    match r.u8() {
        0xff => r.u16(),
        b => (b % 8) as u16,
    }
}

fn read_id(r: &mut Reader) -> IdSel {
    match r.u8() {
        b @ 0..=0x7f => IdSel::Known(b),
        _ => IdSel::Any(r.u64()),
    }
}

fn write_id(w: &mut Writer, id: IdSel) {
    match id {
        IdSel::Known(b) => w.u8(b & 0x7f),
        IdSel::Any(v) => w.u8(0xff).u64(v),
    };
}

fn write_credits(w: &mut Writer, c: u16) {
    if c < 8 {
        w.u8(c as u8);
    } else {
        w.u8(0xff).u16(c);
    }
}

/// Reads one operation.
pub fn read_op(r: &mut Reader) -> Op {
    match r.u8() % OPS {
        0 => Op::SendPull(MsgSpec::read(r)),
        1 => Op::SendPush(MsgSpec::read(r)),
        2 => Op::PeerEager {
            credits: read_credits(r),
            msg: MsgSpec::read(r),
        },
        3 => Op::PeerPullRts {
            credits: read_credits(r),
            id: read_id(r),
            msg: MsgSpec::read(r),
            addr: r.u64(),
            rkey: r.u32(),
            tamper: r.bool(),
        },
        4 => Op::PeerPushRts {
            credits: read_credits(r),
            id: read_id(r),
            msg: MsgSpec::read(r),
        },
        5 => {
            let credits = read_credits(r);
            let id = read_id(r);
            let exact = r.bool();
            let n = r.u8() % 6;
            let lens = (0..n).map(|_| r.u16()).collect();
            Op::PeerCts {
                credits,
                id,
                exact,
                lens,
            }
        }
        6 => Op::PeerFin {
            credits: read_credits(r),
            id: read_id(r),
        },
        7 => Op::PeerPushDone {
            credits: read_credits(r),
            id: read_id(r),
        },
        8 => Op::PeerCredit {
            credits: read_credits(r),
        },
        9 => Op::PeerRefuse {
            credits: read_credits(r),
            id: read_id(r),
            reason: r.u32(),
        },
        10 => {
            let n = r.u8() as usize;
            Op::PeerRaw(r.bytes(n).to_vec())
        }
        11 => Op::ReadDone(read_id(r)),
        12 => Op::ReturnCredits,
        13 => Op::Disconnect,
        14 => Op::Plan {
            msg: MsgSpec::read(r),
            slot: r.u16(),
            threshold: r.u16(),
            pull: r.bool(),
        },
        _ => {
            let credits = read_credits(r);
            let n = r.u8() % 5;
            Op::PeerEagerBatch {
                credits,
                msgs: (0..n).map(|_| MsgSpec::read(r)).collect(),
            }
        }
    }
}

/// Writes one operation in `read_op`'s layout (for seeds).
pub fn write_op(w: &mut Writer, op: &Op) {
    match op {
        Op::SendPull(m) => {
            w.u8(0);
            m.write(w);
        }
        Op::SendPush(m) => {
            w.u8(1);
            m.write(w);
        }
        Op::PeerEager { credits, msg } => {
            w.u8(2);
            write_credits(w, *credits);
            msg.write(w);
        }
        Op::PeerPullRts {
            credits,
            id,
            msg,
            addr,
            rkey,
            tamper,
        } => {
            w.u8(3);
            write_credits(w, *credits);
            write_id(w, *id);
            msg.write(w);
            w.u64(*addr).u32(*rkey).u8(*tamper as u8);
        }
        Op::PeerPushRts { credits, id, msg } => {
            w.u8(4);
            write_credits(w, *credits);
            write_id(w, *id);
            msg.write(w);
        }
        Op::PeerCts {
            credits,
            id,
            exact,
            lens,
        } => {
            w.u8(5);
            write_credits(w, *credits);
            write_id(w, *id);
            w.u8(*exact as u8).u8(lens.len() as u8);
            for l in lens {
                w.u16(*l);
            }
        }
        Op::PeerFin { credits, id } => {
            w.u8(6);
            write_credits(w, *credits);
            write_id(w, *id);
        }
        Op::PeerPushDone { credits, id } => {
            w.u8(7);
            write_credits(w, *credits);
            write_id(w, *id);
        }
        Op::PeerCredit { credits } => {
            w.u8(8);
            write_credits(w, *credits);
        }
        Op::PeerRefuse {
            credits,
            id,
            reason,
        } => {
            w.u8(9);
            write_credits(w, *credits);
            write_id(w, *id);
            w.u32(*reason);
        }
        Op::PeerRaw(b) => {
            w.u8(10).u8(b.len() as u8).bytes(b);
        }
        Op::ReadDone(id) => {
            w.u8(11);
            write_id(w, *id);
        }
        Op::ReturnCredits => {
            w.u8(12);
        }
        Op::Disconnect => {
            w.u8(13);
        }
        Op::PeerEagerBatch { credits, msgs } => {
            w.u8(15);
            write_credits(w, *credits);
            w.u8(msgs.len() as u8);
            for m in msgs {
                m.write(w);
            }
        }
        Op::Plan {
            msg,
            slot,
            threshold,
            pull,
        } => {
            w.u8(14);
            msg.write(w);
            w.u16(*slot).u16(*threshold).u8(*pull as u8);
        }
    }
}

/// What the reference model says an incoming transfer is.
#[derive(Debug, Clone, PartialEq)]
enum In {
    Pulling { pending: usize },
    Granted,
}

/// One end of a connection and the reference model of its state.
struct End {
    limits: Limits,
    slots: u32,
    credits: Credits,
    transfers: Transfers<u32>,
    // reference model
    avail: u32,
    owed: u32,
    exposed: HashMap<u64, Vec<u32>>,
    announced: HashMap<u64, (Vec<u32>, Vec<u64>)>,
    incoming: HashMap<u64, (In, Vec<u32>, Inline)>,
    /// Buffers allocated and not yet given back: exactly those the table holds.
    live: BTreeSet<u32>,
    next_buf: u32,
    /// Transfer ids seen (ours and the peer's), for `IdSel::Known`.
    known: Vec<u64>,
}

impl End {
    fn new(slots: u32, limits: Limits, next_buf: u32) -> End {
        End {
            limits,
            slots,
            credits: Credits::new(slots),
            transfers: Transfers::new(),
            avail: slots,
            owed: 0,
            exposed: HashMap::new(),
            announced: HashMap::new(),
            incoming: HashMap::new(),
            live: BTreeSet::new(),
            next_buf,
            known: Vec::new(),
        }
    }

    fn alloc(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.next_buf += 1;
                assert!(self.live.insert(self.next_buf));
                self.next_buf
            })
            .collect()
    }

    /// Gives buffers back to the pool: each must be live (else it was duplicated).
    fn release(&mut self, bufs: &[u32]) {
        for b in bufs {
            assert!(
                self.live.remove(b),
                "buffer {b} given back twice, or never handed out"
            );
        }
    }

    fn id(&self, sel: IdSel) -> u64 {
        match sel {
            IdSel::Known(i) if !self.known.is_empty() => self.known[i as usize % self.known.len()],
            IdSel::Known(i) => i as u64,
            IdSel::Any(v) => v,
        }
    }

    fn check_credits(&self) {
        assert_eq!(self.credits.available(), self.avail, "available credits");
        assert_eq!(self.credits.owed(), self.owed, "owed credits");
        assert!(self.credits.available() <= self.slots);
        assert_eq!(self.credits.can_send(), self.avail >= 2);
        assert_eq!(
            self.credits.should_return(),
            self.owed >= (self.slots / 2).max(1) && self.avail >= 1
        );
    }

    /// Takes a credit for a packet we send (a data packet needs two available).
    fn take(&mut self, data: bool) -> Option<u16> {
        if data && !self.credits.can_send() {
            return None;
        }
        let got = self.credits.take();
        if self.avail == 0 {
            assert_eq!(got, None);
            return None;
        }
        self.avail -= 1;
        let back = self.owed.min(u16::MAX as u32);
        self.owed -= back;
        assert_eq!(got, Some(back as u16), "credits piggybacked");
        self.check_credits();
        got
    }

    /// The connection ends: every buffer the table holds comes back, exactly once.
    fn drain_and_check(&mut self) {
        let mut drained = self.transfers.drain();
        drained.sort_unstable();
        let n = drained.len();
        drained.dedup();
        assert_eq!(drained.len(), n, "drain() returned a buffer twice");
        let live: Vec<u32> = self.live.iter().copied().collect();
        assert_eq!(drained, live, "drain() differs from the buffers still held");
        assert!(self.transfers.is_empty());
        self.release(&live);
        self.exposed.clear();
        self.announced.clear();
        self.incoming.clear();
    }

    fn check_len(&self) {
        assert_eq!(
            self.transfers.len(),
            self.exposed.len() + self.announced.len() + self.incoming.len(),
            "Transfers::len"
        );
    }

    fn send(&mut self, spec: &MsgSpec, pull: bool) {
        let msg = spec.message();
        if msg.attachments.len() > self.limits.max_attachments as usize {
            return;
        }
        let Some(c) = self.take(true) else { return };
        let bufs = self.alloc(msg.attachments.len());
        let lens: Vec<u64> = msg.attachments.iter().map(|a| a.len() as u64).collect();
        let mut out = BytesMut::new();
        let id = if pull {
            let id = self.transfers.start_pull(bufs.clone());
            let segs: Vec<Segment> = bufs
                .iter()
                .zip(&lens)
                .map(|(b, l)| Segment {
                    addr: 0x1000 * *b as u64,
                    len: *l,
                    rkey: *b,
                })
                .collect();
            Packet::encode_pull_rts(&mut out, c, id, &msg, &segs);
            assert!(self.exposed.insert(id, bufs).is_none() && !self.announced.contains_key(&id));
            id
        } else {
            let id = self.transfers.start_push(bufs.clone());
            Packet::encode_push_rts(&mut out, c, id, &msg);
            assert!(
                self.announced.insert(id, (bufs, lens)).is_none()
                    && !self.exposed.contains_key(&id)
            );
            id
        };
        assert_ne!(id, 0, "transfer id 0");
        self.known.push(id);
        self.check_len();
        // What we send parses as what we meant (if it is within the limits).
        if msg.payload_len() <= self.limits.max_message_size {
            let (p, c2) = Packet::parse(out.freeze(), &self.limits).expect("our own packet");
            assert_eq!(c2, c);
            match p {
                Packet::PullRts { id: i, head, .. } | Packet::PushRts { id: i, head } => {
                    assert_eq!(i, id);
                    assert_eq!(head.wire.header, msg.header);
                }
                other => panic!("sent a rendezvous announcement, parsed {other:?}"),
            }
        }
    }

    /// A packet arrives from the peer. `Err`: the connection ends.
    fn receive(&mut self, slot: Bytes) -> Result<(), ProtocolViolation> {
        // The in-place read (a lone caller's lent answer) agrees with `parse` on every packet:
        // the same eager frames, and nothing `parse` refuses.
        let peeked = Packet::peek_eager(&slot, &self.limits).map(|e| {
            (
                e.frame.header,
                e.frame.body.to_vec(),
                e.frame.to_attachments(),
                e.credits,
            )
        });
        let parsed = Packet::parse(slot, &self.limits);
        match (&peeked, &parsed) {
            (Some((header, body, attachments, c)), Ok((Packet::Eager(m), credits))) => {
                assert_eq!(
                    (header, &body[..], attachments, c),
                    (&m.header, &m.body[..], &m.attachments, credits)
                );
            }
            (Some(p), other) => panic!("peek_eager read {p:?}, parse gave {other:?}"),
            (None, Ok((Packet::Eager(m), _))) => {
                panic!("parse read an eager {m:?} that peek_eager did not")
            }
            (None, _) => {}
        }
        let (packet, credits) = parsed?;
        let r = self.credits.on_receive(credits);
        // Two ways to break the credit rule, both `NoCredit` ("the peer sent more than its
        // credits allow"): returning more credits than we have slots, or sending a packet
        // with none left. We repost every slot as soon as a packet is in it, so the peer
        // has `slots - owed` credits left: an honest peer never sends while `owed == slots`.
        if self.avail + credits as u32 > self.slots {
            assert_eq!(
                r,
                Err(ProtocolViolation::NoCredit),
                "credits returned beyond the window"
            );
            return r;
        }
        if self.owed >= self.slots {
            assert_eq!(
                r,
                Err(ProtocolViolation::NoCredit),
                "the peer sent a packet with no credit left ({} slots, all {} owed back to it): \
                 Credits::on_receive accepted it; the receiver cannot tell it apart from an \
                 honest packet and its owed count overruns the window",
                self.slots,
                self.owed
            );
            return r;
        }
        assert_eq!(r, Ok(()));
        self.avail += credits as u32;
        // The slot is reposted (as the transport does before it handles the packet).
        self.credits.on_slot_reposted();
        self.owed += 1;
        self.check_credits();
        let r = self.handle(packet);
        self.check_len();
        r
    }

    fn handle(&mut self, packet: Packet) -> Result<(), ProtocolViolation> {
        match packet {
            Packet::Eager(m) => {
                assert!(m.payload_len() <= self.limits.max_message_size);
                Ok(())
            }
            Packet::EagerBatch(ms) => {
                assert!(!ms.is_empty());
                for m in &ms {
                    assert!(m.payload_len() <= self.limits.max_message_size);
                }
                Ok(())
            }
            Packet::PullRts { id, head, segments } => {
                assert_eq!(segments.len(), head.lens.len());
                self.known.push(id);
                let bufs = self.alloc(segments.len());
                let n = bufs.len();
                let r = self.transfers.begin_incoming(
                    id,
                    Incoming::Pulling {
                        head: head.clone(),
                        bufs: bufs.clone(),
                        pending: n,
                    },
                );
                self.begun(id, r, In::Pulling { pending: n }, bufs, head)
            }
            Packet::PushRts { id, head } => {
                self.known.push(id);
                let bufs = self.alloc(head.lens.len());
                let r = self.transfers.begin_incoming(
                    id,
                    Incoming::Granted {
                        head: head.clone(),
                        bufs: bufs.clone(),
                    },
                );
                self.begun(id, r, In::Granted, bufs, head)
            }
            Packet::Cts { id, segments } => {
                let lens: Vec<u64> = self
                    .announced
                    .get(&id)
                    .map(|(_, l)| l.clone())
                    .unwrap_or_default();
                let r = self.transfers.on_cts(id, &segments, lens.iter().copied());
                match self.announced.get(&id) {
                    None => {
                        assert_eq!(r, Err(ProtocolViolation::UnknownTransfer(id)));
                        r.map(drop)
                    }
                    Some((_, l)) if segments.iter().map(|s| s.len).ne(l.iter().copied()) => {
                        assert!(
                            matches!(r, Err(ProtocolViolation::Mismatch { id: i, .. }) if i == id)
                        );
                        r.map(drop)
                    }
                    Some(_) => {
                        let (bufs, _) = self.announced.remove(&id).expect("checked");
                        assert_eq!(r, Ok(bufs.clone()), "on_cts returned other buffers");
                        // Written, then given back; the peer is told with PushDone.
                        self.release(&bufs);
                        let _ = self.take(true);
                        Ok(())
                    }
                }
            }
            Packet::Fin { id } => {
                let r = self.transfers.on_fin(id);
                match self.exposed.remove(&id) {
                    Some(bufs) => {
                        assert_eq!(r, Ok(bufs.clone()), "on_fin returned other buffers");
                        self.release(&bufs);
                        Ok(())
                    }
                    None => {
                        assert_eq!(r, Err(ProtocolViolation::UnknownTransfer(id)));
                        r.map(drop)
                    }
                }
            }
            Packet::Refuse { id, .. } => {
                let r = self.transfers.on_refuse(id);
                match self
                    .exposed
                    .remove(&id)
                    .or_else(|| self.announced.remove(&id).map(|a| a.0))
                {
                    Some(bufs) => {
                        assert_eq!(r, Ok(bufs.clone()), "on_refuse returned other buffers");
                        self.release(&bufs);
                        Ok(())
                    }
                    None => {
                        assert_eq!(r, Err(ProtocolViolation::UnknownTransfer(id)));
                        r.map(drop)
                    }
                }
            }
            Packet::PushDone { id } => {
                let r = self.transfers.on_push_done(id);
                match self.incoming.get(&id) {
                    Some((In::Granted, ..)) => {
                        let (_, bufs, head) = self.incoming.remove(&id).expect("checked");
                        let (h, b) = r.expect("on_push_done of a granted transfer");
                        assert_eq!((h, &b), (head, &bufs));
                        self.deliver(b);
                        Ok(())
                    }
                    _ => {
                        assert!(matches!(r, Err(ProtocolViolation::UnknownTransfer(i)) if i == id));
                        r.map(drop)
                    }
                }
            }
            Packet::Credit => Ok(()),
        }
    }

    fn begun(
        &mut self,
        id: u64,
        r: Result<(), ProtocolViolation>,
        state: In,
        bufs: Vec<u32>,
        head: Inline,
    ) -> Result<(), ProtocolViolation> {
        if self.incoming.contains_key(&id) {
            assert_eq!(r, Err(ProtocolViolation::DuplicateTransfer(id)));
            // The refused state (and its buffers) was dropped: back to the pool.
            self.release(&bufs);
            return r;
        }
        assert_eq!(r, Ok(()));
        self.incoming.insert(id, (state.clone(), bufs, head));
        if state == In::Granted {
            let _ = self.take(true); // Cts
        }
        Ok(())
    }

    fn deliver(&mut self, bufs: Vec<u32>) {
        // The payloads are handed up and freed when the application drops them.
        self.release(&bufs);
    }

    fn read_done(&mut self, id: u64) {
        let r = self.transfers.on_read_done(id);
        match self.incoming.get_mut(&id) {
            Some((In::Pulling { pending }, ..)) if *pending > 1 => {
                *pending -= 1;
                assert!(matches!(r, Ok(None)), "{r:?}");
            }
            Some((In::Pulling { .. }, ..)) => {
                let (_, bufs, head) = self.incoming.remove(&id).expect("checked");
                let (h, b) = r.expect("last read").expect("delivered on the last read");
                assert_eq!((&h, &b), (&head, &bufs));
                let n = h.lens.len();
                // (a body sent as the last segment comes back as the body)
                let lifted = usize::from(h.body_last);
                let m = h.into_message(vec![Payload::new(); n]);
                assert_eq!(m.attachments.len(), n - lifted);
                self.deliver(b);
                let _ = self.take(true); // Fin
            }
            _ => assert!(matches!(r, Err(ProtocolViolation::UnknownTransfer(i)) if i == id)),
        }
        self.check_len();
    }
}

/// Builds the peer's packet for `op`; returns the bytes and whether `parse` must accept them.
fn peer_packet(end: &End, op: &Op) -> Option<(Bytes, Option<Packet>)> {
    let mut out = BytesMut::new();
    let lim = &end.limits;
    let fits = |m: &Message| {
        m.attachments.len() <= lim.max_attachments as usize
            && m.payload_len() <= lim.max_message_size
    };
    let expect = match op {
        Op::PeerEager { credits, msg } => {
            let m = msg.message();
            if credits & 1 == 1 {
                // (odd credits, one in two: the long form, which `encode_eager` leaves to
                // frames the short one cannot carry and which a receiver reads all the same;
                // its layout in rpc-core's `rendezvous` module docs)
                out.extend_from_slice(&[1, 0]);
                out.extend_from_slice(&credits.to_le_bytes());
                out.extend_from_slice(&[0; 12]);
                m.encode_into(&mut out);
            } else {
                Packet::encode_eager(&mut out, *credits, &m);
            }
            fits(&m).then(|| Packet::Eager(m))
        }
        Op::PeerEagerBatch { credits, msgs } => {
            let ms: Vec<Message> = msgs.iter().map(MsgSpec::message).collect();
            Packet::encode_eager_batch(&mut out, *credits, &ms);
            (!ms.is_empty() && ms.iter().all(fits)).then(|| Packet::EagerBatch(ms))
        }
        Op::PeerPullRts {
            credits,
            id,
            msg,
            addr,
            rkey,
            tamper,
        } => {
            let m = msg.message();
            let id = end.id(*id);
            let mut segs: Vec<Segment> = m
                .attachments
                .iter()
                .enumerate()
                .map(|(i, a)| Segment {
                    addr: addr.wrapping_add(i as u64),
                    len: a.len() as u64,
                    rkey: *rkey,
                })
                .collect();
            let tampered = *tamper && !segs.is_empty();
            if tampered {
                segs[0].len = segs[0].len.wrapping_add(1);
            }
            Packet::encode_pull_rts(&mut out, *credits, id, &m, &segs);
            (fits(&m) && !tampered).then(|| Packet::PullRts {
                id,
                head: inline(&m),
                segments: segs,
            })
        }
        Op::PeerPushRts { credits, id, msg } => {
            let m = msg.message();
            let id = end.id(*id);
            Packet::encode_push_rts(&mut out, *credits, id, &m);
            fits(&m).then(|| Packet::PushRts {
                id,
                head: inline(&m),
            })
        }
        Op::PeerCts {
            credits,
            id,
            exact,
            lens,
        } => {
            let id = end.id(*id);
            let lens: Vec<u64> = match end.announced.get(&id) {
                Some((_, l)) if *exact => l.clone(),
                _ => lens.iter().map(|l| *l as u64).collect(),
            };
            let segs: Vec<Segment> = lens
                .iter()
                .map(|l| Segment {
                    addr: 0xabc0,
                    len: *l,
                    rkey: 77,
                })
                .collect();
            Packet::encode_cts(&mut out, *credits, id, &segs);
            (segs.len() <= lim.max_attachments as usize).then(|| Packet::Cts { id, segments: segs })
        }
        Op::PeerFin { credits, id } => control(&mut out, *credits, Packet::Fin { id: end.id(*id) }),
        Op::PeerPushDone { credits, id } => {
            control(&mut out, *credits, Packet::PushDone { id: end.id(*id) })
        }
        Op::PeerCredit { credits } => control(&mut out, *credits, Packet::Credit),
        Op::PeerRefuse {
            credits,
            id,
            reason,
        } => control(
            &mut out,
            *credits,
            Packet::Refuse {
                id: end.id(*id),
                reason: *reason,
            },
        ),
        Op::PeerRaw(b) => return Some((Bytes::copy_from_slice(b), None)),
        _ => return None,
    };
    Some((out.freeze(), expect))
}

fn control(out: &mut BytesMut, credits: u16, p: Packet) -> Option<Packet> {
    Packet::encode_control(out, credits, &p);
    Some(p)
}

fn inline(m: &Message) -> Inline {
    Inline {
        wire: rpc_core::wire::WireHeader {
            header: m.header,
            n_attach: m.attachments.len() as u16,
            len: m.payload_len(),
        },
        body: m.body.clone(),
        lens: m.attachments.iter().map(|a| a.len() as u64).collect(),
        body_last: false,
    }
}

fn check_plan(spec: &MsgSpec, slot: u16, threshold: u16, pull: bool) {
    let m = spec.message();
    let dir = if pull {
        Direction::Pull
    } else {
        Direction::Push
    };
    let slot = slot as usize;
    let mut out = BytesMut::new();
    match Plan::for_message(&m, slot, threshold as usize, dir) {
        Ok(Plan::Eager) => {
            Packet::encode_eager(&mut out, 0, &m);
            assert!(
                out.len() <= slot,
                "eager packet of {} bytes for {slot}-byte slots",
                out.len()
            );
            let threshold = (threshold as usize).max(PACKET_HEADER_LEN + HEADER_LEN);
            assert!(
                out.len() <= threshold,
                "eager packet of {} bytes over the threshold",
                out.len()
            );
        }
        Ok(Plan::Rendezvous(d)) => {
            assert_eq!(d, dir);
            let segs: Vec<Segment> = m
                .attachments
                .iter()
                .map(|a| Segment {
                    addr: 0,
                    len: a.len() as u64,
                    rkey: 0,
                })
                .collect();
            match d {
                Direction::Pull => Packet::encode_pull_rts(&mut out, 0, 1, &m, &segs),
                Direction::Push => Packet::encode_push_rts(&mut out, 0, 1, &m),
            }
            assert!(
                out.len() <= slot,
                "rendezvous packet of {} bytes for {slot}-byte slots",
                out.len()
            );
        }
        Err(e) => assert!(e.inline > slot, "{e}"),
    }
}

/// The target.
pub fn run(data: &[u8]) {
    let mut r = Reader::new(data);
    let slots = 2 + (r.u8() % 15) as u32;
    let limits = Limits {
        max_attachments: (r.u8() % 17) as u16,
        max_message_size: 1 << (10 + r.u8() % 21),
    };
    let mut end = End::new(slots, limits, 0);
    let mut ops = 0;
    while !r.is_empty() && ops < 512 {
        ops += 1;
        let op = read_op(&mut r);
        let result = match &op {
            Op::SendPull(m) => {
                end.send(m, true);
                Ok(())
            }
            Op::SendPush(m) => {
                end.send(m, false);
                Ok(())
            }
            Op::ReadDone(id) => {
                let id = end.id(*id);
                end.read_done(id);
                Ok(())
            }
            Op::ReturnCredits => {
                if end.credits.should_return() {
                    end.take(false).expect("should_return implies a credit");
                }
                Ok(())
            }
            Op::Disconnect => Err(None),
            Op::Plan {
                msg,
                slot,
                threshold,
                pull,
            } => {
                check_plan(msg, *slot, *threshold, *pull);
                Ok(())
            }
            peer => {
                let (bytes, expect) = peer_packet(&end, peer).expect("a peer packet");
                if let Some(p) = &expect {
                    // A well-formed encoding parses back to what was encoded.
                    let (got, _) = Packet::parse(bytes.clone(), &end.limits)
                        .unwrap_or_else(|e| panic!("parse refused a well-formed {p:?}: {e}"));
                    assert_eq!(&got, p, "parse(encode(p)) != p");
                } else if !matches!(peer, Op::PeerRaw(_)) {
                    assert!(
                        Packet::parse(bytes.clone(), &end.limits).is_err(),
                        "parse accepted a malformed packet for {peer:?}"
                    );
                }
                end.receive(bytes).map_err(Some)
            }
        };
        if let Err(_violation) = result {
            // The connection is closed: the table hands back every buffer; a new one starts.
            end.drain_and_check();
            let next = end.next_buf;
            end = End::new(slots, limits, next);
        }
    }
    end.drain_and_check();
}
