//! [`Payload`]: owned bulk bytes that travel beside the encoded message, not through the codec.
//!
//! While the framework encodes a message it collects every `Payload` the codec meets into the
//! message's attachment list and writes only its index into the body; while it decodes, the
//! index is resolved against the received attachments. So payload bytes are never visited
//! byte by byte by serde, a transport can send them with one vectored write (TCP) or a
//! rendezvous (RDMA), and a received payload is a view into the buffer it arrived in.
//!
//! Outside the framework (say, a `Payload` inside a type you write to JSON yourself), a
//! `Payload` serialises as plain bytes.

use std::cell::RefCell;
use std::fmt;
use std::ops::Deref;

use bytes::Bytes;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use crate::wire::Attachments;

/// Name under which an attachment index is serialised (a newtype struct around a `u32`).
const TOKEN: &str = "$rdma_rpc::Payload";

/// Owned, immutable, cheaply clonable bytes for bulk data (values, objects, blocks).
///
/// Clones share the same memory. A `Payload` received from the network is a view into the
/// receive buffer (no copy); on RDMA that buffer is a registered pool buffer that goes back to
/// its pool when the last view is dropped, except for a payload that came in a message of at
/// most 256 bytes, which the RDMA transport copies out of its receive slot (cheaper than a
/// view, for so few bytes).
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Payload(Bytes);

impl Payload {
    /// An empty payload.
    pub const fn new() -> Payload {
        Payload(Bytes::new())
    }

    /// A payload over static bytes (no allocation).
    pub const fn from_static(bytes: &'static [u8]) -> Payload {
        Payload(Bytes::from_static(bytes))
    }

    /// A payload that borrows `owner`'s bytes for as long as any clone lives, then drops
    /// `owner`. This is how registered buffers become payloads without a copy.
    pub fn from_owner<T>(owner: T) -> Payload
    where
        T: AsRef<[u8]> + Send + 'static,
    {
        Payload(Bytes::from_owner(owner))
    }

    /// A payload holding a copy of `data`.
    pub fn copy_from_slice(data: &[u8]) -> Payload {
        Payload(Bytes::copy_from_slice(data))
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes as [`Bytes`] (no copy).
    pub fn as_bytes(&self) -> &Bytes {
        &self.0
    }

    /// Converts into [`Bytes`] (no copy).
    pub fn into_bytes(self) -> Bytes {
        self.0
    }

    /// A sub-range of this payload sharing the same memory.
    pub fn slice(&self, range: impl std::ops::RangeBounds<usize>) -> Payload {
        Payload(self.0.slice(range))
    }
}

/// Memory a connection lends for payloads it can send without a copy: on RDMA, buffers of the
/// connection's registered pool ([`Transport::payload_memory`](crate::Transport::payload_memory)).
pub trait PayloadMemory: Send + Sync + 'static {
    /// A buffer of `len` bytes, or `None` when none is free now (the caller then takes heap
    /// memory, which the transport copies when it sends it).
    fn lend(&self, len: usize) -> Option<PayloadMut>;
}

/// A buffer a [`PayloadMemory`] lends: its bytes, and how it becomes a [`Payload`].
pub trait LentBuffer: Send + 'static {
    /// The buffer's bytes.
    fn bytes(&self) -> &[u8];
    /// The buffer's bytes, to fill in.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// The filled buffer as a payload over the same memory (no copy).
    fn freeze(self: Box<Self>) -> Payload;
}

/// A payload being filled in place, before it is sent: from a connection's memory
/// (`Client::payload_mut`), so that the transport sends it without copying it (on RDMA, the
/// peer reads it straight from this registered buffer), or from the heap.
///
/// Its bytes are not zeroed when it comes from a connection's memory (they are what an earlier
/// transfer left there): write all of them. [`PayloadMut::freeze`] makes it a [`Payload`].
pub struct PayloadMut(MutInner);

enum MutInner {
    Heap(Vec<u8>),
    Lent(Box<dyn LentBuffer>),
}

impl PayloadMut {
    /// `len` zeroed bytes on the heap (sent with a copy on RDMA, like any heap payload).
    pub fn zeroed(len: usize) -> PayloadMut {
        PayloadMut(MutInner::Heap(vec![0; len]))
    }

    /// A lent buffer (what a [`PayloadMemory`] returns).
    pub fn lent(buf: Box<dyn LentBuffer>) -> PayloadMut {
        PayloadMut(MutInner::Lent(buf))
    }

    /// Whether the bytes are a connection's lent memory rather than the heap.
    pub fn is_lent(&self) -> bool {
        matches!(self.0, MutInner::Lent(_))
    }

