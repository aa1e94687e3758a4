//! The wire format: one fixed 32-byte header per frame, then an attachment table, the body and
//! the attachments.
//!
//! ```text
//!  0      2   3    4       6         8              16        20     24             32
//!  +------+---+----+-------+---------+---------------+---------+------+--------------+
//!  | magic|ver|kind| flags | n_attach|   request id  | method  | aux  |  len (u64)   |
//!  +------+---+----+-------+---------+---------------+---------+------+--------------+
//!  | n_attach x u64 attachment lengths | body | attachment 0 | attachment 1 | ...     |
//!  +-----------------------------------+------+--------------+--------------+---------+
//! ```
//! All integers are little endian. `len` counts every byte after the header. `aux` carries the
//! remaining deadline in microseconds on a request (0: none) and the status on a response
//! (0: success, otherwise a [`ServerErrorKind`](crate::ServerErrorKind) code with a UTF-8
//! message as the body).
//!
//! Attachments are [`Payload`]s lifted out of the serialised arguments and results (see
//! [`crate::payload`]): they never pass through the codec, so a transport can move them without
//! a copy (TCP: one vectored write; RDMA: a rendezvous).

use std::fmt;
use std::io;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio_util::codec::{Decoder, Encoder};

use crate::Payload;

/// First two bytes of every frame (`"RR"`).
pub const MAGIC: [u8; 2] = *b"RR";
/// The protocol version this build speaks.
pub const VERSION: u8 = 1;
/// Size of the fixed frame header.
pub const HEADER_LEN: usize = 32;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// A call: `method` names it, the body holds the encoded arguments.
    Request = 1,
    /// The answer to the request with the same id.
    Response = 2,
    /// The caller gave up on the request with this id; the server stops its handler.
    Cancel = 3,
    /// Keep-alive probe; the peer answers with [`Kind::Pong`].
    Ping = 4,
    /// Answer to [`Kind::Ping`].
    Pong = 5,
    /// The server is draining: no new requests on this connection.
    GoAway = 6,
    /// Opens a connection. The client's carries its credentials (the shared token, possibly
    /// empty) as the body; the server answers with a `Hello` of its own when it accepts.
    Hello = 7,
}

impl Kind {
    pub(crate) fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Request,
            2 => Kind::Response,
            3 => Kind::Cancel,
            4 => Kind::Ping,
            5 => Kind::Pong,
            6 => Kind::GoAway,
            7 => Kind::Hello,
            _ => return None,
        })
    }
}

/// The logical header of a frame (the lengths are derived from the message when it is encoded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// Reserved flag bits; zero in version 1.
    pub flags: u16,
    /// Request id, chosen by the caller, unique among its calls in flight on a connection.
    pub id: u64,
    /// Method id (see [`method_id`](crate::method_id)); zero on frames other than requests.
    pub method: u32,
    /// Deadline in microseconds on a request, status on a response.
    pub aux: u32,
}

impl Header {
    /// A header of `kind` for request `id`, other fields zero.
    pub const fn new(kind: Kind, id: u64) -> Header {
        Header {
            kind,
            flags: 0,
            id,
            method: 0,
            aux: 0,
        }
    }
}

/// One frame: header, encoded body, and the payloads attached to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The frame header.
    pub header: Header,
    /// The codec's encoding of the arguments or result (payloads replaced by their index).
    pub body: Bytes,
    /// Bulk data, in the order the codec met the payloads.
    pub attachments: Attachments,
}

impl Message {
    /// A message with no body and no attachments (cancel, ping, pong, go-away).
    pub fn control(kind: Kind, id: u64) -> Message {
        Message {
            header: Header::new(kind, id),
            body: Bytes::new(),
            attachments: Attachments::new(),
        }
    }

    /// Bytes after the fixed header: attachment table, body and attachments.
    pub fn payload_len(&self) -> u64 {
        let table = 8 * self.attachments.len() as u64;
        let att: u64 = self.attachments.iter().map(|a| a.len() as u64).sum();
        table + self.body.len() as u64 + att
    }

