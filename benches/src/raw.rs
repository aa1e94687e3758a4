//! The floor: hand-written length-prefixed exchanges on raw tokio TCP (`TCP_NODELAY` on),
//! no framework, no codec, no multiplexing.
//!
//! Every frame is a 16-byte header, `op: u32`, `0: u32`, `len: u64` (little endian), then
//! `len` bytes:
//! - small: request and answer carry one `u64` (`x` / `x + 1`): 24 bytes each way;
//! - put: the request carries `len` bytes (header and bytes in vectored writes), read straight
//!   into one reusable buffer; the answer is a header whose `len` is the count received;
//! - get: the request is a header asking for `len` bytes; the answer is a header and the bytes,
//!   written (vectored) from one prepared buffer, read by the client into one reusable buffer.
//!
//! Calls/s uses one pipelining task per connection (all requests of a batch in one write,
//! answers parsed from whatever one read returns): the ideal batching any framework is
//! measured against, not a like-for-like multiplexer.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

use crate::{err, Conn, Error, System};

const SMALL: u32 = 1;
const PUT: u32 = 2;
const GET: u32 = 3;
const HEADER: usize = 16;
const SMALL_FRAME: usize = HEADER + 8;

fn header(op: u32, len: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&op.to_le_bytes());
    h[8..].copy_from_slice(&len.to_le_bytes());
    h
}

fn parse(h: &[u8]) -> (u32, u64) {
    (
        u32::from_le_bytes(h[..4].try_into().expect("4 bytes")),
        u64::from_le_bytes(h[8..16].try_into().expect("8 bytes")),
    )
}

fn small_request(x: u64) -> [u8; SMALL_FRAME] {
    let mut f = [0u8; SMALL_FRAME];
    f[..HEADER].copy_from_slice(&header(SMALL, 8));
    f[HEADER..].copy_from_slice(&x.to_le_bytes());
    f
}

async fn serve(stream: TcpStream, data: Bytes) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut out = Vec::with_capacity(64 << 10);
    let mut sink: Vec<u8> = Vec::new();
    loop {
        let mut h = [0u8; HEADER];
        match rd.read_exact(&mut h).await {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let (op, len) = parse(&h);
        match op {
            SMALL => {
                let mut b = [0u8; 8];
                rd.read_exact(&mut b).await?;
                let x = u64::from_le_bytes(b).wrapping_add(1);
                out.extend_from_slice(&header(SMALL, 8));
                out.extend_from_slice(&x.to_le_bytes());
            }
            PUT => {
                let len = len as usize;
                if sink.len() < len {
                    sink.resize(len, 0);
                }
                rd.read_exact(&mut sink[..len]).await?;
                out.extend_from_slice(&header(PUT, len as u64));
            }
            GET => {
                let len = (len as usize).min(data.len());
                out.extend_from_slice(&header(GET, len as u64));
                // Answers queued so far, the header and the bytes: vectored writes, no copy.
                let mut answer = Buf::chain(&out[..], &data[..len]);
                wr.write_all_buf(&mut answer).await?;
                out.clear();
                continue;
            }
            _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "bad op")),
        }
        // Answer once no further request is already buffered (pipelined requests share a write).
        if rd.buffer().is_empty() {
            wr.write_all(&out).await?;
            out.clear();
        }
    }
}

/// A running raw TCP server.
pub struct Raw {
    addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

impl Raw {
    /// Listens on loopback, answering `get` from `src`.
    pub async fn start(src: Bytes) -> Result<Raw, Error> {
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(err)?;
        let addr = listener.local_addr().map_err(err)?;
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, src.clone()));
            }
        });
        Ok(Raw { addr, accept })
    }
}

struct Stream {
    s: TcpStream,
    buf: Vec<u8>,
}

/// One raw connection; calls on it take turns.
#[derive(Clone)]
pub struct RawConn(Arc<Mutex<Stream>>);

impl System for Raw {
    type Conn = RawConn;

    fn name(&self) -> String {
        "raw-tcp".into()
    }

    async fn connect(&self) -> Result<RawConn, Error> {
        let s = TcpStream::connect(self.addr).await.map_err(err)?;
        s.set_nodelay(true).map_err(err)?;
        Ok(RawConn(Arc::new(Mutex::new(Stream { s, buf: Vec::new() }))))
    }

    async fn stop(self) {
        self.accept.abort();
    }

