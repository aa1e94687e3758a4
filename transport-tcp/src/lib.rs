//! The TCP transport of rdma-rpc, on tokio, in plain text or TLS.
//!
//! - Writes are batched: every message queued since the last flush goes out in one vectored
//!   write (`writev`). Headers, bodies and small attachments are copied into one buffer;
//!   attachments above the eager threshold are written straight from the caller's memory.
//! - Reads decode frames in place: a received [`Payload`](rpc_core::Payload) is a view into the
//!   read buffer (no copy beyond the kernel's), and an oversized frame is refused from its
//!   header before any memory is reserved for it.
//! - `TCP_NODELAY` is on: the batching above replaces Nagle's algorithm.
//! - With the `tls` feature, the same frame code runs over rustls (see the `tls` module);
//!   endpoint options choose it ([`TcpListener::bind_endpoint`],
//!   [`TcpTransport::connect_endpoint`]). Plain connections pay nothing for it: no lock and no
//!   indirection, only a match on the kind of stream.
#![forbid(unsafe_code)]

mod options;
#[cfg(feature = "tls")]
pub mod tls;

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures::{Sink, Stream};
use rpc_core::wire::{FrameCodec, Message, HEADER_LEN};
use rpc_core::{Config, Endpoint, Listener, Transport};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio_util::codec::FramedRead;

#[cfg(feature = "tls")]
use std::sync::Arc;
#[cfg(feature = "tls")]
use tokio_rustls::{rustls, TlsAcceptor, TlsConnector, TlsStream};

/// Initial read buffer; it grows to the largest frame in progress.
const READ_BUFFER: usize = 64 * 1024;
/// Queued bytes after which the writer flushes before taking more.
const WRITE_HIGH_WATER: usize = 1024 * 1024;
/// Most buffers handed to one `writev`.
const MAX_IOVECS: usize = 64;

/// One TCP connection carrying rdma-rpc frames, in plain text or TLS.
#[derive(Debug)]
pub struct TcpTransport {
    stream: Conn,
    config: Config,
    peer: String,
}

/// The kinds of stream a connection can be.
enum Conn {
    Plain(TcpStream),
    /// Accepted by a TLS listener; the handshake happens in [`Transport::establish`].
    #[cfg(feature = "tls")]
    Accepting(TcpStream, TlsAcceptor),
    #[cfg(feature = "tls")]
    Tls(Box<TlsStream<TcpStream>>),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Conn::Plain(s) => f.debug_tuple("Plain").field(s).finish(),
            #[cfg(feature = "tls")]
            Conn::Accepting(s, _) => f.debug_tuple("Accepting").field(s).finish(),
            #[cfg(feature = "tls")]
            Conn::Tls(s) => f.debug_tuple("Tls").field(s.get_ref().0).finish(),
        }
    }
}