    /// Total size on the wire.
    pub fn wire_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len()
    }

    /// Whether the whole frame fits in one eager (inline) message of `threshold` bytes;
    /// larger ones send their attachments on the bulk path.
    pub fn is_eager(&self, threshold: usize) -> bool {
        self.wire_len() <= threshold as u64
    }

    /// Writes the fixed header and the attachment table (everything before the body). `out`
    /// may be a growing buffer or a slice with room for it (a `&mut [u8]` panics when full).
    pub fn encode_head<B: BufMut>(&self, out: &mut B) {
        // Built on the stack and copied once: cheaper than nine bounds-checked puts.
        out.put_slice(&self.head(self.payload_len()));
        self.encode_table(out);
    }

    /// Writes the attachment table: each attachment's length.
    fn encode_table<B: BufMut>(&self, out: &mut B) {
        for a in &self.attachments {
            out.put_u64_le(a.len() as u64);
        }
    }

    /// The fixed header, for a frame of `payload_len` bytes after it.
    fn head(&self, payload_len: u64) -> [u8; HEADER_LEN] {
        let mut head = [0u8; HEADER_LEN];
        head[0..2].copy_from_slice(&MAGIC);
        head[2] = VERSION;
        head[3] = self.header.kind as u8;
        head[4..6].copy_from_slice(&self.header.flags.to_le_bytes());
        head[6..8].copy_from_slice(&(self.attachments.len() as u16).to_le_bytes());
        head[8..16].copy_from_slice(&self.header.id.to_le_bytes());
        head[16..20].copy_from_slice(&self.header.method.to_le_bytes());
        head[20..24].copy_from_slice(&self.header.aux.to_le_bytes());
        head[24..32].copy_from_slice(&payload_len.to_le_bytes());
        head
    }

    /// Writes the whole frame into `out`, which must be exactly
    /// [`wire_len`](Self::wire_len) bytes long (it panics otherwise): the bytes of
    /// [`encode_into`](Self::encode_into), with one length check per part instead of one per
    /// field, and the frame's length taken from `out` rather than summed again (a small
    /// message's send path, where this is most of the encoding).
    pub fn encode_exact(&self, out: &mut [u8]) {
        let (head, rest) = out
            .split_first_chunk_mut::<HEADER_LEN>()
            .expect("room for the frame header");
        *head = self.head(rest.len() as u64);
        self.encode_rest_exact(rest);
    }

    /// Writes what follows the fixed header (attachment table, body, attachments) into `out`,
    /// which must be exactly [`payload_len`](Self::payload_len) bytes long (it panics
    /// otherwise): for [`encode_exact`](Self::encode_exact), and for packets that carry the
    /// header in a form of their own (the RDMA transport's short eager packet).
    #[inline(always)]
    pub fn encode_rest_exact(&self, out: &mut [u8]) {
        let (table, rest) = out.split_at_mut(8 * self.attachments.len());
        for (entry, a) in table.chunks_exact_mut(8).zip(&self.attachments) {
            entry.copy_from_slice(&(a.len() as u64).to_le_bytes());
        }
        let (body, mut rest) = rest.split_at_mut(self.body.len());
        body.copy_from_slice(&self.body);
        for a in &self.attachments {
            let (bytes, after) = rest.split_at_mut(a.len());
            bytes.copy_from_slice(a);
            rest = after;
        }
        assert!(rest.is_empty(), "a frame fills exactly its wire length");
    }

    /// Writes the whole frame into `out` (copies body and attachments): a growing buffer, or a
    /// slice with room for [`wire_len`](Self::wire_len) bytes (a `&mut [u8]` panics when full).
    pub fn encode_into<B: BufMut>(&self, out: &mut B) {
        out.put_slice(&self.head(self.payload_len()));
        self.encode_rest_into(out);
    }

    /// Writes what follows the fixed header (attachment table, body, attachments) into `out`:
    /// [`encode_into`](Self::encode_into) without the header, for packets that carry the header
    /// in a form of their own (the RDMA transport's short eager packet).
    pub fn encode_rest_into<B: BufMut>(&self, out: &mut B) {
        self.encode_table(out);
        out.put_slice(&self.body);
        for a in &self.attachments {
            out.put_slice(a);
        }
    }
}

