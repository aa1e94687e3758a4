//! In-process fakes shared by the tests of the transport contract's optional paths (the
//! response shortcut and the direct sender). Not network transports: each hands messages
//! over channels.

#![allow(dead_code)] // each test crate uses a part

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::{Sink, Stream};
use rpc_core::wire::{Attachments, FrameRef, Limits, Message, WireHeader, HEADER_LEN};
use rpc_core::{DirectSend, LentFrame};
use tokio::sync::mpsc;

/// A whole frame lent as a transport lends one borrowed from its receive buffer
/// ([`LentFrame`]): what `accept` answers, and whether it was asked.
pub(crate) struct Lent {
    bytes: Vec<u8>,
    /// what `accept` answers
    pub(crate) accept: bool,
    /// whether `accept` was called
    pub(crate) asked: bool,
}

impl Lent {
    /// `msg` encoded, to be lent; `accept` is what `accept` answers.
    pub(crate) fn new(msg: &Message, accept: bool) -> Lent {
        let mut bytes = Vec::new();
        msg.encode_into(&mut bytes);
        Lent {
            bytes,
            accept,
            asked: false,
        }
    }

    fn parts(&self) -> (WireHeader, &[u8]) {
        let (raw, rest) = self.bytes.split_first_chunk::<HEADER_LEN>().unwrap();
        let limits = Limits {
            max_message_size: 1 << 20,
            max_attachments: 16,
        };
        (WireHeader::parse(raw, &limits).unwrap(), rest)
    }
}

impl LentFrame for Lent {
    fn frame(&self) -> FrameRef<'_> {
        let (head, rest) = self.parts();
        head.split_ref(rest).unwrap()
    }
    fn accept(&mut self) -> bool {
        assert!(!self.asked, "accept is asked once");
        self.asked = true;
        self.accept
    }
    fn own(&mut self) -> (bytes::Bytes, Attachments) {
        assert!(
            self.asked && self.accept,
            "nothing is taken before it is accepted"
        );
        let (head, rest) = self.parts();
        head.split_ref(rest)
            .unwrap()
            .split_copy(bytes::Bytes::copy_from_slice(rest))
    }
}

/// A fake direct sender: whether it says the link is idle, whether it takes what it is
/// given, and the channel where what it took goes.
pub(crate) struct FakeDirect {
    pub(crate) ready: AtomicBool,
    pub(crate) accept: AtomicBool,
    sent: mpsc::UnboundedSender<Message>,
}

impl FakeDirect {
    /// Ready and accepting; what it sends comes out of the receiver.
    pub(crate) fn new() -> (FakeDirect, mpsc::UnboundedReceiver<Message>) {
        let (sent, rx) = mpsc::unbounded_channel();
        let direct = FakeDirect {
            ready: AtomicBool::new(true),
            accept: AtomicBool::new(true),
            sent,
        };
        (direct, rx)
    }
}

impl DirectSend for FakeDirect {
    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
    fn try_send(&self, msg: &Message) -> bool {
        // a link that is not ready takes nothing now, as a real one
        if !self.accept.load(Ordering::SeqCst) || !self.ready.load(Ordering::SeqCst) {
            return false;
        }
        self.sent.send(msg.clone()).is_ok()
    }
}

/// A transport's reader fed by a channel.
pub(crate) struct ChanReader(pub(crate) mpsc::UnboundedReceiver<Message>);

/// A transport's writer that puts every message on a channel, ready and flushed at once.
pub(crate) struct ChanWriter(pub(crate) mpsc::UnboundedSender<Message>);

impl Stream for ChanReader {
    type Item = io::Result<Message>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|m| m.map(Ok))
    }
}

impl Sink<Message> for ChanWriter {
    type Error = io::Error;
    fn poll_ready(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn start_send(self: Pin<&mut Self>, msg: Message) -> io::Result<()> {
        self.0
            .send(msg)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "test gone"))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// `Echo.echo(x) -> x` (method 1), answered on its first poll (inline, no task of its own).
pub(crate) struct Echo;

impl rpc_core::Service for Echo {
    const NAME: &'static str = "Echo";

    fn method_name(&self, m: u32) -> Option<&'static str> {
        (m == 1).then_some("Echo.echo")
    }

    async fn dispatch(
        &self,
        _m: u32,
        req: rpc_core::Request,
    ) -> Result<rpc_core::Reply, rpc_core::ServerError> {
        let x: u64 = req.decode::<rpc_core::Bincode, _>("Echo.echo")?;
        rpc_core::Reply::encode::<rpc_core::Bincode, _>(&x)
    }
}

/// A request frame for `method` with id `id`, whose argument is the id itself.
pub(crate) fn request(method: u32, id: u64) -> Message {
    use rpc_core::Codec;
    let mut header = rpc_core::wire::Header::new(rpc_core::wire::Kind::Request, id);
    header.method = method;
    let mut body = Vec::new();
    rpc_core::Bincode::encode(&id, &mut body).unwrap();
    Message {
        header,
        body: body.into(),
        attachments: Default::default(),
    }
}
