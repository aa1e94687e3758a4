//! `PayloadMut` freezes in place; `Client::payload_mut` lends from the transport's memory when
//! it has some, and falls back to the heap when it has none or lends nothing; a handler's
//! `server::payload_mut` lends from its connection's. The memory here is an in-process fake
//! lender over the in-process transport (`rpc_core::mem`); the RDMA transport's registered
//! pools are tested on real devices (`transport-rdma/tests/rpc_guest.rs`,
//! `lent_payloads_are_sent_without_a_copy`, and the suite's `lent_payloads`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rpc_core::mem::{self, MemTransport};
use rpc_core::payload::{LentBuffer, PayloadMemory};
use rpc_core::{Client, Config, Payload, PayloadMut, Transport};

/// A fake lender: up to `free` buffers, each counted back when its payload is gone.
struct FakeMemory {
    free: Arc<AtomicUsize>,
}

struct FakeBuf(Vec<u8>, Arc<AtomicUsize>);

impl AsRef<[u8]> for FakeBuf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for FakeBuf {
    fn drop(&mut self) {
        self.1.fetch_add(1, Ordering::SeqCst);
    }
}

impl LentBuffer for FakeBuf {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
    fn freeze(self: Box<Self>) -> Payload {
        Payload::from_owner(*self)
    }
}

impl PayloadMemory for FakeMemory {
    fn lend(&self, len: usize) -> Option<PayloadMut> {
        self.free
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .ok()?;
        Some(PayloadMut::lent(Box::new(FakeBuf(
            vec![0xee; len],
            self.free.clone(),
        ))))
    }
}

/// The in-process transport with the fake lender attached.
struct Lending(MemTransport, Arc<AtomicUsize>);

impl Transport for Lending {
    type Reader = <MemTransport as Transport>::Reader;
    type Writer = <MemTransport as Transport>::Writer;
    fn split(self) -> (Self::Reader, Self::Writer) {
        self.0.split()
    }
    fn peer(&self) -> String {
        self.0.peer()
    }
    fn payload_memory(&self) -> Option<Arc<dyn PayloadMemory>> {
        Some(Arc::new(FakeMemory {
            free: self.1.clone(),
        }))
    }
}

#[test]
fn payload_mut_freezes_in_place() {
    let free = Arc::new(AtomicUsize::new(0));
    let mut m = PayloadMut::lent(Box::new(FakeBuf(vec![0xee; 8], free.clone())));
    assert!(m.is_lent());
    m.copy_from_slice(b"abcdefgh");
    let at = m.as_ptr();
    let p = m.freeze();
    assert_eq!(p.as_ptr(), at, "freezing copied the bytes");
    assert_eq!(&*p, b"abcdefgh");
    let q = p.slice(2..4);
    drop(p);
    assert_eq!(
        free.load(Ordering::SeqCst),
        0,
        "returned while a view lives"
    );
    drop(q);
    assert_eq!(free.load(Ordering::SeqCst), 1);

    let mut h = PayloadMut::zeroed(3);
    assert!(!h.is_lent());
    assert_eq!(&*h, &[0, 0, 0]);
    h[1] = 5;
    let at = h.as_ptr();
    let p = h.freeze();
    assert_eq!((p.as_ptr(), &*p), (at, &[0u8, 5, 0][..]));
    assert_eq!(
        format!("{:?}", PayloadMut::zeroed(2)),
        "PayloadMut { len: 2, lent: false }"
    );
}

#[tokio::test]
async fn payload_mut_lends_from_the_transport_then_the_heap() {
    let (a, _b) = mem::pair();
    let free = Arc::new(AtomicUsize::new(1));
    let client = Client::new(Lending(a, free.clone()), Config::default());
    let mut first = client.payload_mut(16);
    assert!(first.is_lent(), "the transport's memory was not used");
    assert_eq!(first.len(), 16);
    first.fill(7);
    // the lender has no more: the heap, zeroed
    let second = client.payload_mut(16);
    assert!(!second.is_lent());
    assert_eq!(&*second, &[0u8; 16]);
    let p = first.freeze();
    assert_eq!(free.load(Ordering::SeqCst), 0);
    drop(p);
    assert_eq!(free.load(Ordering::SeqCst), 1, "the buffer did not go back");
    assert!(client.payload_mut(4).is_lent());

    // a transport with no memory of its own: always the heap
    let (a, _b) = mem::pair();
    let plain = Client::new(a, Config::default());
    assert!(!plain.payload_mut(8).is_lent());
}

/// A listener whose connections lend from `free`.
struct LendingListener(mem::MemListener, Arc<AtomicUsize>);

impl rpc_core::Listener for LendingListener {
    type Transport = Lending;
    async fn accept(&mut self) -> std::io::Result<Lending> {
        Ok(Lending(self.0.accept().await?, self.1.clone()))
    }
}

/// `Fill.fill(len) -> (lent, bytes)`: a payload made with `server::payload_mut`.
struct Fill;

impl rpc_core::Service for Fill {
    const NAME: &'static str = "Fill";

    fn method_name(&self, m: u32) -> Option<&'static str> {
        (m == 1).then_some("Fill.fill")
    }

    async fn dispatch(
        &self,
        _m: u32,
        req: rpc_core::Request,
    ) -> Result<rpc_core::Reply, rpc_core::ServerError> {
        let (len,): (u64,) = req.decode::<rpc_core::Bincode, _>("Fill.fill")?;
        // across an await, as handlers that read a disk would
        tokio::task::yield_now().await;
        let mut buf = rpc_core::server::payload_mut(len as usize);
        let lent = buf.is_lent();
        buf.fill(0x5a);
        rpc_core::Reply::encode::<rpc_core::Bincode, _>(&(lent, buf.freeze()))
    }
}

#[tokio::test]
async fn handlers_get_memory_of_their_connection() {
    // outside a handler: the heap
    assert!(!rpc_core::server::payload_mut(8).is_lent());
    let free = Arc::new(AtomicUsize::new(4));
    let (listener, connector) = mem::listener();
    let shutdown = rpc_core::ShutdownHandle::new();
    let serving = tokio::spawn(rpc_core::server::serve(
        LendingListener(listener, free.clone()),
        Fill,
        Config::default(),
        shutdown.clone(),
        Default::default(),
    ));
    let client = Client::new(connector.connect().await.unwrap(), Config::default());
    let (lent, p): (bool, Payload) = client
        .call::<rpc_core::Bincode, _, _>(1, "Fill.fill", &(100u64,))
        .await
        .unwrap();
    assert!(
        lent,
        "the handler's buffer did not come from its connection"
    );
    assert_eq!(&*p, &[0x5a; 100][..]);
    // the in-process transport hands the payload over as it is: it still holds the buffer
    assert_eq!(free.load(Ordering::SeqCst), 3);
    drop(p);
    assert_eq!(free.load(Ordering::SeqCst), 4, "the buffer did not go back");
    shutdown.shutdown();
    serving.await.unwrap();
}