    async fn calls_per_sec(
        &self,
        conns: &[RawConn],
        in_flight: usize,
        dur: Duration,
    ) -> Result<f64, Error> {
        let stop = Arc::new(AtomicBool::new(false));
        let start = Instant::now();
        let tasks = spread(conns, in_flight, |conn, depth| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut s = conn.0.lock().await;
                pipeline(&mut s.s, depth, |_| !stop.load(Ordering::Relaxed)).await
            })
        });
        tokio::time::sleep(dur).await;
        stop.store(true, Ordering::Relaxed);
        let mut total = 0;
        for t in tasks {
            total += t.await.map_err(err)?.map_err(err)?;
        }
        Ok(total as f64 / start.elapsed().as_secs_f64())
    }

    async fn run_calls(
        &self,
        conns: &[RawConn],
        in_flight: usize,
        count: u64,
    ) -> Result<Duration, Error> {
        let start = Instant::now();
        let in_flight = in_flight.max(1);
        let per_depth = count.div_ceil(in_flight as u64);
        let tasks = spread(conns, in_flight, |conn, depth| {
            let quota = per_depth * depth as u64;
            tokio::spawn(async move {
                let mut s = conn.0.lock().await;
                pipeline(&mut s.s, depth, |issued| issued < quota).await
            })
        });
        for t in tasks {
            t.await.map_err(err)?.map_err(err)?;
        }
        Ok(start.elapsed())
    }
}

/// One task per connection, with `in_flight` split among them.
fn spread<T>(
    conns: &[RawConn],
    in_flight: usize,
    mut spawn: impl FnMut(RawConn, usize) -> T,
) -> Vec<T> {
    let n = conns.len().min(in_flight.max(1));
    (0..n)
        .map(|i| {
            let depth = in_flight / n + usize::from(i < in_flight % n);
            spawn(conns[i].clone(), depth)
        })
        .collect()
}

/// Keeps `depth` small requests in flight while `more(issued)` says so; returns the calls
/// answered.
async fn pipeline(s: &mut TcpStream, depth: usize, more: impl Fn(u64) -> bool) -> io::Result<u64> {
    let req = small_request(41);
    let mut out = Vec::with_capacity(depth * SMALL_FRAME);
    let mut inbuf = vec![0u8; 64 << 10];
    let (mut have, mut outstanding, mut issued, mut done) = (0usize, 0usize, 0u64, 0u64);
    loop {
        while outstanding < depth && more(issued) {
            out.extend_from_slice(&req);
            outstanding += 1;
            issued += 1;
        }
        if !out.is_empty() {
            s.write_all(&out).await?;
            out.clear();
        }
        if outstanding == 0 {
            return Ok(done);
        }
        let n = s.read(&mut inbuf[have..]).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        have += n;
        let frames = have / SMALL_FRAME;
        inbuf.copy_within(frames * SMALL_FRAME..have, 0);
        have -= frames * SMALL_FRAME;
        outstanding -= frames;
        done += frames as u64;
    }
}

impl Conn for RawConn {
    async fn small(&self) -> Result<(), Error> {
        let mut s = self.0.lock().await;
        s.s.write_all(&small_request(41)).await.map_err(err)?;
        let mut answer = [0u8; SMALL_FRAME];
        s.s.read_exact(&mut answer).await.map_err(err)?;
        debug_assert_eq!(parse(&answer), (SMALL, 8));
        Ok(())
    }

    async fn put(&self, data: Bytes) -> Result<(), Error> {
        let mut s = self.0.lock().await;
        // Header and bytes in vectored writes, no copy.
        let h = header(PUT, data.len() as u64);
        let mut request = Buf::chain(&h[..], &data[..]);
        s.s.write_all_buf(&mut request).await.map_err(err)?;
        let mut h = [0u8; HEADER];
        s.s.read_exact(&mut h).await.map_err(err)?;
        let (_, got) = parse(&h);
        if got != data.len() as u64 {
            return Err(format!("put {} bytes, server got {got}", data.len()));
        }
        Ok(())
    }

    async fn get(&self, len: usize) -> Result<(), Error> {
        let mut guard = self.0.lock().await;
        let Stream { s, buf } = &mut *guard;
        s.write_all(&header(GET, len as u64)).await.map_err(err)?;
        let mut h = [0u8; HEADER];
        s.read_exact(&mut h).await.map_err(err)?;
        let (_, got) = parse(&h);
        if got != len as u64 {
            return Err(format!("get {len} bytes, server sends {got}"));
        }
        if buf.len() < len {
            buf.resize(len, 0);
        }
        s.read_exact(&mut buf[..len]).await.map_err(err)?;
        Ok(())
    }
}
