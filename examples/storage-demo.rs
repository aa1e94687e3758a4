//! A key-value/object storage microservice on rdma-rpc, and a load driver that checks it.
//!
//! What it shows:
//! - a service defined with `#[rdma_service]`: `put`, `get`, `delete`, `list` and `stat`, bulk
//!   values as [`Payload`]s, a typed application error (`StoreError`) and a user struct
//!   (`ObjectStat`) in the replies;
//! - an in-memory implementation with sharded locks that keeps each received `Payload` as it
//!   arrived (no copy on `put`, none on `get` either: the reply is sent from the stored bytes);
//! - a driver running a mixed workload over many concurrent callers on two connections: small
//!   values (64 B–4 KiB) and 1, 4 and 16 MiB objects. Every `get` and `stat` is checked against
//!   what was put (size, checksum and version), and so are `delete` and `list`. It prints the
//!   count, rate, p50/p99 latency and throughput per operation and size class, and exits with
//!   status 1 if any call failed or any check did not hold.
//!
//! The transport comes from the endpoint, so the same binary runs over TCP or RDMA.
//!
//! # Running
//! ```text
//! cargo run --release --example storage-demo                      # server + driver, tcp loopback
//! cargo run --release --example storage-demo -- --serve --endpoint tcp://0.0.0.0:7471
//! cargo run --release --example storage-demo -- --connect --endpoint tcp://10.99.0.1:7471
//! cargo run --release --example storage-demo --features rdma -- \
//!     --endpoint 'rdma://10.99.0.1:7471?device=rxe0'
//! cargo run --release --example storage-demo -- --help
//! ```
//! `RDMA_RPC_ENDPOINT` stands in for `--endpoint`.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::ops::Bound;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use rdma_rpc::{rdma_service, Endpoint, Payload, RpcError, Server};
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// The service
// ---------------------------------------------------------------------------------------------

/// Largest value the store accepts.
const MAX_VALUE_SIZE: usize = 16 << 20;
/// Total bytes of values the store holds at most.
const QUOTA_BYTES: u64 = 1 << 30;
/// Most keys one `list` returns, whatever limit the caller asks for.
const MAX_LIST: usize = 10_000;

/// Metadata of a stored object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct ObjectStat {
    /// Length of the value in bytes.
    size: u64,
    /// [`checksum`] of the value, computed by the server when it was put.
    checksum: u64,
    /// Store-wide version of the `put` that wrote the value; every put gets a new, larger one.
    version: u64,
}

/// Why the store refused a `put`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum StoreError {
    /// The value is larger than the store accepts.
    ValueTooLarge { size: u64, max: u64 },
    /// Storing the value would take the store over its quota.
    QuotaExceeded { needed: u64, available: u64 },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::ValueTooLarge { size, max } => {
                write!(f, "value of {size} bytes exceeds the limit of {max} bytes")
            }
            StoreError::QuotaExceeded { needed, available } => {
                write!(
                    f,
                    "quota exceeded: {needed} more bytes needed, {available} available"
                )
            }
        }
    }
}

impl std::error::Error for StoreError {}

/// A key-value/object store.
#[rdma_service]
trait Store {
    /// Stores `value` under `key`, replacing any previous value; returns the new version.
    async fn put(&self, key: String, value: Payload) -> Result<u64, StoreError>;
    /// The value stored under `key`.
    async fn get(&self, key: String) -> Option<Payload>;
    /// Removes `key`; returns whether it existed.
    async fn delete(&self, key: String) -> bool;
    /// Up to `limit` keys starting with `prefix`, in ascending order.
    async fn list(&self, prefix: String, limit: u32) -> Vec<String>;
    /// Size, checksum and version of the value under `key`.
    async fn stat(&self, key: String) -> Option<ObjectStat>;
}

/// A stored value and its metadata.
struct Object {
    /// The payload as it arrived: a view into the receive buffer, never copied.
    value: Payload,
    checksum: u64,
    version: u64,
}