/// Limits a decoder enforces before it reserves any memory for a frame.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest frame accepted (bytes after the header).
    pub max_message_size: u64,
    /// Most attachments on one frame.
    pub max_attachments: u16,
}

/// Why a frame was refused. Carried inside an [`io::Error`] of kind `InvalidData` by decoders,
/// so that a server can still answer a request whose header was readable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first bytes are not this protocol's magic.
    #[error("bad magic {0:02x?}: the peer does not speak rdma-rpc")]
    BadMagic([u8; 2]),
    /// A protocol version this build does not speak.
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    Version(u8),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The frame is larger than the configured limit.
    #[error("frame {kind:?} #{id} of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Kind of the refused frame.
        kind: Kind,
        /// Its request id, so the refusal can be answered.
        id: u64,
        /// Its claimed length.
        len: u64,
        /// The limit in force.
        limit: u64,
    },
    /// Too many attachments.
    #[error("frame #{id} has {count} attachments, more than the limit of {limit}")]
    TooManyAttachments {
        /// Request id.
        id: u64,
        /// Claimed count.
        count: u16,
        /// The limit in force.
        limit: u16,
    },
    /// The attachment table does not fit the frame length.
    #[error("frame #{id}: attachment lengths add up to more than the frame length {len}")]
    BadLengths {
        /// Request id.
        id: u64,
        /// The frame length.
        len: u64,
    },
    /// Reserved flag bits set.
    #[error("frame #{id}: reserved flags {flags:#x} set")]
    Flags {
        /// Request id.
        id: u64,
        /// The flags seen.
        flags: u16,
    },
}

impl FrameError {
    /// The `FrameError` inside an `io::Error` produced by a decoder, if any.
    pub fn from_io(e: &io::Error) -> Option<&FrameError> {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<FrameError>())
    }
}

impl From<FrameError> for io::Error {
    fn from(e: FrameError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidData, e)
    }
}

/// A parsed fixed header with its wire lengths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireHeader {
    /// The logical header.
    pub header: Header,
    /// Number of attachments.
    pub n_attach: u16,
    /// Bytes after the fixed header.
    pub len: u64,
}

impl WireHeader {
    /// Parses and validates a fixed header against `limits`.
    pub fn parse(b: &[u8; HEADER_LEN], limits: &Limits) -> Result<WireHeader, FrameError> {
        let mut b = &b[..];
        let magic = [b.get_u8(), b.get_u8()];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = b.get_u8();
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let kind_byte = b.get_u8();
        let kind = Kind::from_u8(kind_byte).ok_or(FrameError::UnknownKind(kind_byte))?;
        let flags = b.get_u16_le();
        let n_attach = b.get_u16_le();
        let id = b.get_u64_le();
        let method = b.get_u32_le();
        let aux = b.get_u32_le();
        let len = b.get_u64_le();
        let header = Header {
            kind,
            flags,
            id,
            method,
            aux,
        };
        WireHeader::check(header, n_attach, len, limits)
    }

    /// A header of a frame with `n_attach` attachments and `len` bytes after its fixed header,
    /// checked as [`parse`](Self::parse) checks one it read (flags, lengths, `limits`): for
    /// headers read from another form (the RDMA transport's short eager packet).
    pub fn check(
        header: Header,
        n_attach: u16,
        len: u64,
        limits: &Limits,
    ) -> Result<WireHeader, FrameError> {
        let Header {
            kind, flags, id, ..
        } = header;
        if flags != 0 {
            return Err(FrameError::Flags { id, flags });
        }
        if len > limits.max_message_size {
            return Err(FrameError::TooLarge {
                kind,
                id,
                len,
                limit: limits.max_message_size,
            });
        }
        if n_attach > limits.max_attachments {
            return Err(FrameError::TooManyAttachments {
                id,
                count: n_attach,
                limit: limits.max_attachments,
            });
        }
        if 8 * n_attach as u64 > len {
            return Err(FrameError::BadLengths { id, len });
        }
        Ok(WireHeader {
            header,
            n_attach,
            len,
        })
    }

