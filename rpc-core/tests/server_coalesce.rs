//! The server's connection task answers a bunch of requests with one flush: after a turn that
//! read a bunch (8 or more requests), a transport that coalesces writes (TCP) gets one
//! scheduling turn for more before the answers go out; one that does not (RDMA) gets its
//! answers at once, and so does a smaller bunch. The
//! transport is the in-process one, with a writer that records how many answers each flush
//! carried; the frames are sent by hand, on a current-thread runtime, so the order is fixed.

mod common;

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use common::{request, Echo};
use futures::{Sink, SinkExt, StreamExt};
use rpc_core::mem::{self, MemReader, MemTransport, MemWriter};
use rpc_core::wire::{Kind, Message};
use rpc_core::{Config, ShutdownHandle, Transport};

/// Answers fed to the writer since its last flush, and the count of every flush that carried
/// any.
#[derive(Default)]
struct Flushes {
    fed: usize,
    sizes: Vec<usize>,
}

/// The in-process transport, saying whether it coalesces writes, counting its flushes.
struct Counted {
    inner: MemTransport,
    coalesce: bool,
    flushes: Arc<Mutex<Flushes>>,
}

struct CountedWriter {
    inner: MemWriter,
    flushes: Arc<Mutex<Flushes>>,
}

impl Transport for Counted {
    type Reader = MemReader;
    type Writer = CountedWriter;
    fn split(self) -> (MemReader, CountedWriter) {
        let (r, w) = self.inner.split();
        let flushes = self.flushes;
        (r, CountedWriter { inner: w, flushes })
    }
    fn peer(&self) -> String {
        "counted".into()
    }
    fn coalesce_writes(&self) -> bool {
        self.coalesce
    }
}

impl Sink<Message> for CountedWriter {
    type Error = io::Error;
    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_ready(cx)
    }
    fn start_send(mut self: Pin<&mut Self>, msg: Message) -> io::Result<()> {
        self.flushes.lock().unwrap().fed += 1;
        Pin::new(&mut self.inner).start_send(msg)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        if let Poll::Ready(Ok(())) = r {
            let mut f = self.flushes.lock().unwrap();
            if f.fed > 0 {
                let n = std::mem::take(&mut f.fed);
                f.sizes.push(n);
            }
        }
        r
    }
    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

struct CountedListener {
    inner: mem::MemListener,
    coalesce: bool,
    flushes: Arc<Mutex<Flushes>>,
}

impl rpc_core::Listener for CountedListener {
    type Transport = Counted;
    async fn accept(&mut self) -> io::Result<Counted> {
        Ok(Counted {
            inner: self.inner.accept().await?,
            coalesce: self.coalesce,
            flushes: self.flushes.clone(),
        })
    }
}

/// Sends requests 1..=`bunch` together, lets the runtime run its other tasks once, sends one
/// more, and returns how many answers each of the server's flushes carried (after a first
/// call, which sets the connection up).
async fn flushes_of_a_bunch(coalesce: bool, bunch: u64) -> Vec<usize> {
    let flushes = Arc::new(Mutex::new(Flushes::default()));
    let (listener, connector) = mem::listener();
    let shutdown = ShutdownHandle::new();
    let serving = tokio::spawn(rpc_core::server::serve(
        CountedListener {
            inner: listener,
            coalesce,
            flushes: flushes.clone(),
        },
        Echo,
        Config::default(),
        shutdown.clone(),
        Default::default(),
    ));
    let (mut answers, mut requests) = connector.connect().await.unwrap().split();
    requests.send(request(1, 10)).await.unwrap();
    let first = answers.next().await.unwrap().unwrap();
    assert_eq!(first.header.id, 10);
    assert_eq!(flushes.lock().unwrap().sizes, vec![1]);
    flushes.lock().unwrap().sizes.clear();

    for id in 1..=bunch {
        requests.feed(request(1, id)).await.unwrap();
    }
    requests.flush().await.unwrap();
    // The server's task runs now: it reads the bunch, and either answers it at once or
    // yields; this task's turn (deferred before the server's) comes first.
    tokio::task::yield_now().await;
    requests.send(request(1, bunch + 1)).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..=bunch {
        let a = answers.next().await.unwrap().unwrap();
        assert_eq!(a.header.kind, Kind::Response);
        assert_eq!(a.header.aux, 0, "the call failed");
        ids.push(a.header.id);
    }
    assert_eq!(ids, (1..=bunch + 1).collect::<Vec<_>>());
    let sizes = flushes.lock().unwrap().sizes.clone();
    drop((answers, requests));
    shutdown.shutdown();
    serving.await.unwrap();
    sizes
}

#[tokio::test(flavor = "current_thread")]
async fn a_coalescing_transport_gets_a_bunch_in_one_flush() {
    assert_eq!(flushes_of_a_bunch(true, 8).await, vec![9]);
}

#[tokio::test(flavor = "current_thread")]
async fn a_smaller_bunch_is_answered_at_once() {
    assert_eq!(flushes_of_a_bunch(true, 7).await, vec![7, 1]);
}

#[tokio::test(flavor = "current_thread")]
async fn other_transports_get_answers_at_once() {
    assert_eq!(flushes_of_a_bunch(false, 8).await, vec![8, 1]);
}