/// [`Store`] in memory: keys spread over independently locked shards, each an ordered map so
/// that `list` can seek to a prefix.
struct MemoryStore {
    shards: Box<[RwLock<BTreeMap<String, Object>>]>,
    hasher: RandomState,
    /// Bytes of values held, against [`QUOTA_BYTES`].
    used: AtomicU64,
    /// The last version handed out.
    version: AtomicU64,
}

impl MemoryStore {
    const SHARDS: usize = 64;

    fn new() -> MemoryStore {
        MemoryStore {
            shards: (0..Self::SHARDS).map(|_| RwLock::default()).collect(),
            hasher: RandomState::new(),
            used: AtomicU64::new(0),
            version: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: &str) -> &RwLock<BTreeMap<String, Object>> {
        &self.shards[self.hasher.hash_one(key) as usize % Self::SHARDS]
    }
}

// Locks are never held across an `.await` (handlers have none), and a poisoned shard would
// mean a handler panicked mid-update: the server reports that panic, so `unwrap` is right here.
impl Store for MemoryStore {
    async fn put(&self, key: String, value: Payload) -> Result<u64, StoreError> {
        let size = value.len() as u64;
        if value.len() > MAX_VALUE_SIZE {
            return Err(StoreError::ValueTooLarge {
                size,
                max: MAX_VALUE_SIZE as u64,
            });
        }
        let checksum = checksum(&value); // outside the lock
        let mut shard = self.shard(&key).write().unwrap();
        let replaced = shard.get(&key).map_or(0, |old| old.value.len() as u64);
        // Under the shard lock, so no other put of this key races the accounting.
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                let after = used - replaced + size;
                (after <= QUOTA_BYTES).then_some(after)
            })
            .map_err(|used| StoreError::QuotaExceeded {
                needed: size.saturating_sub(replaced),
                available: QUOTA_BYTES - used,
            })?;
        let version = self.version.fetch_add(1, Ordering::Relaxed) + 1;
        shard.insert(
            key,
            Object {
                value,
                checksum,
                version,
            },
        );
        Ok(version)
    }

    async fn get(&self, key: String) -> Option<Payload> {
        let shard = self.shard(&key).read().unwrap();
        shard.get(&key).map(|object| object.value.clone()) // a reference count, not a copy
    }

    async fn delete(&self, key: String) -> bool {
        let removed = self.shard(&key).write().unwrap().remove(&key);
        if let Some(object) = &removed {
            self.used
                .fetch_sub(object.value.len() as u64, Ordering::Relaxed);
        }
        removed.is_some()
    }

    async fn list(&self, prefix: String, limit: u32) -> Vec<String> {
        let limit = (limit as usize).min(MAX_LIST);
        // The first `limit` matching keys of each shard, merged.
        let mut keys = Vec::new();
        for shard in &self.shards {
            let shard = shard.read().unwrap();
            let from = (Bound::Included(prefix.as_str()), Bound::Unbounded);
            keys.extend(
                shard
                    .range::<str, _>(from)
                    .map(|(key, _)| key)
                    .take_while(|key| key.starts_with(&prefix))
                    .take(limit)
                    .cloned(),
            );
        }
        keys.sort_unstable();
        keys.truncate(limit);
        keys
    }

    async fn stat(&self, key: String) -> Option<ObjectStat> {
        let shard = self.shard(&key).read().unwrap();
        shard.get(&key).map(|object| ObjectStat {
            size: object.value.len() as u64,
            checksum: object.checksum,
            version: object.version,
        })
    }
}

/// A fast 64-bit checksum of `data` (four independent multiply-rotate lanes, then a final
/// mix). Detects corruption, not tampering: it is not a cryptographic hash.
fn checksum(data: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let step = |h: u64, word: u64| (h ^ word).wrapping_mul(K).rotate_left(29);
    let mut lanes = [K, K ^ 1, K ^ 2, K ^ 3];
    let mut blocks = data.chunks_exact(32);
    for block in &mut blocks {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            *lane = step(*lane, u64::from_le_bytes(word.try_into().unwrap()));
        }
    }
    let mut h = lanes.into_iter().fold(data.len() as u64, step);
    h = blocks
        .remainder()
        .iter()
        .fold(h, |h, &b| step(h, u64::from(b)));
    // The finaliser of MurmurHash3.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