/// Turns on `TCP_NODELAY` and names the peer.
fn prepare(stream: &TcpStream) -> io::Result<String> {
    stream.set_nodelay(true)?;
    Ok(stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown".into()))
}

impl TcpTransport {
    /// Wraps a connected stream, in plain text (turns on `TCP_NODELAY`).
    pub fn new(stream: TcpStream, config: Config) -> io::Result<TcpTransport> {
        let peer = prepare(&stream)?;
        Ok(TcpTransport {
            stream: Conn::Plain(stream),
            config,
            peer,
        })
    }

    /// Connects to `addr` in plain text.
    pub async fn connect(addr: impl ToSocketAddrs, config: Config) -> io::Result<TcpTransport> {
        let stream = TcpStream::connect(addr).await?;
        TcpTransport::new(stream, config)
    }

    /// Connects to a `tcp://` endpoint, in TLS if its options say so (`tls=1&tls_ca=…`, see
    /// the `tls` module). Bad options fail here, before connecting; a failed handshake is an
    /// error naming the TLS reason.
    pub async fn connect_endpoint(ep: &Endpoint, config: Config) -> io::Result<TcpTransport> {
        match options::client(ep)? {
            None => TcpTransport::connect(ep.authority(), config).await,
            #[cfg(feature = "tls")]
            Some(o) => {
                let (tls, name) = tls::client_from_options(&o)?;
                TcpTransport::connect_tls(ep.authority(), config, tls, name).await
            }
            #[cfg(not(feature = "tls"))]
            Some(_) => Err(options::no_tls()),
        }
    }

    /// Connects to `addr` and completes a TLS handshake, checking the server's certificate
    /// against `server_name`.
    #[cfg(feature = "tls")]
    pub async fn connect_tls(
        addr: impl ToSocketAddrs,
        config: Config,
        tls: Arc<rustls::ClientConfig>,
        server_name: rustls::pki_types::ServerName<'static>,
    ) -> io::Result<TcpTransport> {
        let stream = TcpStream::connect(addr).await?;
        let peer = prepare(&stream)?;
        let with = server_name.to_str().into_owned();
        let stream = TlsConnector::from(tls)
            .connect(server_name, stream)
            .await
            .map_err(|e| tls::handshake_error(&with, e))?;
        Ok(TcpTransport {
            stream: Conn::Tls(Box::new(TlsStream::Client(stream))),
            config,
            peer,
        })
    }

    /// Whether the connection is (or, once established, will be) encrypted.
    pub fn is_tls(&self) -> bool {
        !matches!(self.stream, Conn::Plain(_))
    }
}

impl Transport for TcpTransport {
    type Reader = TcpReader;
    type Writer = TcpWriter;

    fn split(self) -> (TcpReader, TcpWriter) {
        let (r, w) = match self.stream {
            Conn::Plain(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Plain(r), WriteHalf::Plain(w))
            }
            #[cfg(feature = "tls")]
            Conn::Tls(s) => {
                let (r, w) = tokio::io::split(*s);
                (ReadHalf::Tls(r), WriteHalf::Tls(w))
            }
            // Not established: both halves fail rather than talk in plain text.
            #[cfg(feature = "tls")]
            Conn::Accepting(..) => (ReadHalf::Unestablished, WriteHalf::Unestablished),
        };
        // With a token, the first frame either way is a greeting (or a refusal), held to a
        // greeting's size: a peer not yet authenticated cannot make a server wait for, and
        // reserve, up to `max_message_size`. (Without one, a client that skips the greeting,
        // `Client::new`, may send a large request first.)
        let codec = if self.config.auth_token.is_some() {
            FrameCodec::with_greeting_limit(self.config.limits())
        } else {
            FrameCodec::new(self.config.limits())
        };
        (
            TcpReader(FramedRead::with_capacity(r, codec, READ_BUFFER)),
            TcpWriter {
                half: w,
                buf: BytesMut::with_capacity(READ_BUFFER),
                segments: VecDeque::new(),
                queued: 0,
                zero_copy_min: self.config.eager_threshold.max(1),
            },
        )
    }

    fn coalesce_writes(&self) -> bool {
        // A write is a system call: batching calls into one `writev` is the big win.
        true
    }

    fn peer(&self) -> String {
        self.peer.clone()
    }

    /// Runs the server's TLS handshake of a connection a TLS listener accepted (nothing for
    /// plain text). A peer that fails it is refused before any frame is read.
    async fn establish(self) -> io::Result<Self> {
        match self.stream {
            #[cfg(feature = "tls")]
            Conn::Accepting(stream, acceptor) => {
                let stream = acceptor
                    .accept(stream)
                    .await
                    .map_err(|e| tls::handshake_error(&self.peer, e))?;
                Ok(TcpTransport {
                    stream: Conn::Tls(Box::new(TlsStream::Server(stream))),
                    config: self.config,
                    peer: self.peer,
                })
            }
            stream => Ok(TcpTransport { stream, ..self }),
        }
    }
}

#[cfg(feature = "tls")]
fn unestablished() -> io::Error {
    io::Error::new(
        io::ErrorKind::NotConnected,
        "TLS connection used before its handshake (Transport::establish was not called)",
    )
}

/// The reading side of either kind of stream.
#[derive(Debug)]
enum ReadHalf {
    Plain(OwnedReadHalf),
    #[cfg(feature = "tls")]
    Tls(tokio::io::ReadHalf<TlsStream<TcpStream>>),
    #[cfg(feature = "tls")]
    Unestablished,
}

impl AsyncRead for ReadHalf {
    #[inline]
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Plain(r) => Pin::new(r).poll_read(cx, buf),
            // A peer that closes without TLS's close_notify reads as a plain end of stream:
            // frames carry their own length, so a cut inside one is still an error above,
            // and a cut between two is what a close is.
            #[cfg(feature = "tls")]
            ReadHalf::Tls(r) => match ready!(Pin::new(r).poll_read(cx, buf)) {
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Poll::Ready(Ok(())),
                other => Poll::Ready(other),
            },
            #[cfg(feature = "tls")]
            ReadHalf::Unestablished => Poll::Ready(Err(unestablished())),
        }
    }
}

/// The writing side of either kind of stream.
#[derive(Debug)]
enum WriteHalf {
    Plain(OwnedWriteHalf),
    #[cfg(feature = "tls")]
    Tls(tokio::io::WriteHalf<TlsStream<TcpStream>>),
    #[cfg(feature = "tls")]
    Unestablished,
}

