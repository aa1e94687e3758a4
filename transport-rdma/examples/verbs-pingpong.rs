//! SEND/RECV ping-pong on the transport's connection layer alone (no rpc-core, no framing, no
//! rendezvous): the floor under rdma-rpc's own small-call round trip, measured the way
//! `rpc-perf` measures that one (client and server in two processes, one runtime thread each),
//! so the two figures and perftest's `ib_send_lat` can be set side by side.
//!
//! ```text
//! verbs-pingpong --server --addr 10.99.0.1:19500 [--device rxe0] [--busy-poll-us 2000]
//! verbs-pingpong --client --addr 10.99.0.1:19500 [--device rxe0] [--busy-poll-us 2000]
//!                [--rounds 20000] [--size 32] [--event-interval 61]
//!                [--footprint N] [--footprint-same]
//! (both)         [--lean [--borrow]]
//! (both)         [--runtime multi|current] [--slots 32] [--slot-size 16384]
//! ```
//!
//! `--slots` sets both the receive slots posted and the SEND slots of each side, and
//! `--slot-size` their size (`RdmaOptions::recv_slots`, `send_slots`, `slot_size`): how much
//! memory a ping-pong cycles through.
//!
//! `--footprint N` makes the client run N distinct small functions (at most 4096) before each
//! round trip, outside its timing: more user-space code between two `ibv_post_send` calls, as
//! rpc-core's work per call is. `--footprint-same` runs one of them N times instead (the same
//! number of instructions, a footprint of one function). The client also reports the p50 of its
//! `send` (the post's system call and the SEND's local completion), where under emulation the
//! footprint shows (docs/latency.md, "Code between two posts").
//!
//! `--lean` runs both sides as loops that never wait and never yield to the runtime within a
//! round trip: each posts with [`RdmaConnection::try_send`], polls the CQ itself with
//! [`RdmaConnection::poll_completions`] and takes the message with
//! [`RdmaConnection::try_recv_bytes`], with no completion driver and no task switch in between.
//! It is the floor of the connection layer: the least user-space code this transport runs per
//! round trip (docs/latency.md, "Code between two posts"). Its `send` is the post alone.
//! `--borrow` (with `--lean`) receives with [`RdmaConnection::poll_recv_with`] instead: each
//! message borrowed from its slot, the same slot posted again at once.
//!
//! `--runtime current` runs on tokio's current-thread runtime, as `rpc-perf --runtime current`
//! does; the default is a multi-thread runtime with one worker.
//!
//! The client prints `p50 <us> p99 <us> mean <us>` of the round trips after a warm-up.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use transport_rdma::{RdmaConnection, RdmaListener, RdmaOptions};

struct Args {
    server: bool,
    addr: SocketAddr,
    opts: RdmaOptions,
    rounds: usize,
    size: usize,
    event_interval: Option<u32>,
    /// tokio's current-thread runtime instead of a one-worker multi-thread one
    current: bool,
    /// distinct functions the client runs before each round trip
    footprint: usize,
    /// run the first of them `footprint` times instead
    footprint_same: bool,
    /// loops that never wait (see the module docs)
    lean: bool,
    /// with `lean`: receive borrowed from the slot (`poll_recv_with`)
    borrow: bool,
}