const USAGE: &str = "\
storage-demo: a key-value/object store on rdma-rpc, and a load driver that checks it

USAGE:
    storage-demo [--serve | --connect] [OPTIONS]

With neither --serve nor --connect, runs the server and the driver in this process.

OPTIONS:
    --serve               run only the server, until Ctrl-C; prints the bound endpoint
    --connect             run only the driver, against a server at --endpoint
    --endpoint URL        tcp://HOST:PORT or rdma://HOST:PORT[?device=NAME]
                          (default: $RDMA_RPC_ENDPOINT, else tcp://127.0.0.1:0 in one process
                          and tcp://127.0.0.1:7471 with --serve or --connect)
    --duration SECS       how long the workload runs at most (default 3)
    --concurrency N       concurrent callers of small values (default 32); 1 large-object
                          caller per 16 of them, at least 1, at most 4
    --ops N               at most N small-value calls, and N/1000 large-object calls
                          (default 200000)
    -h, --help            print this help
";

/// What to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Server and driver in this process.
    Both,
    /// Only the server.
    Serve,
    /// Only the driver.
    Connect,
}

/// The parsed command line.
#[derive(Debug)]
struct Options {
    mode: Mode,
    endpoint: Endpoint,
    workload: Workload,
}

/// How much load the driver applies.
#[derive(Debug, Clone, Copy)]
struct Workload {
    duration: Duration,
    small_callers: usize,
    large_callers: usize,
    small_ops: u64,
    large_ops: u64,
}

impl Workload {
    fn new(duration: Duration, concurrency: usize, ops: u64) -> Workload {
        let large_callers = (concurrency / 16).clamp(1, 4);
        Workload {
            duration,
            small_callers: concurrency,
            large_callers,
            small_ops: ops,
            large_ops: (ops / 1000).max(large_callers as u64),
        }
    }
}

/// Parses the command line; `Ok(None)` means help was asked for.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut mode = Mode::Both;
    let mut endpoint = None;
    let mut duration = Duration::from_secs(3);
    let mut concurrency = 32;
    let mut ops = 200_000;
    while let Some(arg) = args.next() {
        // Both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_owned(), Some(value.to_owned()))
            }
            _ => (arg, None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--serve" | "--connect" => {
                let wanted = if flag == "--serve" {
                    Mode::Serve
                } else {
                    Mode::Connect
                };
                if mode != Mode::Both && mode != wanted {
                    return Err("--serve and --connect exclude each other".into());
                }
                mode = wanted;
            }
            "--endpoint" => endpoint = Some(value()?),
            "--duration" => {
                let secs: f64 = parse_number(&flag, &value()?)?;
                duration = Duration::try_from_secs_f64(secs)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        format!("--duration: {secs} is not a positive number of seconds")
                    })?;
            }
            "--concurrency" => concurrency = positive(&flag, &value()?)?,
            "--ops" => ops = positive(&flag, &value()?)?,
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    let endpoint = endpoint
        .or_else(|| std::env::var("RDMA_RPC_ENDPOINT").ok())
        .unwrap_or_else(|| {
            match mode {
                Mode::Both => "tcp://127.0.0.1:0",
                Mode::Serve | Mode::Connect => "tcp://127.0.0.1:7471",
            }
            .to_owned()
        });
    let endpoint = endpoint.parse().map_err(|e| format!("{e}"))?;
    Ok(Some(Options {
        mode,
        endpoint,
        workload: Workload::new(duration, concurrency as usize, ops),
    }))
}

fn parse_number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: {value:?} is not a number"))
}