impl AsyncWrite for WriteHalf {
    #[inline]
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Plain(w) => Pin::new(w).poll_write(cx, buf),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(w) => Pin::new(w).poll_write(cx, buf),
            #[cfg(feature = "tls")]
            WriteHalf::Unestablished => Poll::Ready(Err(unestablished())),
        }
    }

    #[inline]
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Plain(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            #[cfg(feature = "tls")]
            WriteHalf::Unestablished => Poll::Ready(Err(unestablished())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WriteHalf::Plain(w) => w.is_write_vectored(),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(w) => w.is_write_vectored(),
            #[cfg(feature = "tls")]
            WriteHalf::Unestablished => false,
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(w) => Pin::new(w).poll_flush(cx),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(w) => Pin::new(w).poll_flush(cx),
            #[cfg(feature = "tls")]
            WriteHalf::Unestablished => Poll::Ready(Err(unestablished())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Plain(w) => Pin::new(w).poll_shutdown(cx),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(w) => Pin::new(w).poll_shutdown(cx),
            #[cfg(feature = "tls")]
            WriteHalf::Unestablished => Poll::Ready(Ok(())),
        }
    }
}

/// Receiving half: yields decoded frames.
#[derive(Debug)]
pub struct TcpReader(FramedRead<ReadHalf, FrameCodec>);

impl Stream for TcpReader {
    type Item = io::Result<Message>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match ready!(Pin::new(&mut self.0).poll_next(cx)) {
            // Bytes that are not a frame: if they are a TLS record, say so (a plain-text peer
            // of a TLS one sees its alerts or its hello).
            Some(Err(e)) if looks_like_tls(self.0.read_buffer()) => {
                Poll::Ready(Some(Err(io::Error::new(
                    e.kind(),
                    format!(
                        "{e}: the peer speaks TLS (on a client, connect with tls=1 and tls_ca)"
                    ),
                ))))
            }
            other => Poll::Ready(other),
        }
    }
}

/// Whether `b` starts like a TLS record: handshake (22) or alert (21), version 3.x.
fn looks_like_tls(b: &[u8]) -> bool {
    matches!(b, [21 | 22, 3, 0..=4, ..])
}

/// Sending half: queues frames and writes them in batches.
#[derive(Debug)]
pub struct TcpWriter {
    half: WriteHalf,
    /// Copied bytes not yet moved to `segments`.
    buf: BytesMut,
    /// Buffers to write, in order.
    segments: VecDeque<Bytes>,
    /// Bytes in `buf` and `segments`.
    queued: usize,
    /// Attachments at least this large are written from their own memory.
    zero_copy_min: usize,
}

impl TcpWriter {
    fn seal(&mut self) {
        if !self.buf.is_empty() {
            self.segments.push_back(self.buf.split().freeze());
        }
    }

