//! The TCP transport of rdma-rpc, on tokio.
//!
//! - Writes are batched: every message queued since the last flush goes out in one vectored
//!   write (`writev`). Headers, bodies and small attachments are copied into one buffer;
//!   attachments above the eager threshold are written straight from the caller's memory.
//! - Reads decode frames in place: a received [`Payload`](rpc_core::Payload) is a view into the
//!   read buffer (no copy beyond the kernel's), and an oversized frame is refused from its
//!   header before any memory is reserved for it.
//! - `TCP_NODELAY` is on: the batching above replaces Nagle's algorithm.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures::{Sink, Stream};
use rpc_core::wire::{FrameCodec, Message};
use rpc_core::{Config, Listener, Transport};
use tokio::io::AsyncWrite;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpStream, ToSocketAddrs};
use tokio_util::codec::FramedRead;

/// Initial read buffer; it grows to the largest frame in progress.
const READ_BUFFER: usize = 64 * 1024;
/// Queued bytes after which the writer flushes before taking more.
const WRITE_HIGH_WATER: usize = 1024 * 1024;
/// Most buffers handed to one `writev`.
const MAX_IOVECS: usize = 64;

/// One TCP connection carrying rdma-rpc frames.
#[derive(Debug)]
pub struct TcpTransport {
    stream: TcpStream,
    config: Config,
    peer: String,
}

impl TcpTransport {
    /// Wraps a connected stream (turns on `TCP_NODELAY`).
    pub fn new(stream: TcpStream, config: Config) -> io::Result<TcpTransport> {
        stream.set_nodelay(true)?;
        let peer = stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "unknown".into());
        Ok(TcpTransport {
            stream,
            config,
            peer,
        })
    }

    /// Connects to `addr`.
    pub async fn connect(addr: impl ToSocketAddrs, config: Config) -> io::Result<TcpTransport> {
        let stream = TcpStream::connect(addr).await?;
        TcpTransport::new(stream, config)
    }
}

impl Transport for TcpTransport {
    type Reader = TcpReader;
    type Writer = TcpWriter;

    fn split(self) -> (TcpReader, TcpWriter) {
        let (r, w) = self.stream.into_split();
        let codec = FrameCodec::new(self.config.limits());
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

    fn peer(&self) -> String {
        self.peer.clone()
    }
}

/// Receiving half: yields decoded frames.
#[derive(Debug)]
pub struct TcpReader(FramedRead<OwnedReadHalf, FrameCodec>);

impl Stream for TcpReader {
    type Item = io::Result<Message>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.0).poll_next(cx)
    }
}

/// Sending half: queues frames and writes them in batches.
#[derive(Debug)]
pub struct TcpWriter {
    half: OwnedWriteHalf,
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

/// Accepts TCP connections.
#[derive(Debug)]
pub struct TcpListener {
    inner: tokio::net::TcpListener,
    config: Config,
}

impl TcpListener {
    /// Binds to `addr` (port 0 picks a free port).
    pub async fn bind(addr: impl ToSocketAddrs, config: Config) -> io::Result<TcpListener> {
        Ok(TcpListener {
            inner: tokio::net::TcpListener::bind(addr).await?,
            config,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

impl Listener for TcpListener {
    type Transport = TcpTransport;

    async fn accept(&mut self) -> io::Result<TcpTransport> {
        let (stream, _) = self.inner.accept().await?;
        TcpTransport::new(stream, self.config.clone())
    }
}