fn positive(flag: &str, value: &str) -> Result<u64, String> {
    match parse_number(flag, value)? {
        0 => Err(format!("{flag} must be at least 1")),
        n => Ok(n),
    }
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

#[tokio::main]
async fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("storage-demo: {e}\n(see --help)");
            return ExitCode::from(2);
        }
    };
    match run(options).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("storage-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs what `options` ask for; `Ok(false)` when the driver found failures.
async fn run(options: Options) -> Result<bool, RpcError> {
    let Options {
        mode,
        endpoint,
        workload,
    } = options;
    if mode == Mode::Connect {
        println!(
            "storage-demo: transport {}, server at {endpoint}",
            scheme(&endpoint)
        );
        return drive(&endpoint, workload).await;
    }

    let server = Server::bind(&endpoint).await?;
    let endpoint = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let serving = tokio::spawn(server.serve(StoreServer::new(MemoryStore::new())));

    let outcome = if mode == Mode::Serve {
        println!(
            "storage-demo: serving Store over {} on {endpoint} (Ctrl-C to stop)",
            scheme(&endpoint)
        );
        stop_signal().await;
        println!("storage-demo: shutting down");
        Ok(true)
    } else {
        println!(
            "storage-demo: transport {}, server at {endpoint} (in this process)",
            scheme(&endpoint)
        );
        drive(&endpoint, workload).await
    };
    // Graceful: calls in flight finish first.
    shutdown.shutdown();
    serving.await.expect("the server task panicked")?;
    outcome
}

fn scheme(endpoint: &Endpoint) -> &'static str {
    endpoint.scheme().as_str()
}

/// Resolves on Ctrl-C (SIGINT), after which the server drains its calls and exits.
async fn stop_signal() {
    if let Err(e) = tokio::signal::ctrl_c().await {
        eprintln!("storage-demo: cannot listen for Ctrl-C ({e}); serving until killed");
        std::future::pending::<()>().await;
    }
}

// ---------------------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------------------

/// Calls that take longer than this fail (and count as errors) instead of hanging the run.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Sizes of the large objects.
const LARGE_SIZES: [usize; 3] = [1 << 20, 4 << 20, 16 << 20];

/// Runs the workload against the server at `endpoint` and prints the results; `Ok(false)` if
/// a call failed or a check did not hold.
async fn drive(endpoint: &Endpoint, workload: Workload) -> Result<bool, RpcError> {
    // Small calls and bulk transfers go on separate connections, so that a small call never
    // waits behind 16 MiB on the same stream; calls on one connection are multiplexed.
    let small = StoreClient::connect(endpoint)
        .await?
        .with_timeout(CALL_TIMEOUT);
    let bulk = StoreClient::connect(endpoint)
        .await?
        .with_timeout(CALL_TIMEOUT);
    let corpus = Corpus::new(MAX_VALUE_SIZE + (64 << 10));
    // Keys of this run start with `run`, so several drivers can share one server.
    let run = format!(
        "run-{}-{}/",
        std::process::id(),
        std::time::UNIX_EPOCH
            .elapsed()
            .unwrap_or_default()
            .as_millis()
    );
    println!(
        "workload: {} s or {} small + {} large calls, whichever ends first; callers: {} for \
         small values (64 B–4 KiB), {} for large objects (1/4/16 MiB)",
        workload.duration.as_secs_f64(),
        workload.small_ops,
        workload.large_ops,
        workload.small_callers,
        workload.large_callers,
    );

    let mut checks = vec![check_oversized_put(&bulk, &corpus, &run).await];

    let start = Instant::now();
    let deadline = start + workload.duration;
    let small_budget = Arc::new(AtomicU64::new(workload.small_ops));
    let large_budget = Arc::new(AtomicU64::new(workload.large_ops));
    let callers = (0..workload.small_callers)
        .map(|i| Caller::new(&SMALL, i, &small, &corpus, &run, &small_budget))
        .chain(
            (0..workload.large_callers)
                .map(|i| Caller::new(&LARGE, i, &bulk, &corpus, &run, &large_budget)),
        );
    let tasks: Vec<_> = callers
        .map(|caller| tokio::spawn(caller.run(deadline)))
        .collect();
    let mut recorder = Recorder::default();
    for task in tasks {
        recorder.merge(task.await.expect("a caller panicked"));
    }
    let elapsed = start.elapsed();

    checks.push(check_all_deleted(&small, &run).await);
    recorder.print(elapsed);
    let mut passed = recorder.passed();
    for (what, result) in &checks {
        match result {
            Ok(()) => println!("check: {what}: ok"),
            Err(why) => println!("check: {what}: FAILED: {why}"),
        }
        passed &= result.is_ok();
    }
    println!("{}", if passed { "PASSED" } else { "FAILED" });
    Ok(passed)
}