    /// Splits a complete frame's bytes after the fixed header (`rest`, exactly `len` long) into
    /// body and attachments, without copying.
    pub fn split(&self, rest: Bytes) -> Result<Message, FrameError> {
        debug_assert_eq!(rest.len() as u64, self.len);
        if self.n_attach == 0 {
            // The common small frame: all body.
            return Ok(Message {
                header: self.header,
                body: rest,
                attachments: Attachments::new(),
            });
        }
        // Checked in place first (the one check `split_ref` makes), so that nothing is split
        // off a frame that turns out to be bad; then cut into views of `rest`.
        let (body, attachments) = self.split_ref(&rest)?.split_copy(rest.clone());
        Ok(Message {
            header: self.header,
            body,
            attachments,
        })
    }
}

impl WireHeader {
    /// Reads a complete frame's bytes after the fixed header (`rest`, exactly `len` long) in
    /// place, as [`split`](Self::split) splits them: the same checks, nothing copied.
    pub fn split_ref<'a>(&self, rest: &'a [u8]) -> Result<FrameRef<'a>, FrameError> {
        debug_assert_eq!(rest.len() as u64, self.len);
        let bad = || FrameError::BadLengths {
            id: self.header.id,
            len: self.len,
        };
        let (table, rest) = rest
            .split_at_checked(8 * self.n_attach as usize)
            .ok_or_else(bad)?;
        let mut total: u64 = 0;
        for c in table.chunks_exact(8) {
            let l = u64::from_le_bytes(c.try_into().expect("chunks of 8"));
            total = total
                .checked_add(l)
                .filter(|t| *t <= rest.len() as u64)
                .ok_or_else(bad)?;
        }
        let (body, data) = rest.split_at(rest.len() - total as usize);
        Ok(FrameRef {
            header: self.header,
            body,
            table,
            data,
        })
    }
}

/// A complete frame read in place from the buffer it borrows (a receive slot, say), checked
/// as a [`Message`] decoded from it would be ([`WireHeader::split_ref`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRef<'a> {
    /// The frame's header.
    pub header: Header,
    /// Its body.
    pub body: &'a [u8],
    /// its attachments' lengths (8 bytes each, little-endian), checked against `data`
    table: &'a [u8],
    /// its attachments, one after the other
    data: &'a [u8],
}

impl<'a> FrameRef<'a> {
    /// Its attachments, in order, borrowed.
    pub fn attachments(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let mut data = self.data;
        self.table.chunks_exact(8).map(move |c| {
            let l = u64::from_le_bytes(c.try_into().expect("chunks of 8")) as usize;
            let (a, rest) = data.split_at(l);
            data = rest;
            a
        })
    }

    /// Its body and attachments as views of `copy`, a copy of the frame's bytes after its
    /// fixed header (the bytes [`WireHeader::split_ref`] read): one copy for all of them.
    ///
    /// # Panics
    /// If `copy` is not as long as those bytes.
    pub fn split_copy(&self, mut copy: Bytes) -> (Bytes, Attachments) {
        assert_eq!(
            copy.len(),
            self.table.len() + self.body.len() + self.data.len(),
            "a copy of the frame's bytes after its header"
        );
        copy.advance(self.table.len());
        let body = copy.split_to(self.body.len());
        let attachments = self
            .attachments()
            .map(|a| Payload::from(copy.split_to(a.len())))
            .collect();
        (body, attachments)
    }

    /// Its body and attachments, owned, without a copy, when there is nothing to copy: a
    /// body of at most one byte ([`tiny_body`]) and attachments that hold no bytes. `None`
    /// otherwise (then [`split_copy`](Self::split_copy) makes one copy for all of them).
    pub fn owned_if_tiny(&self) -> Option<(Bytes, Attachments)> {
        if self.data.is_empty() {
            Some((tiny_body(self.body)?, self.to_attachments()))
        } else {
            None
        }
    }

    /// How many bytes its attachments hold together.
    pub fn attachment_bytes(&self) -> usize {
        self.data.len()
    }

    /// Its attachments copied into payloads of their own (an empty one allocates nothing).
    #[inline]
    pub fn to_attachments(&self) -> Attachments {
        self.attachments()
            .map(|a| Payload::from(Bytes::copy_from_slice(a)))
            .collect()
    }
}