    /// The filled bytes as a payload over the same memory (no copy).
    pub fn freeze(self) -> Payload {
        match self.0 {
            MutInner::Heap(v) => Payload::from(v),
            MutInner::Lent(b) => b.freeze(),
        }
    }
}

impl Deref for PayloadMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.0 {
            MutInner::Heap(v) => v,
            MutInner::Lent(b) => b.bytes(),
        }
    }
}

impl std::ops::DerefMut for PayloadMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            MutInner::Heap(v) => v,
            MutInner::Lent(b) => b.bytes_mut(),
        }
    }
}

impl fmt::Debug for PayloadMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PayloadMut")
            .field("len", &self.len())
            .field("lent", &self.is_lent())
            .finish()
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Payload(Bytes::from(v))
    }
}

impl From<Bytes> for Payload {
    fn from(b: Bytes) -> Payload {
        Payload(b)
    }
}

impl From<&'static [u8]> for Payload {
    fn from(b: &'static [u8]) -> Payload {
        Payload(Bytes::from_static(b))
    }
}

impl From<String> for Payload {
    fn from(s: String) -> Payload {
        Payload(Bytes::from(s))
    }
}

impl From<Payload> for Bytes {
    fn from(p: Payload) -> Bytes {
        p.0
    }
}

impl PartialEq<[u8]> for Payload {
    fn eq(&self, other: &[u8]) -> bool {
        self.0 == other
    }
}

impl PartialEq<Vec<u8>> for Payload {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.0 == other
    }
}

impl PartialEq<&[u8]> for Payload {
    fn eq(&self, other: &&[u8]) -> bool {
        self.0 == *other
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 16;
        write!(f, "Payload({} bytes", self.len())?;
        if !self.is_empty() {
            write!(f, ": {:02x?}", &self.0[..self.len().min(SHOWN)])?;
            if self.len() > SHOWN {
                f.write_str("…")?;
            }
        }
        f.write_str(")")
    }
}

thread_local! {
    /// Attachments collected by the encoder running on this thread, if one is.
    static OUTGOING: RefCell<Option<Attachments>> = const { RefCell::new(None) };
    /// Attachments the decoder running on this thread resolves indices against, if one is.
    static INCOMING: RefCell<Option<Attachments>> = const { RefCell::new(None) };
}

/// Runs `encode` with payload collection on: every `Payload` it serialises is appended to
/// `attachments` and serialised as its index.
///
/// What the thread-local held before is put back however `encode` ends, a panic included (a
/// user's `Serialize` may panic, and the server answers such a call and goes on): otherwise
/// the thread's later encoders would append to the panicked one's list.
pub(crate) fn collect_attachments<R>(
    attachments: &mut Attachments,
    encode: impl FnOnce() -> R,
) -> R {
    /// Puts the thread's previous list back when dropped, and the collected one in `out`.
    struct Restore<'a> {
        cell: &'a RefCell<Option<Attachments>>,
        prev: Option<Attachments>,
        out: &'a mut Attachments,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            *self.out = self.cell.replace(self.prev.take()).unwrap_or_default();
        }
    }
    // one look-up of the thread-local for both swaps (the encoder's own look-ups, from
    // `Payload::serialize`, nest inside it: no borrow is held across `encode`)
    OUTGOING.with(|o| {
        let prev = o.replace(Some(std::mem::take(attachments)));
        let _restore = Restore {
            cell: o,
            prev,
            out: attachments,
        };
        encode()
    })
}

/// Runs `decode` with `attachments` available to resolve payload indices.
///
/// As [`collect_attachments`]: the thread-local is put back however `decode` ends, so a
/// panicking `Deserialize` leaves no request's attachments behind (their buffers go back when
/// the unwinding drops them).
pub(crate) fn with_attachments<R>(attachments: Attachments, decode: impl FnOnce() -> R) -> R {
    /// Puts the thread's previous attachments back when dropped.
    struct Restore<'a> {
        cell: &'a RefCell<Option<Attachments>>,
        prev: Option<Attachments>,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            self.cell.replace(self.prev.take());
        }
    }
    // (as `collect_attachments`: one look-up, no borrow held across `decode`)
    INCOMING.with(|i| {
        let prev = i.replace(Some(attachments));
        let _restore = Restore { cell: i, prev };
        decode()
    })
}

impl Serialize for Payload {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let index = OUTGOING.with(|o| {
            o.borrow_mut().as_mut().map(|list| {
                list.push(self.clone());
                (list.len() - 1) as u32
            })
        });
        match index {
            Some(i) => serializer.serialize_newtype_struct(TOKEN, &i),
            None => serializer.serialize_bytes(&self.0),
        }
    }
}

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Payload, D::Error> {
        let in_frame = INCOMING.with(|i| i.borrow().is_some());
        if in_frame {
            deserializer.deserialize_newtype_struct(TOKEN, IndexVisitor)
        } else {
            deserializer.deserialize_byte_buf(BytesVisitor)
        }
    }
}