/// A named check of the run and whether it held.
type Check = (&'static str, Result<(), String>);

/// The store refuses a value over [`MAX_VALUE_SIZE`] with its typed error.
async fn check_oversized_put(client: &StoreClient, corpus: &Corpus, run: &str) -> Check {
    let what = "a put over the size limit is refused with StoreError::ValueTooLarge";
    let value = corpus.bytes.slice(..=MAX_VALUE_SIZE);
    let result = match client.put(format!("{run}oversized"), value).await {
        Ok(Err(StoreError::ValueTooLarge { .. })) => Ok(()),
        Ok(other) => Err(format!("got {other:?}")),
        Err(e) => Err(e.to_string()),
    };
    (what, result)
}

/// Every caller deleted its keys when it finished, so none of this run's are left.
async fn check_all_deleted(client: &StoreClient, run: &str) -> Check {
    let what = "no keys of this run are left after the callers cleaned up";
    let result = match client.list(run.to_owned(), 10).await {
        Ok(keys) if keys.is_empty() => Ok(()),
        Ok(keys) => Err(format!("still there: {keys:?}")),
        Err(e) => Err(e.to_string()),
    };
    (what, result)
}

/// Random bytes that values are cut from: a value is a slice of it, shared, not copied.
#[derive(Clone)]
struct Corpus {
    bytes: Payload,
}

impl Corpus {
    fn new(len: usize) -> Corpus {
        let mut rng = Rng::new(0x5eed);
        let bytes: Vec<u8> = (0..len.div_ceil(8))
            .flat_map(|_| rng.next_u64().to_le_bytes())
            .take(len)
            .collect();
        Corpus {
            bytes: Payload::from(bytes),
        }
    }

    /// `len` bytes from a random offset.
    fn value(&self, len: usize, rng: &mut Rng) -> Payload {
        let offset = rng.below(self.bytes.len() - len + 1);
        self.bytes.slice(offset..offset + len)
    }
}

/// An operation of the service, in the order the results table lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Put,
    Get,
    Stat,
    List,
    Delete,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::Stat => "stat",
            Op::List => "list",
            Op::Delete => "delete",
        }
    }
}

/// The size class a call is counted under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    /// Values of 64 B to 4 KiB.
    Small,
    /// Objects of this many bytes.
    Large(usize),
    /// Calls that carry no value (`list`).
    NoValue,
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Class::Small => f.write_str("64B-4KiB"),
            Class::Large(size) => write!(f, "{} MiB", size >> 20),
            Class::NoValue => f.write_str("-"),
        }
    }
}

/// What a group of callers does.
struct Profile {
    /// Namespace of its keys.
    name: &'static str,
    /// Keys per caller.
    slots: usize,
    /// Relative weights of the operations.
    mix: &'static [(Op, u64)],
    /// Whether values are large objects (the slot picks the size) or small (random size).
    large: bool,
}

impl Profile {
    fn class(&self, slot: usize) -> Class {
        if self.large {
            Class::Large(LARGE_SIZES[slot % LARGE_SIZES.len()])
        } else {
            Class::Small
        }
    }

    fn value_len(&self, slot: usize, rng: &mut Rng) -> usize {
        match self.class(slot) {
            Class::Large(size) => size,
            _ => 64 + rng.below(4096 - 64 + 1),
        }
    }

    fn pick_op(&self, rng: &mut Rng) -> Op {
        let total: u64 = self.mix.iter().map(|&(_, weight)| weight).sum();
        let mut ticket = rng.below(total as usize) as u64;
        for &(op, weight) in self.mix {
            if ticket < weight {
                return op;
            }
            ticket -= weight;
        }
        unreachable!("the ticket is below the total weight")
    }
}

const SMALL: Profile = Profile {
    name: "small",
    slots: 32,
    mix: &[
        (Op::Put, 30),
        (Op::Get, 40),
        (Op::Stat, 10),
        (Op::List, 5),
        (Op::Delete, 15),
    ],
    large: false,
};