/// Every byte value, for [`tiny_body`].
static BYTE_VALUES: [u8; 256] = {
    let mut all = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        all[i] = i as u8;
        i += 1;
    }
    all
};

/// `body` as a `Bytes` that needs no memory of its own, if it has at most one byte: empty, or
/// a view of a static copy of its byte. `None` for a longer body.
///
/// A body of one byte is common here: payloads are lifted out of the arguments and results
/// into attachments, so a method whose argument or result is a lone [`Payload`] (a block, an
/// object) has a body that is just that payload's index, one byte. Such a body then costs
/// neither a copy into a shared chunk nor its reference count, on either side.
#[inline]
pub fn tiny_body(body: &[u8]) -> Option<Bytes> {
    match body {
        [] => Some(Bytes::new()),
        [b] => Some(Bytes::from_static(std::slice::from_ref(
            &BYTE_VALUES[usize::from(*b)],
        ))),
        _ => None,
    }
}

/// `tokio_util` codec for frames: decodes into [`Message`]s that share the read buffer (no copy),
/// refuses oversized frames before reserving memory, and encodes by copying into the write
/// buffer (transports that want zero-copy for large attachments write them separately).
#[derive(Debug, Clone)]
pub struct FrameCodec {
    limits: Limits,
    head: Option<WireHeader>,
    /// the most the next frame may hold, while it is the connection's first (its greeting)
    first: Option<u64>,
}

/// The most bytes after its header that a connection's first frame may hold when a transport
/// reads with [`FrameCodec::with_greeting_limit`]: that frame is a greeting (a client's carries
/// its token), or a server's refusal or early ping, so a peer not yet authenticated cannot
/// make the reader wait for (and reserve) up to `max_message_size` before its token is
/// checked.
pub const GREETING_MAX: u64 = 64 * 1024;

impl FrameCodec {
    /// A codec enforcing `limits`.
    pub fn new(limits: Limits) -> FrameCodec {
        FrameCodec {
            limits,
            head: None,
            first: None,
        }
    }

    /// As [`new`](Self::new), for a connection's reader: its first frame, the greeting, may
    /// hold at most [`GREETING_MAX`] bytes (or `limits`' maximum, if lower); one that claims
    /// more is refused as [`FrameError::TooLarge`] before anything is reserved for it.
    pub fn with_greeting_limit(limits: Limits) -> FrameCodec {
        FrameCodec {
            first: Some(GREETING_MAX),
            ..FrameCodec::new(limits)
        }
    }
}

impl Decoder for FrameCodec {
    type Item = Message;
    type Error = io::Error;

    fn decode(&mut self, src: &mut BytesMut) -> io::Result<Option<Message>> {
        let head = match self.head {
            Some(h) => h,
            None => {
                if src.len() < HEADER_LEN {
                    src.reserve(HEADER_LEN - src.len());
                    return Ok(None);
                }
                let raw: &[u8; HEADER_LEN] = src[..HEADER_LEN].try_into().expect("length checked");
                let h = match self.first.take() {
                    None => WireHeader::parse(raw, &self.limits)?,
                    Some(most) => {
                        let limits = Limits {
                            max_message_size: self.limits.max_message_size.min(most),
                            ..self.limits
                        };
                        WireHeader::parse(raw, &limits)?
                    }
                };
                src.advance(HEADER_LEN);
                self.head = Some(h);
                h
            }
        };
        // `len` was checked against the limit, so this reservation is bounded.
        let len = head.len as usize;
        if src.len() < len {
            src.reserve(len - src.len());
            return Ok(None);
        }
        self.head = None;
        let rest = src.split_to(len).freeze();
        head.split(rest).map(Some).map_err(io::Error::from)
    }
}

impl Encoder<Message> for FrameCodec {
    type Error = io::Error;

    fn encode(&mut self, msg: Message, dst: &mut BytesMut) -> io::Result<()> {
        dst.reserve(msg.wire_len() as usize);
        msg.encode_into(dst);
        Ok(())
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

pub mod attachments;
pub use attachments::Attachments;

#[cfg(test)]
mod tests;