/// One of the distinct functions of `--footprint`: each `K` is its own machine code.
#[inline(never)]
fn footprint_step<const K: u64>(x: u64) -> u64 {
    let y = x.wrapping_mul(K.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    if y & 1 == 0 {
        y.rotate_left((K % 61 + 1) as u32) ^ K
    } else {
        y ^ K.wrapping_mul(7).wrapping_add(3)
    }
}

/// Nested arrays of `footprint_step::<K>` for K in 0..4^(number of `x`s).
macro_rules! footprint_table {
    (@ $k:expr;) => {
        footprint_step::<{ $k }>
    };
    (@ $k:expr; x $($rest:tt)*) => {
        [
            footprint_table!(@ $k * 4; $($rest)*),
            footprint_table!(@ $k * 4 + 1; $($rest)*),
            footprint_table!(@ $k * 4 + 2; $($rest)*),
            footprint_table!(@ $k * 4 + 3; $($rest)*),
        ]
    };
}

type Step = fn(u64) -> u64;
/// 64 steps; the table holds 64 of those
type Steps64 = [[[Step; 4]; 4]; 4];
static FOOTPRINT: [[[Steps64; 4]; 4]; 4] = footprint_table!(@ 0; x x x x x x);

/// Runs the first `n` distinct functions of the table (or the first one `n` times).
#[inline(never)]
fn footprint(n: usize, same: bool, seed: u64) -> u64 {
    let steps = FOOTPRINT
        .as_flattened()
        .as_flattened()
        .as_flattened()
        .as_flattened()
        .as_flattened();
    let mut x = seed;
    if same {
        for _ in 0..n {
            x = std::hint::black_box(steps[0])(x);
        }
    } else {
        for step in steps.iter().take(n) {
            x = step(x);
        }
    }
    x
}

fn parse() -> Result<Args, String> {
    let mut server = None;
    let mut addr = None;
    let mut opts = RdmaOptions::default();
    let mut rounds = 20_000;
    let mut size = 32;
    let mut event_interval = None;
    let mut current = false;
    let mut footprint = 0;
    let mut footprint_same = false;
    let mut lean = false;
    let mut borrow = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--server" => server = Some(true),
            "--client" => server = Some(false),
            "--addr" => {
                addr = Some(
                    value("--addr")?
                        .parse()
                        .map_err(|e| format!("--addr: {e}"))?,
                )
            }
            "--device" => opts.device = Some(value("--device")?),
            "--busy-poll-us" => {
                let us: u64 = value("--busy-poll-us")?
                    .parse()
                    .map_err(|e| format!("--busy-poll-us: {e}"))?;
                opts.busy_poll = Duration::from_micros(us);
                opts.busy_poll_max = Duration::from_micros(us);
            }
            "--slots" => {
                let n: usize = value("--slots")?
                    .parse()
                    .map_err(|e| format!("--slots: {e}"))?;
                opts.recv_slots = n;
                opts.send_slots = n;
            }
            "--slot-size" => {
                opts.slot_size = value("--slot-size")?
                    .parse()
                    .map_err(|e| format!("--slot-size: {e}"))?
            }
            "--rounds" => {
                rounds = value("--rounds")?
                    .parse()
                    .map_err(|e| format!("--rounds: {e}"))?
            }
            "--size" => {
                size = value("--size")?
                    .parse()
                    .map_err(|e| format!("--size: {e}"))?
            }
            "--event-interval" => {
                event_interval = Some(
                    value("--event-interval")?
                        .parse()
                        .map_err(|e| format!("--event-interval: {e}"))?,
                )
            }
            "--footprint" => {
                footprint = value("--footprint")?
                    .parse()
                    .map_err(|e| format!("--footprint: {e}"))?;
                if footprint > 4096 {
                    return Err("--footprint: at most 4096".into());
                }
            }
            "--footprint-same" => footprint_same = true,
            "--lean" => lean = true,
            "--borrow" => borrow = true,
            "--runtime" => {
                current = match value("--runtime")?.as_str() {
                    "multi" => false,
                    "current" => true,
                    other => return Err(format!("--runtime: multi or current, not {other:?}")),
                }
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if borrow && !lean {
        return Err("--borrow goes with --lean".into());
    }
    Ok(Args {
        server: server.ok_or("--server or --client")?,
        addr: addr.ok_or("--addr")?,
        opts,
        rounds,
        size,
        event_interval,
        current,
        footprint,
        footprint_same,
        lean,
        borrow,
    })
}

async fn serve(args: Args) -> Result<(), String> {
    let listener = RdmaListener::bind(args.addr, args.opts).map_err(|e| format!("bind: {e}"))?;
    println!("serving on {}", listener.local_addr());
    loop {
        let conn = listener
            .accept()
            .await
            .map_err(|e| format!("accept: {e}"))?;
        if args.lean {
            if args.borrow {
                serve_lean_borrowed(&conn).await?;
            } else {
                serve_lean(&conn).await?;
            }
            continue;
        }
        while let Some(msg) = conn.recv_bytes().await.map_err(|e| format!("recv: {e}"))? {
            conn.send(&msg).await.map_err(|e| format!("send: {e}"))?;
        }
    }
}

/// Echoes every message with a loop that never waits (`--lean`), until the peer leaves.
async fn serve_lean(conn: &RdmaConnection) -> Result<(), String> {
    let mut idle = 0u32;
    loop {
        if let Some(msg) = conn.try_recv_bytes() {
            let Some(msg) = msg.map_err(|e| format!("recv: {e}"))? else {
                return Ok(());
            };
            while !conn.try_send(&msg).map_err(|e| format!("send: {e}"))? {
                conn.poll_completions();
            }
            idle = 0;
        } else if conn.poll_completions() {
            idle = 0;
        } else {
            idle += 1;
            if idle == 4096 {
                // far longer than a round trip: let the connection manager's task run, which
                // is how a disconnect reaches this connection
                idle = 0;
                tokio::task::yield_now().await;
            }
        }
    }
}

/// `--lean --borrow`: as `serve_lean`, each message echoed from the slot it arrived in (copied
/// aside only if no send slot is free).
async fn serve_lean_borrowed(conn: &RdmaConnection) -> Result<(), String> {
    let mut backlog: std::collections::VecDeque<Vec<u8>> = Default::default();
    let mut failed = None;
    let mut idle = 0u32;
    loop {
        while let Some(msg) = backlog.front() {
            if !conn.try_send(msg).map_err(|e| format!("send: {e}"))? {
                break;
            }
            backlog.pop_front();
        }
        let got = conn.poll_recv_with(|msg| {
            if !backlog.is_empty() {
                backlog.push_back(msg.to_vec());
                return;
            }
            match conn.try_send(msg) {
                Ok(true) => {}
                Ok(false) => backlog.push_back(msg.to_vec()),
                Err(e) => failed = Some(e),
            }
        });
        if let Some(e) = failed.take() {
            return Err(format!("send: {e}"));
        }
        match got.map_err(|e| format!("recv: {e}"))? {
            None => return Ok(()),
            Some(0) => {
                idle += 1;
                if idle == 4096 {
                    // as in `serve_lean`
                    idle = 0;
                    tokio::task::yield_now().await;
                }
            }
            Some(_) => idle = 0,
        }
    }
}

/// One round trip of `--lean --borrow`: as `lean_round_trip`, the echo checked where it
/// arrived (borrowed from its slot); returns the time the post took and the echo's length.
fn lean_borrowed_round_trip(
    conn: &RdmaConnection,
    msg: &[u8],
    t: Instant,
) -> Result<(Duration, usize), String> {
    while !conn.try_send(msg).map_err(|e| format!("send: {e}"))? {
        conn.poll_completions();
    }
    let sent = t.elapsed();
    // the echo's length, and whether its bytes are the message's
    let mut back = None;
    loop {
        let got = conn.poll_recv_with(|echo| back = Some((echo.len(), echo == msg)));
        match back {
            Some((len, true)) => return Ok((sent, len)),
            Some((len, false)) => return Err(format!("the echo ({len} bytes) differs")),
            None if got.map_err(|e| format!("recv: {e}"))?.is_none() => {
                return Err("the server closed the connection".into())
            }
            None => {}
        }
    }
}

/// One round trip of `--lean`: posts at once, then polls until the echo is there; returns the
/// time the post took (from `t`) and the echo.
fn lean_round_trip(
    conn: &RdmaConnection,
    msg: &[u8],
    t: Instant,
) -> Result<(Duration, bytes::Bytes), String> {
    while !conn.try_send(msg).map_err(|e| format!("send: {e}"))? {
        conn.poll_completions();
    }
    let sent = t.elapsed();
    loop {
        if let Some(back) = conn.try_recv_bytes() {
            let back = back
                .map_err(|e| format!("recv: {e}"))?
                .ok_or("the server closed the connection")?;
            return Ok((sent, back));
        }
        conn.poll_completions();
    }
}

async fn client(args: Args) -> Result<(), String> {
    let conn = RdmaConnection::connect(args.addr, args.opts)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let msg = vec![0x5Au8; args.size];
    let warmup = (args.rounds / 10).max(100);
    let mut times = Vec::with_capacity(args.rounds);
    let mut sends = Vec::with_capacity(args.rounds);
    for i in 0..warmup + args.rounds {
        if args.footprint > 0 {
            std::hint::black_box(footprint(args.footprint, args.footprint_same, i as u64));
        }
        let t = Instant::now();
        // (an echo received as `Bytes` is dropped after the timing, as before `--borrow`)
        let (sent, len, _echo) = if args.lean && args.borrow {
            let (sent, len) = lean_borrowed_round_trip(&conn, &msg, t)?;
            (sent, len, None)
        } else if args.lean {
            let (sent, back) = lean_round_trip(&conn, &msg, t)?;
            (sent, back.len(), Some(back))
        } else {
            conn.send(&msg).await.map_err(|e| format!("send: {e}"))?;
            let sent = t.elapsed();
            let back = conn
                .recv_bytes()
                .await
                .map_err(|e| format!("recv: {e}"))?
                .ok_or("the server closed the connection")?;
            (sent, back.len(), Some(back))
        };
        if len != msg.len() {
            return Err(format!("echo of {} bytes came back as {len}", msg.len()));
        }
        if i >= warmup {
            times.push(t.elapsed());
            sends.push(sent);
        }
    }
    times.sort();
    sends.sort();
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e6;
    let mean = times.iter().sum::<Duration>().as_secs_f64() * 1e6 / times.len() as f64;
    println!(
        "{} x {} B SEND/RECV round trips{} on {}: p50 {:.1} us p99 {:.1} us mean {:.1} us (send p50 {:.1} us)",
        times.len(),
        args.size,
        match (args.lean, args.borrow) {
            (true, true) => ", lean loops, borrowed receive",
            (true, false) => ", lean loops",
            _ => "",
        },
        conn.device_name(),
        at(0.5),
        at(0.99),
        mean,
        sends[sends.len() / 2].as_secs_f64() * 1e6
    );
    conn.close();
    Ok(())
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("verbs-pingpong: {e}");
            std::process::exit(2);
        }
    };
    // as rpc-perf runs with the same `--runtime`: one thread, the work in a spawned task (a
    // runtime's `block_on` future is polled only between batches of `event_interval` tasks while
    // others are ready, as a spinning completion driver always is)
    let mut rt = if args.current {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut rt = tokio::runtime::Builder::new_multi_thread();
        rt.worker_threads(1);
        rt
    };
    if let Some(n) = args.event_interval {
        rt.event_interval(n);
    }
    let rt = rt.enable_all().build().expect("runtime");
    let res = rt.block_on(async move {
        tokio::spawn(async move {
            if args.server {
                serve(args).await
            } else {
                client(args).await
            }
        })
        .await
        .unwrap_or_else(|e| Err(format!("task failed: {e}")))
    });
    if let Err(e) = res {
        eprintln!("verbs-pingpong: {e}");
        std::process::exit(1);
    }
}