const LARGE: Profile = Profile {
    name: "large",
    slots: 2 * LARGE_SIZES.len(),
    mix: &[
        (Op::Put, 40),
        (Op::Get, 45),
        (Op::Stat, 5),
        (Op::Delete, 10),
    ],
    large: true,
};

/// What the caller knows about one of its keys. Each key belongs to one caller, so this is
/// exactly what the server must hold, unless a call on it failed.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Empty,
    Holds(Expected),
    /// A put or delete failed, so the server may or may not have applied it: not checked
    /// until the next successful put or delete.
    Unknown,
}

/// A value as put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Expected {
    len: u64,
    checksum: u64,
    version: u64,
}

/// A value as the server reported it: from `get` (no version) or `stat`.
#[derive(Debug, Clone, Copy)]
struct Observed {
    len: u64,
    checksum: u64,
    version: Option<u64>,
}

impl Observed {
    fn of_value(value: &Payload) -> Observed {
        Observed {
            len: value.len() as u64,
            checksum: checksum(value),
            version: None,
        }
    }

    fn of_stat(stat: &ObjectStat) -> Observed {
        Observed {
            len: stat.size,
            checksum: stat.checksum,
            version: Some(stat.version),
        }
    }
}

impl Slot {
    /// Whether the server's answer for this key is right.
    fn check(&self, observed: Option<Observed>) -> Result<(), String> {
        match (self, observed) {
            (Slot::Unknown, _) | (Slot::Empty, None) => Ok(()),
            (Slot::Empty, Some(seen)) => Err(format!("found {} bytes, expected none", seen.len)),
            (Slot::Holds(_), None) => Err("missing".into()),
            (Slot::Holds(want), Some(seen)) => {
                if seen.len != want.len {
                    Err(format!("{} bytes, expected {}", seen.len, want.len))
                } else if seen.checksum != want.checksum {
                    Err(format!(
                        "checksum {:016x}, expected {:016x}",
                        seen.checksum, want.checksum
                    ))
                } else if seen.version.is_some_and(|v| v != want.version) {
                    Err(format!(
                        "version {:?}, expected {}",
                        seen.version, want.version
                    ))
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// One concurrent caller: works on its own keys, checking every answer.
struct Caller {
    profile: &'static Profile,
    client: StoreClient,
    corpus: Corpus,
    /// Prefix of its keys, `list`ed as a whole.
    prefix: String,
    /// Its keys in ascending order, one per slot.
    keys: Vec<String>,
    slots: Vec<Slot>,
    budget: Arc<AtomicU64>,
    rng: Rng,
    recorder: Recorder,
}

impl Caller {
    fn new(
        profile: &'static Profile,
        index: usize,
        client: &StoreClient,
        corpus: &Corpus,
        run: &str,
        budget: &Arc<AtomicU64>,
    ) -> Caller {
        let prefix = format!("{run}{}/c{index:04}/", profile.name);
        Caller {
            profile,
            client: client.clone(),
            corpus: corpus.clone(),
            keys: (0..profile.slots)
                .map(|s| format!("{prefix}k{s:04}"))
                .collect(),
            prefix,
            slots: vec![Slot::Empty; profile.slots],
            budget: budget.clone(),
            rng: Rng::new(((index as u64) << 1) | u64::from(profile.large)),
            recorder: Recorder::default(),
        }
    }

    /// Calls until `deadline` or until the shared budget of calls is spent, then deletes its
    /// keys; returns the measurements.
    async fn run(mut self, deadline: Instant) -> Recorder {
        while Instant::now() < deadline && take_one(&self.budget) {
            let slot = self.rng.below(self.profile.slots);
            match self.profile.pick_op(&mut self.rng) {
                Op::Put => self.put(slot).await,
                Op::Get => self.get(slot).await,
                Op::Stat => self.stat(slot).await,
                Op::List => self.list().await,
                Op::Delete => self.delete(slot).await,
            }
        }
        for slot in 0..self.slots.len() {
            if !matches!(self.slots[slot], Slot::Empty) {
                self.delete(slot).await;
            }
        }
        self.recorder
    }

    async fn put(&mut self, slot: usize) {
        let row = (Op::Put, self.profile.class(slot));
        let len = self.profile.value_len(slot, &mut self.rng);
        let value = self.corpus.value(len, &mut self.rng);
        let checksum = checksum(&value);
        let key = &self.keys[slot];
        let reply = self
            .recorder
            .time(row, self.client.put(key.clone(), value))
            .await;
        self.slots[slot] = match reply {
            Some(Ok(version)) => {
                self.recorder.add_bytes(row, len);
                Slot::Holds(Expected {
                    len: len as u64,
                    checksum,
                    version,
                })
            }
            Some(Err(e)) => {
                self.recorder.error(row, format!("put {key}: refused: {e}"));
                Slot::Unknown
            }
            None => Slot::Unknown,
        };
    }

    async fn get(&mut self, slot: usize) {
        let row = (Op::Get, self.profile.class(slot));
        let key = &self.keys[slot];
        if let Some(value) = self.recorder.time(row, self.client.get(key.clone())).await {
            let observed = value.as_ref().map(Observed::of_value);
            self.recorder
                .add_bytes(row, value.as_ref().map_or(0, |v| v.len()));
            self.recorder
                .verify(row, key, self.slots[slot].check(observed));
        }
    }

    async fn stat(&mut self, slot: usize) {
        let row = (Op::Stat, self.profile.class(slot));
        let key = &self.keys[slot];
        if let Some(stat) = self.recorder.time(row, self.client.stat(key.clone())).await {
            let observed = stat.as_ref().map(Observed::of_stat);
            self.recorder
                .verify(row, key, self.slots[slot].check(observed));
        }
    }

    async fn delete(&mut self, slot: usize) {
        let row = (Op::Delete, self.profile.class(slot));
        let key = &self.keys[slot];
        let Some(existed) = self
            .recorder
            .time(row, self.client.delete(key.clone()))
            .await
        else {
            self.slots[slot] = Slot::Unknown;
            return;
        };
        let verdict = match self.slots[slot] {
            Slot::Holds(_) if !existed => Err("reported missing, expected present".to_owned()),
            Slot::Empty if existed => Err("reported present, expected missing".to_owned()),
            _ => Ok(()),
        };
        self.recorder.verify(row, key, verdict);
        self.slots[slot] = Slot::Empty;
    }

    async fn list(&mut self) {
        let row = (Op::List, Class::NoValue);
        let limit = 1 + self.rng.below(self.profile.slots);
        let call = self.client.list(self.prefix.clone(), limit as u32);
        let Some(keys) = self.recorder.time(row, call).await else {
            return;
        };
        if self.slots.iter().any(|s| matches!(s, Slot::Unknown)) {
            return; // not knowable
        }
        let expected: Vec<&String> = self
            .keys
            .iter()
            .zip(&self.slots)
            .filter(|(_, slot)| matches!(slot, Slot::Holds(_)))
            .map(|(key, _)| key)
            .take(limit)
            .collect();
        let verdict = if keys.iter().eq(expected.iter().copied()) {
            Ok(())
        } else {
            Err(format!("got {keys:?}, expected {expected:?}"))
        };
        self.recorder.verify(row, &self.prefix, verdict);
    }
}

/// Takes one call from `budget`; false when it is spent.
fn take_one(budget: &AtomicU64) -> bool {
    budget
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

// ---------------------------------------------------------------------------------------------
// Measurements
// ---------------------------------------------------------------------------------------------

/// An operation and size class: one row of the results.
type Row = (Op, Class);

/// Measurements of one row.
#[derive(Debug, Default)]
struct Samples {
    /// Latency of each successful call, in nanoseconds.
    latencies_ns: Vec<u64>,
    /// Value bytes moved by successful calls.
    bytes: u64,
    /// Calls that failed (RPC error or refused by the store).
    errors: u64,
    /// Answers that did not match what the caller had stored.
    mismatches: u64,
}

/// Measurements of one caller, or merged over all of them.
#[derive(Debug, Default)]
struct Recorder {
    rows: BTreeMap<Row, Samples>,
    /// The first few failures, in words.
    failures: Vec<String>,
}

impl Recorder {
    /// Failures kept in words; the rest are only counted.
    const KEPT_FAILURES: usize = 10;

    /// Awaits `call`, recording its latency under `row` if it succeeds and an error if not.
    async fn time<T>(
        &mut self,
        row: Row,
        call: impl Future<Output = Result<T, RpcError>>,
    ) -> Option<T> {
        let start = Instant::now();
        let result = call.await;
        let latency = start.elapsed();
        match result {
            Ok(value) => {
                let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
                self.rows.entry(row).or_default().latencies_ns.push(ns);
                Some(value)
            }
            Err(e) => {
                self.error(row, format!("{} call failed: {e}", row.0.name()));
                None
            }
        }
    }

    fn add_bytes(&mut self, row: Row, bytes: usize) {
        self.rows.entry(row).or_default().bytes += bytes as u64;
    }

    fn error(&mut self, row: Row, message: String) {
        self.rows.entry(row).or_default().errors += 1;
        self.note(message);
    }

    /// Counts a mismatch under `row` if `verdict` is one.
    fn verify(&mut self, row: Row, key: &str, verdict: Result<(), String>) {
        if let Err(why) = verdict {
            self.rows.entry(row).or_default().mismatches += 1;
            self.note(format!("{} {key}: {why}", row.0.name()));
        }
    }

    fn note(&mut self, message: String) {
        if self.failures.len() < Self::KEPT_FAILURES {
            self.failures.push(message);
        }
    }

    fn merge(&mut self, other: Recorder) {
        for (row, samples) in other.rows {
            let mine = self.rows.entry(row).or_default();
            mine.latencies_ns.extend(samples.latencies_ns);
            mine.bytes += samples.bytes;
            mine.errors += samples.errors;
            mine.mismatches += samples.mismatches;
        }
        for message in other.failures {
            self.note(message);
        }
    }

    fn passed(&self) -> bool {
        self.rows
            .values()
            .all(|s| s.errors == 0 && s.mismatches == 0)
    }

    /// Prints the table of results, rates over `elapsed`, then the failures kept.
    fn print(&mut self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        println!("ran for {secs:.2} s; ops/s and MB/s over the run, latency per call\n");
        println!(
            "{:<7} {:>9} {:>8} {:>10} {:>10} {:>10} {:>9} {:>7} {:>10}",
            "op", "size", "count", "ops/s", "p50", "p99", "MB/s", "errors", "mismatches"
        );
        for (&(op, class), samples) in &mut self.rows {
            samples.latencies_ns.sort_unstable();
            let lat = &samples.latencies_ns;
            let count = lat.len() as u64 + samples.errors;
            let throughput = if samples.bytes > 0 {
                format!("{:.1}", samples.bytes as f64 / 1e6 / secs)
            } else {
                "-".to_owned()
            };
            println!(
                "{:<7} {:>9} {:>8} {:>10.0} {:>10} {:>10} {:>9} {:>7} {:>10}",
                op.name(),
                class.to_string(),
                count,
                count as f64 / secs,
                format_latency(percentile(lat, 0.50)),
                format_latency(percentile(lat, 0.99)),
                throughput,
                samples.errors,
                samples.mismatches,
            );
        }
        println!();
        for message in &self.failures {
            println!("failure: {message}");
        }
    }
}

/// The `p` quantile (nearest rank) of ascending `sorted` nanoseconds; `None` if empty.
fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.saturating_sub(1)).copied()
}

fn format_latency(ns: Option<u64>) -> String {
    match ns {
        None => "-".to_owned(),
        Some(ns) if ns < 1_000_000 => format!("{:.0} µs", ns as f64 / 1e3),
        Some(ns) => format!("{:.2} ms", ns as f64 / 1e6),
    }
}

/// SplitMix64: a small, fast pseudo-random generator, plenty for choosing keys and sizes.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0; the slight modulo bias does not matter here).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}