struct IndexVisitor;

impl<'de> Visitor<'de> for IndexVisitor {
    type Value = Payload;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an attachment index")
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Payload, D::Error> {
        let i = u32::deserialize(d)? as usize;
        INCOMING.with(|inc| {
            let inc = inc.borrow();
            let list = inc.as_ref().expect("checked by the caller");
            list.get(i).cloned().ok_or_else(|| {
                de::Error::custom(format_args!(
                    "payload refers to attachment {i}, but the frame has {}",
                    list.len()
                ))
            })
        })
    }
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Payload;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("bytes")
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Payload, E> {
        Ok(Payload::copy_from_slice(v))
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Payload, E> {
        Ok(Payload::from(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Payload, A::Error> {
        let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 16));
        while let Some(b) = seq.next_element::<u8>()? {
            v.push(b);
        }
        Ok(Payload::from(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_short() {
        let p = Payload::from(vec![7u8; 1000]);
        let s = format!("{p:?}");
        assert!(s.starts_with("Payload(1000 bytes: [07"), "{s}");
        assert!(s.len() < 100, "{s}");
        assert_eq!(format!("{:?}", Payload::new()), "Payload(0 bytes)");
    }

    #[test]
    fn conversions_share_memory() {
        let b = Bytes::from(vec![1u8, 2, 3]);
        let p = Payload::from(b.clone());
        assert_eq!(p.as_ptr(), b.as_ptr());
        assert_eq!(&*p, &[1, 2, 3]);
        let back: Bytes = p.clone().into();
        assert_eq!(back.as_ptr(), b.as_ptr());
        assert_eq!(p.slice(1..), [2u8, 3].as_slice());
    }

    #[test]
    fn from_owner_drops_owner_with_last_view() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        struct Owner(Vec<u8>, Arc<AtomicUsize>);
        impl AsRef<[u8]> for Owner {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.fetch_add(1, Ordering::SeqCst);
            }
        }
        let drops = Arc::new(AtomicUsize::new(0));
        let p = Payload::from_owner(Owner(vec![9; 10], drops.clone()));
        let q = p.slice(2..4);
        drop(p);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        assert_eq!(&*q, &[9, 9]);
        drop(q);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    /// A payload whose owner counts its drop.
    fn counted(drops: &std::sync::Arc<std::sync::atomic::AtomicUsize>) -> Payload {
        struct Owner(Vec<u8>, std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl AsRef<[u8]> for Owner {
            fn as_ref(&self) -> &[u8] {
                &self.0
            }
        }
        impl Drop for Owner {
            fn drop(&mut self) {
                self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        Payload::from_owner(Owner(vec![5; 8], drops.clone()))
    }

    #[test]
    fn a_panicking_decoder_leaves_no_attachments_behind() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let drops = std::sync::Arc::new(AtomicUsize::new(0));
        let mut atts = Attachments::new();
        atts.push(counted(&drops));
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_attachments(atts, || panic!("a user's Deserialize panics"))
        }));
        assert!(r.is_err());
        assert!(
            INCOMING.with(|i| i.borrow().is_none()),
            "the thread-local is put back"
        );
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the request's payload went back"
        );
        // a payload decoded outside a frame is read as bytes, not as an index
        use crate::codec::{Bincode, Codec};
        let mut encoded = Vec::new();
        Bincode::encode(&Payload::from(vec![1u8, 2]), &mut encoded).unwrap();
        let back: Payload = Bincode::decode(&encoded).unwrap();
        assert_eq!(&*back, &[1, 2]);
    }

    #[test]
    fn a_panicking_encoder_leaves_no_collection_on() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let drops = std::sync::Arc::new(AtomicUsize::new(0));
        let mut atts = Attachments::new();
        let p = counted(&drops);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            collect_attachments(&mut atts, || {
                use crate::codec::{Bincode, Codec};
                let _ = Bincode::encode(&p, &mut Vec::new());
                panic!("a user's Serialize panics")
            })
        }));
        assert!(r.is_err());
        assert!(
            OUTGOING.with(|o| o.borrow().is_none()),
            "collection is off again"
        );
        assert_eq!(atts.len(), 1, "what was collected is handed back");
        drop((atts, p));
        assert_eq!(drops.load(Ordering::SeqCst), 1, "nothing kept the payload");
    }
}