    fn poll_write_out(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.seal();
        while !self.segments.is_empty() {
            let mut slices = [IoSlice::new(&[]); MAX_IOVECS];
            let mut n = 0;
            for (slot, seg) in slices.iter_mut().zip(self.segments.iter()) {
                *slot = IoSlice::new(seg);
                n += 1;
            }
            let written = ready!(Pin::new(&mut self.half).poll_write_vectored(cx, &slices[..n]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.queued -= written;
            let mut left = written;
            while left > 0 {
                let front = self
                    .segments
                    .front_mut()
                    .expect("written bytes were queued");
                if front.len() <= left {
                    left -= front.len();
                    self.segments.pop_front();
                } else {
                    front.advance(left);
                    left = 0;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl Sink<Message> for TcpWriter {
    type Error = io::Error;

    fn poll_ready(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.queued >= WRITE_HIGH_WATER {
            ready!(self.poll_write_out(cx))?;
        }
        Poll::Ready(Ok(()))
    }

    fn start_send(mut self: Pin<&mut Self>, msg: Message) -> io::Result<()> {
        let this = &mut *self;
        this.queued += msg.wire_len() as usize;
        this.buf
            .reserve(HEADER_LEN + 8 * msg.attachments.len() + msg.body.len());
        msg.encode_head(&mut this.buf);
        this.buf.extend_from_slice(&msg.body);
        for a in msg.attachments {
            if a.len() < this.zero_copy_min {
                this.buf.extend_from_slice(&a);
            } else {
                this.seal();
                this.segments.push_back(a.into_bytes());
            }
        }
        Ok(())
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_write_out(cx))?;
        Pin::new(&mut self.half).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.as_mut().poll_flush(cx))?;
        Pin::new(&mut self.half).poll_shutdown(cx)
    }
}

/// Accepts TCP connections, in plain text or TLS.
pub struct TcpListener {
    inner: tokio::net::TcpListener,
    config: Config,
    #[cfg(feature = "tls")]
    tls: Option<TlsAcceptor>,
}

impl std::fmt::Debug for TcpListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpListener")
            .field("inner", &self.inner)
            .field("tls", &self.is_tls())
            .finish_non_exhaustive()
    }
}

impl TcpListener {
    /// Binds to `addr` (port 0 picks a free port), in plain text.
    pub async fn bind(addr: impl ToSocketAddrs, config: Config) -> io::Result<TcpListener> {
        Ok(TcpListener {
            inner: tokio::net::TcpListener::bind(addr).await?,
            config,
            #[cfg(feature = "tls")]
            tls: None,
        })
    }

    /// Binds to a `tcp://` endpoint, in TLS if its options say so (`tls_cert=…&tls_key=…`,
    /// see the `tls` module). Bad options (an unreadable file, no key in the key file) fail
    /// here, before binding.
    pub async fn bind_endpoint(ep: &Endpoint, config: Config) -> io::Result<TcpListener> {
        match options::server(ep)? {
            None => TcpListener::bind(ep.authority(), config).await,
            #[cfg(feature = "tls")]
            Some(o) => {
                let tls = tls::server_from_options(&o)?;
                TcpListener::bind_tls(ep.authority(), config, tls).await
            }
            #[cfg(not(feature = "tls"))]
            Some(_) => Err(options::no_tls()),
        }
    }

    /// Binds to `addr`; every connection must complete a TLS handshake with `tls` (in
    /// [`Transport::establish`]) before any frame is read from it.
    #[cfg(feature = "tls")]
    pub async fn bind_tls(
        addr: impl ToSocketAddrs,
        config: Config,
        tls: Arc<rustls::ServerConfig>,
    ) -> io::Result<TcpListener> {
        Ok(TcpListener {
            inner: tokio::net::TcpListener::bind(addr).await?,
            config,
            tls: Some(TlsAcceptor::from(tls)),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Whether accepted connections speak TLS.
    pub fn is_tls(&self) -> bool {
        #[cfg(feature = "tls")]
        return self.tls.is_some();
        #[cfg(not(feature = "tls"))]
        false
    }
}

impl Listener for TcpListener {
    type Transport = TcpTransport;

    async fn accept(&mut self) -> io::Result<TcpTransport> {
        let (stream, _) = self.inner.accept().await?;
        #[cfg(feature = "tls")]
        if let Some(acceptor) = &self.tls {
            let peer = prepare(&stream)?;
            return Ok(TcpTransport {
                stream: Conn::Accepting(stream, acceptor.clone()),
                config: self.config.clone(),
                peer,
            });
        }
        TcpTransport::new(stream, self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{SinkExt, StreamExt};
    use rpc_core::wire::Kind;

    #[test]
    fn recognises_tls_records() {
        assert!(looks_like_tls(&[22, 3, 1, 2, 0]));
        assert!(looks_like_tls(&[21, 3, 3, 0, 2, 2, 40]));
        assert!(!looks_like_tls(b"RR\x01\x01"));
        assert!(!looks_like_tls(&[22]));
    }

    /// Frames cross a plain connection made from endpoints, both ways.
    #[tokio::test]
    async fn plain_endpoint_exchange() {
        let ep: Endpoint = "tcp://127.0.0.1:0?max_in_flight=4".parse().unwrap();
        let mut l = TcpListener::bind_endpoint(&ep, Config::default())
            .await
            .unwrap();
        assert!(!l.is_tls());
        let ep = ep.with_port(l.local_addr().unwrap().port());
        let (c, s) = tokio::join!(
            TcpTransport::connect_endpoint(&ep, Config::default()),
            l.accept()
        );
        let (c, s) = (c.unwrap(), s.unwrap().establish().await.unwrap());
        assert!(!c.is_tls() && !s.is_tls());
        let ((mut cr, mut cw), (mut sr, mut sw)) = (c.split(), s.split());
        cw.send(Message::control(Kind::Ping, 7)).await.unwrap();
        let m = sr.next().await.unwrap().unwrap();
        assert_eq!((m.header.kind, m.header.id), (Kind::Ping, 7));
        sw.send(Message::control(Kind::Pong, 7)).await.unwrap();
        let m = cr.next().await.unwrap().unwrap();
        assert_eq!((m.header.kind, m.header.id), (Kind::Pong, 7));
        sw.close().await.unwrap();
        assert!(cr.next().await.is_none());
    }

    /// Without the `tls` feature, an endpoint that asks for TLS is refused, never served or
    /// reached in plain text.
    #[cfg(not(feature = "tls"))]
    #[tokio::test]
    async fn tls_endpoints_need_the_feature() {
        let server: Endpoint = "tcp://127.0.0.1:0?tls_cert=/c&tls_key=/k".parse().unwrap();
        let e = TcpListener::bind_endpoint(&server, Config::default())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("`tls` feature"), "{e}");
        let client: Endpoint = "tcp://127.0.0.1:1?tls=1&tls_ca=/ca".parse().unwrap();
        let e = TcpTransport::connect_endpoint(&client, Config::default())
            .await
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{e}");
    }
}
