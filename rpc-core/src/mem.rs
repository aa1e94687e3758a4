//! An in-process transport over channels: messages are handed over, never serialised to bytes.
//! For tests and examples of the protocol layer; not a stand-in for a network transport (it
//! skips framing, which the TCP and RDMA transports test themselves).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{Sink, Stream};
use tokio::sync::mpsc;
use tokio_util::sync::PollSender;

use crate::transport::{Listener, Transport};
use crate::wire::Message;

/// One end of an in-process connection.
#[derive(Debug)]
pub struct MemTransport {
    tx: mpsc::Sender<Message>,
    rx: mpsc::Receiver<Message>,
    name: &'static str,
}

/// Two connected ends.
pub fn pair() -> (MemTransport, MemTransport) {
    let (a_tx, a_rx) = mpsc::channel(1024);
    let (b_tx, b_rx) = mpsc::channel(1024);
    (
        MemTransport {
            tx: a_tx,
            rx: b_rx,
            name: "mem:a",
        },
        MemTransport {
            tx: b_tx,
            rx: a_rx,
            name: "mem:b",
        },
    )
}

/// Receiving half of a [`MemTransport`].
#[derive(Debug)]
pub struct MemReader(mpsc::Receiver<Message>);

/// Sending half of a [`MemTransport`].
#[derive(Debug)]
pub struct MemWriter(PollSender<Message>);

impl Transport for MemTransport {
    type Reader = MemReader;
    type Writer = MemWriter;

    fn split(self) -> (MemReader, MemWriter) {
        (MemReader(self.rx), MemWriter(PollSender::new(self.tx)))
    }

    fn peer(&self) -> String {
        self.name.to_owned()
    }
}

impl Stream for MemReader {
    type Item = io::Result<Message>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|m| m.map(Ok))
    }
}

fn gone() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "in-process peer dropped")
}

impl Sink<Message> for MemWriter {
    type Error = io::Error;
    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.poll_reserve(cx).map_err(|_| gone())
    }
    fn start_send(mut self: Pin<&mut Self>, item: Message) -> io::Result<()> {
        self.0.send_item(item).map_err(|_| gone())
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.0.close();
        Poll::Ready(Ok(()))
    }
}

/// Accepts in-process connections made with [`MemConnector::connect`].
#[derive(Debug)]
pub struct MemListener(mpsc::Receiver<MemTransport>);

/// Makes in-process connections to a [`MemListener`].
#[derive(Debug, Clone)]
pub struct MemConnector(mpsc::Sender<MemTransport>);

/// A listener and the connector that reaches it.
pub fn listener() -> (MemListener, MemConnector) {
    let (tx, rx) = mpsc::channel(16);
    (MemListener(rx), MemConnector(tx))
}

impl MemConnector {
    /// A new connection to the listener.
    pub async fn connect(&self) -> io::Result<MemTransport> {
        let (a, b) = pair();
        self.0.send(b).await.map_err(|_| gone())?;
        Ok(a)
    }
}

impl Listener for MemListener {
    type Transport = MemTransport;
    async fn accept(&mut self) -> io::Result<MemTransport> {
        match self.0.recv().await {
            Some(t) => Ok(t),
            // No connector left: nothing will ever arrive.
            None => std::future::pending().await,
        }
    }
}
