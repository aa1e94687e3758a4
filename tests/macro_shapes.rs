//! `#[rdma_service]` trait shapes: each one compiles, and its generated client and server
//! round-trip calls over TCP loopback.
//!
//! `deny(missing_docs)` checks that the generated public items carry docs.
#![deny(missing_docs)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdma_rpc::codec::{Bincode, Codec, CodecError};
use rdma_rpc::core::{method_id, Service};
use rdma_rpc::{
    rdma_service, Endpoint, Payload, RpcError, Server, ServerErrorKind, ShutdownHandle,
};
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

/// A served service; stops it when told.
struct Running {
    endpoint: Endpoint,
    shutdown: ShutdownHandle,
    serving: JoinHandle<Result<(), RpcError>>,
}

async fn start<S: Service>(service: S) -> Running {
    let server = Server::bind(&"tcp://127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind loopback");
    let endpoint = server.local_endpoint();
    let shutdown = server.shutdown_handle();
    let serving = tokio::spawn(server.serve(service));
    Running {
        endpoint,
        shutdown,
        serving,
    }
}

impl Running {
    async fn stop(self) {
        self.shutdown.shutdown();
        tokio::time::timeout(Duration::from_secs(10), self.serving)
            .await
            .expect("server stops after shutdown")
            .expect("server task does not panic")
            .expect("server returns Ok");
    }
}

// ---------------------------------------------------------------------------------------------
// The example from the docs: Result, Option and unit returns, Payload arguments and results.

/// Why a put was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreError {
    /// Keys may not be empty.
    EmptyKey,
    /// The value is larger than the store takes.
    TooBig {
        /// The limit.
        max: u64,
    },
}

/// A key-value store.
#[rdma_service]
pub trait Store {
    /// Stores `value` under `key`, returning its length.
    async fn put(&self, key: String, value: Payload) -> Result<u64, StoreError>;
    /// The value under `key`.
    async fn get(&self, key: String) -> Option<Payload>;
    /// Does nothing.
    async fn ping(&self);
}

#[derive(Default)]
struct Memory {
    map: Mutex<BTreeMap<String, Payload>>,
    pings: AtomicUsize,
}

impl Store for Memory {
    async fn put(&self, key: String, value: Payload) -> Result<u64, StoreError> {
        if key.is_empty() {
            return Err(StoreError::EmptyKey);
        }
        if value.len() > 4 << 20 {
            return Err(StoreError::TooBig { max: 4 << 20 });
        }
        let len = value.len() as u64;
        self.map.lock().unwrap().insert(key, value);
        Ok(len)
    }

    async fn get(&self, key: String) -> Option<Payload> {
        self.map.lock().unwrap().get(&key).cloned()
    }

    async fn ping(&self) {
        self.pings.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn store_round_trips_results_options_payloads_and_unit() {
    let running = start(StoreServer::new(Memory::default())).await;
    let client = StoreClient::connect(&running.endpoint).await.unwrap();

    let value: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    assert_eq!(
        client
            .put("k".into(), Payload::from(value.clone()))
            .await
            .unwrap(),
        Ok(1 << 20)
    );
    assert_eq!(
        client
            .put(String::new(), Payload::from_static(b"x"))
            .await
            .unwrap(),
        Err(StoreError::EmptyKey)
    );
    assert_eq!(
        client
            .put("big".into(), Payload::from(vec![0; (4 << 20) + 1]))
            .await
            .unwrap(),
        Err(StoreError::TooBig { max: 4 << 20 })
    );
    let got = client.get("k".into()).await.unwrap().expect("stored");
    assert_eq!(got, value);
    assert_eq!(client.get("missing".into()).await.unwrap(), None);
    client.ping().await.unwrap();
    client.ping().await.unwrap();

    running.stop().await;
}

#[tokio::test]
async fn server_adapter_names_its_methods_with_core_ids() {
    let server = StoreServer::new(Memory::default());
    assert_eq!(<StoreServer<Memory> as Service>::NAME, "Store");
    for name in ["Store.put", "Store.get", "Store.ping"] {
        assert_eq!(server.method_name(method_id(name)), Some(name));
    }
    assert_eq!(server.method_name(method_id("Store.nope")), None);
    assert_eq!(server.get_ref().pings.load(Ordering::SeqCst), 0);

    // The ping counter proves the server dispatches to the wrapped value.
    let running = start(server).await;
    let client = StoreClient::connect(&running.endpoint).await.unwrap();
    client.ping().await.unwrap();
    running.stop().await;
}

#[tokio::test]
async fn unknown_ids_and_undecodable_arguments_are_server_errors() {
    let running = start(StoreServer::new(Memory::default())).await;
    let client = StoreClient::connect(&running.endpoint).await.unwrap();
    let raw = client.client();

    let err = raw
        .call::<Bincode, _, ()>(method_id("Store.nope"), "Store.nope", &())
        .await
        .unwrap_err();
    assert_eq!(
        err.server_kind(),
        Some(ServerErrorKind::UnknownMethod),
        "{err}"
    );

    // `put` takes (String, Payload); a (u64,) is not that.
    let err = raw
        .call::<Bincode, _, Result<u64, StoreError>>(method_id("Store.put"), "Store.put", &(7u64,))
        .await
        .unwrap_err();
    assert_eq!(
        err.server_kind(),
        Some(ServerErrorKind::BadRequest),
        "{err}"
    );
    assert!(
        err.to_string().contains("Store.put"),
        "names the method: {err}"
    );

    // The connection still works after both.
    client.ping().await.unwrap();
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_clone_debug_and_share_the_connection() {
    let running = start(StoreServer::new(Memory::default())).await;
    let raw = rdma_rpc::Client::connect(&running.endpoint).await.unwrap();
    let client = StoreClient::from_client(raw);
    assert!(!client.client().is_closed());
    assert!(format!("{client:?}").contains("StoreClient"));

    let calls: Vec<_> = (0..32)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                let key = format!("key{i}");
                let n = client
                    .put(key.clone(), Payload::from(vec![i as u8; i]))
                    .await
                    .unwrap();
                assert_eq!(n, Ok(i as u64));
                client.get(key).await.unwrap().unwrap()
            })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap(), vec![i as u8; i]);
    }
    running.stop().await;
}

/// The rewritten trait methods return `Send` futures, so implementations can be called (and
/// spawned) directly too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trait_methods_are_send_futures() {
    fn assert_send<T: Send>(t: T) -> T {
        t
    }
    let memory = std::sync::Arc::new(Memory::default());
    let m = memory.clone();
    let stored =
        tokio::spawn(
            async move { assert_send(m.put("k".into(), Payload::from_static(b"v"))).await },
        );
    assert_eq!(stored.await.unwrap(), Ok(1));
    assert_eq!(memory.get("k".into()).await.unwrap(), b"v".to_vec());
}

// ---------------------------------------------------------------------------------------------
// Argument counts: none, many (8, of different types), and the maximum (16).

/// Arity edge cases.
#[rdma_service]
pub trait Arity {
    /// No arguments, a result.
    async fn zero(&self) -> u64;
    /// Eight arguments of different types.
    #[allow(clippy::too_many_arguments)]
    async fn eight(
        &self,
        a: u8,
        b: i16,
        c: u32,
        d: i64,
        e: bool,
        f: char,
        g: String,
        h: Vec<u16>,
    ) -> String;
    /// Sixteen arguments, the most a method can take.
    #[allow(clippy::too_many_arguments)]
    async fn sixteen(
        &self,
        a0: u64,
        a1: u64,
        a2: u64,
        a3: u64,
        a4: u64,
        a5: u64,
        a6: u64,
        a7: u64,
        a8: u64,
        a9: u64,
        a10: u64,
        a11: u64,
        a12: u64,
        a13: u64,
        a14: u64,
        a15: u64,
    ) -> Vec<u64>;
}

struct ArityImpl;

impl Arity for ArityImpl {
    async fn zero(&self) -> u64 {
        42
    }

    async fn eight(
        &self,
        a: u8,
        b: i16,
        c: u32,
        d: i64,
        e: bool,
        f: char,
        g: String,
        h: Vec<u16>,
    ) -> String {
        format!("{a} {b} {c} {d} {e} {f} {g} {h:?}")
    }

    async fn sixteen(
        &self,
        a0: u64,
        a1: u64,
        a2: u64,
        a3: u64,
        a4: u64,
        a5: u64,
        a6: u64,
        a7: u64,
        a8: u64,
        a9: u64,
        a10: u64,
        a11: u64,
        a12: u64,
        a13: u64,
        a14: u64,
        a15: u64,
    ) -> Vec<u64> {
        vec![
            a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
        ]
    }
}

#[tokio::test]
async fn arguments_keep_their_order_and_types() {
    let running = start(ArityServer::new(ArityImpl)).await;
    let client = ArityClient::connect(&running.endpoint).await.unwrap();
    assert_eq!(client.zero().await.unwrap(), 42);
    assert_eq!(
        client
            .eight(
                255,
                -2,
                3,
                -4_000_000_000,
                true,
                'ß',
                "g".into(),
                vec![7, 8]
            )
            .await
            .unwrap(),
        "255 -2 3 -4000000000 true ß g [7, 8]"
    );
    let expected: Vec<u64> = (100..116).collect();
    assert_eq!(
        client
            .sixteen(100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115)
            .await
            .unwrap(),
        expected
    );
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// User types (serde derive) as arguments and results, with payloads inside them.

/// What kind of record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// No data.
    Plain,
    /// Tuple variant.
    Sized(u32),
    /// Struct variant.
    Named {
        /// A label.
        label: String,
    },
}

/// A record with a bulk payload inside.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Identifier.
    pub id: u64,
    /// Tags.
    pub tags: Vec<String>,
    /// Kind.
    pub kind: Kind,
    /// Bulk data, travelling beside the message.
    pub blob: Payload,
}

/// Why an insert was refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Rejected {
    /// The id is taken.
    Duplicate(u64),
}

/// Records keyed by id.
#[rdma_service]
pub trait Records {
    /// Inserts `record`.
    async fn insert(&self, record: Record) -> Result<u64, Rejected>;
    /// The record with `id`.
    async fn find(&self, id: u64) -> Option<Record>;
    /// The records of `kind`, or all.
    async fn list(&self, kind: Option<Kind>) -> Vec<Record>;
    /// Payloads in and out, in collections.
    async fn blobs(&self, blobs: Vec<Payload>, extra: Option<Payload>) -> (Payload, Vec<Payload>);
}

#[derive(Default)]
struct RecordsImpl(Mutex<BTreeMap<u64, Record>>);

impl Records for RecordsImpl {
    async fn insert(&self, record: Record) -> Result<u64, Rejected> {
        let mut map = self.0.lock().unwrap();
        if map.contains_key(&record.id) {
            return Err(Rejected::Duplicate(record.id));
        }
        let id = record.id;
        map.insert(id, record);
        Ok(id)
    }

    async fn find(&self, id: u64) -> Option<Record> {
        self.0.lock().unwrap().get(&id).cloned()
    }

    async fn list(&self, kind: Option<Kind>) -> Vec<Record> {
        let map = self.0.lock().unwrap();
        map.values()
            .filter(|r| kind.as_ref().is_none_or(|k| *k == r.kind))
            .cloned()
            .collect()
    }

    async fn blobs(&self, blobs: Vec<Payload>, extra: Option<Payload>) -> (Payload, Vec<Payload>) {
        let mut joined = Vec::new();
        for blob in &blobs {
            joined.extend_from_slice(blob);
        }
        if let Some(extra) = &extra {
            joined.extend_from_slice(extra);
        }
        let mut reversed = blobs;
        reversed.reverse();
        (Payload::from(joined), reversed)
    }
}

#[tokio::test]
async fn user_structs_and_enums_round_trip() {
    let running = start(RecordsServer::new(RecordsImpl::default())).await;
    let client = RecordsClient::connect(&running.endpoint).await.unwrap();
    let records = [
        Record {
            id: 1,
            tags: vec!["a".into()],
            kind: Kind::Plain,
            blob: Payload::from(vec![1u8; 100_000]),
        },
        Record {
            id: 2,
            tags: vec![],
            kind: Kind::Sized(9),
            blob: Payload::new(),
        },
        Record {
            id: 3,
            tags: vec!["x".into(), "y".into()],
            kind: Kind::Named { label: "n".into() },
            blob: Payload::from_static(b"three"),
        },
    ];
    for record in &records {
        assert_eq!(client.insert(record.clone()).await.unwrap(), Ok(record.id));
    }
    assert_eq!(
        client.insert(records[0].clone()).await.unwrap(),
        Err(Rejected::Duplicate(1))
    );
    assert_eq!(client.find(3).await.unwrap().as_ref(), Some(&records[2]));
    assert_eq!(client.find(4).await.unwrap(), None);
    assert_eq!(client.list(None).await.unwrap(), records.to_vec());
    assert_eq!(
        client
            .list(Some(Kind::Named { label: "n".into() }))
            .await
            .unwrap(),
        [records[2].clone()]
    );
    assert_eq!(client.list(Some(Kind::Sized(8))).await.unwrap(), []);

    let blobs = vec![
        Payload::from_static(b"ab"),
        Payload::new(),
        Payload::from(vec![9u8; 70_000]),
    ];
    let (joined, reversed) = client
        .blobs(blobs.clone(), Some(Payload::from_static(b"!")))
        .await
        .unwrap();
    let mut expected = b"ab".to_vec();
    expected.extend_from_slice(&[9u8; 70_000]);
    expected.push(b'!');
    assert_eq!(joined, expected);
    assert_eq!(reversed, blobs.into_iter().rev().collect::<Vec<_>>());
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Raw identifiers, `#[cfg]` and doc attributes on methods.

/// Methods named with keywords.
#[rdma_service]
pub trait Keywords {
    /// `r#type` with raw-identifier arguments.
    async fn r#type(&self, r#in: u8, r#match: String) -> String;
    /// Named `async`.
    async fn r#async(&self) -> u8;
}

struct KeywordsImpl;

impl Keywords for KeywordsImpl {
    async fn r#type(&self, r#in: u8, r#match: String) -> String {
        format!("{match}{in}", match = r#match, in = r#in)
    }

    async fn r#async(&self) -> u8 {
        7
    }
}

#[tokio::test]
async fn raw_identifiers_work_and_go_on_the_wire_without_r_hash() {
    let server = KeywordsServer::new(KeywordsImpl);
    assert_eq!(
        server.method_name(method_id("Keywords.type")),
        Some("Keywords.type")
    );
    assert_eq!(
        server.method_name(method_id("Keywords.async")),
        Some("Keywords.async")
    );
    let running = start(server).await;
    let client = KeywordsClient::connect(&running.endpoint).await.unwrap();
    assert_eq!(client.r#type(5, "m".into()).await.unwrap(), "m5");
    assert_eq!(client.r#async().await.unwrap(), 7);
    running.stop().await;
}

/// Methods behind `#[cfg]`.
#[rdma_service]
pub trait Gated {
    /// Compiled in.
    #[cfg(test)]
    async fn present(&self) -> u8;
    /// Compiled out: the implementation below does not have it, and neither do the stubs.
    #[cfg(not(test))]
    async fn absent(&self) -> u8;
    /// Compiled in, with a `cfg` that has no effect.
    #[cfg(any(test, not(test)))]
    #[doc = "More docs, as an attribute."]
    async fn also_present(&self, x: u8) -> u8;
}

struct GatedImpl;

impl Gated for GatedImpl {
    async fn present(&self) -> u8 {
        1
    }

    async fn also_present(&self, x: u8) -> u8 {
        x + 1
    }
}

#[tokio::test]
async fn cfg_removes_a_method_from_trait_client_and_server() {
    let server = GatedServer::new(GatedImpl);
    assert_eq!(
        server.method_name(method_id("Gated.present")),
        Some("Gated.present")
    );
    assert_eq!(server.method_name(method_id("Gated.absent")), None);
    let running = start(server).await;
    let client = GatedClient::connect(&running.endpoint).await.unwrap();
    assert_eq!(client.present().await.unwrap(), 1);
    assert_eq!(client.also_present(1).await.unwrap(), 2);
    let err = client
        .client()
        .call::<Bincode, _, u8>(method_id("Gated.absent"), "Gated.absent", &())
        .await
        .unwrap_err();
    assert_eq!(err.server_kind(), Some(ServerErrorKind::UnknownMethod));
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// `codec = …`: both ends use the named codec.

static SCRAMBLED_ENCODES: AtomicUsize = AtomicUsize::new(0);

/// Bincode with every byte XORed, so that a peer using plain Bincode cannot read it.
pub struct Scrambled;

impl Codec for Scrambled {
    fn encode<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), CodecError> {
        SCRAMBLED_ENCODES.fetch_add(1, Ordering::SeqCst);
        let start = out.len();
        Bincode::encode(value, out)?;
        out[start..].iter_mut().for_each(|b| *b ^= 0x5a);
        Ok(())
    }

    fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        let plain: Vec<u8> = bytes.iter().map(|b| b ^ 0x5a).collect();
        Bincode::decode(&plain)
    }
}

/// A service on a custom codec.
#[rdma_service(codec = crate::Scrambled)]
pub trait Scrambler {
    /// Echoes `text` with a payload.
    async fn echo(&self, text: String, blob: Payload) -> (String, Payload);
}

struct ScramblerImpl;

impl Scrambler for ScramblerImpl {
    async fn echo(&self, text: String, blob: Payload) -> (String, Payload) {
        (text, blob)
    }
}

#[tokio::test]
async fn codec_argument_is_used_by_client_and_server() {
    let running = start(ScramblerServer::new(ScramblerImpl)).await;
    let client = ScramblerClient::connect(&running.endpoint).await.unwrap();
    let before = SCRAMBLED_ENCODES.load(Ordering::SeqCst);
    let (text, blob) = client
        .echo("hello".into(), Payload::from_static(b"bulk"))
        .await
        .unwrap();
    assert_eq!((text.as_str(), &blob[..]), ("hello", &b"bulk"[..]));
    // Client arguments and server result: two encodes.
    assert_eq!(SCRAMBLED_ENCODES.load(Ordering::SeqCst) - before, 2);

    // A plain-Bincode request is not readable by the server.
    let err = client
        .client()
        .call::<Bincode, _, (String, Payload)>(
            method_id("Scrambler.echo"),
            "Scrambler.echo",
            &("hello".to_owned(), Payload::new()),
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.server_kind(),
        Some(ServerErrorKind::BadRequest),
        "{err}"
    );
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Timeouts through the generated `with_timeout`.

/// Slow calls.
#[rdma_service]
pub trait Slow {
    /// Sleeps for `millis`.
    async fn sleep(&self, millis: u64) -> u64;
}

struct SlowImpl;

impl Slow for SlowImpl {
    async fn sleep(&self, millis: u64) -> u64 {
        tokio::time::sleep(Duration::from_millis(millis)).await;
        millis
    }
}

#[tokio::test]
async fn with_timeout_bounds_calls() {
    let running = start(SlowServer::new(SlowImpl)).await;
    let client = SlowClient::connect(&running.endpoint).await.unwrap();
    let hurried = client.with_timeout(Duration::from_millis(100));
    let started = Instant::now();
    let err = hurried.sleep(2_000).await.unwrap_err();
    assert!(matches!(err, RpcError::DeadlineExceeded), "{err}");
    assert!(started.elapsed() < Duration::from_millis(1_500));
    // The original client keeps its own (default) timeout.
    assert_eq!(client.sleep(10).await.unwrap(), 10);
    running.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Hygiene: no prelude, and user names that shadow what generated code might use.

mod no_prelude {
    #![no_implicit_prelude]

    /// A service declared where nothing is in scope.
    #[::rdma_rpc::rdma_service]
    pub(crate) trait Bare {
        /// Strings and vectors by full path.
        async fn concat(
            &self,
            a: ::std::string::String,
            b: ::std::vec::Vec<u8>,
        ) -> ::std::string::String;
        /// Options and results by full path.
        async fn check(
            &self,
            x: u32,
        ) -> ::core::result::Result<::core::option::Option<u32>, ::std::string::String>;
        /// No arguments, no result.
        async fn nothing(&self);
        /// A payload.
        async fn blob(&self, p: ::rdma_rpc::Payload) -> ::rdma_rpc::Payload;
    }

    /// Implementation, also without a prelude.
    pub(crate) struct BareImpl;

    impl Bare for BareImpl {
        async fn concat(
            &self,
            a: ::std::string::String,
            b: ::std::vec::Vec<u8>,
        ) -> ::std::string::String {
            ::std::format!("{a}{}", b.len())
        }

        async fn check(
            &self,
            x: u32,
        ) -> ::core::result::Result<::core::option::Option<u32>, ::std::string::String> {
            match x {
                0 => ::core::result::Result::Err(::std::string::ToString::to_string("zero")),
                1 => ::core::result::Result::Ok(::core::option::Option::None),
                x => ::core::result::Result::Ok(::core::option::Option::Some(x * 2)),
            }
        }

        async fn nothing(&self) {}

        async fn blob(&self, p: ::rdma_rpc::Payload) -> ::rdma_rpc::Payload {
            p
        }
    }
}

mod shadowed {
    //! Names that generated code must not pick up from the call site.
    #![allow(dead_code)]

    use ::rdma_rpc::rdma_service;
    use serde::{Deserialize, Serialize};

    /// A user type named like the server's type parameter would be.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    pub(crate) struct S(pub u8);

    pub(crate) struct Option;
    pub(crate) struct Result;
    pub(crate) struct Some;
    pub(crate) struct Ok;
    pub(crate) struct Err;
    pub(crate) struct Client;
    pub(crate) struct Endpoint;
    pub(crate) struct Request;
    pub(crate) struct Reply;
    pub(crate) struct Duration;
    pub(crate) trait Send {}
    pub(crate) trait Sync {}
    pub(crate) trait Future {}
    pub(crate) trait Clone {}
    pub(crate) trait Debug {}
    pub(crate) trait Service {}
    pub(crate) mod core {}
    pub(crate) mod rdma_rpc {}

    /// Arguments named like the generated code's own locals and fields.
    #[rdma_service]
    pub(crate) trait Shadow {
        /// Every argument name the generated code might also use.
        #[allow(clippy::too_many_arguments)]
        async fn names(
            &self,
            method: u32,
            request: u32,
            service: S,
            inner: u8,
            endpoint: u8,
            timeout: u8,
            __args: u8,
            ret: u8,
        ) -> S;
    }

    /// Implementation.
    pub(crate) struct ShadowImpl;

    impl Shadow for ShadowImpl {
        async fn names(
            &self,
            method: u32,
            request: u32,
            service: S,
            inner: u8,
            endpoint: u8,
            timeout: u8,
            __args: u8,
            ret: u8,
        ) -> S {
            let sum = method + request + u32::from(service.0) + u32::from(inner);
            let sum = sum + u32::from(endpoint) + u32::from(timeout) + u32::from(__args);
            S((sum + u32::from(ret)) as u8)
        }
    }
}

#[tokio::test]
async fn generated_code_is_hygienic() {
    use no_prelude::{Bare, BareClient, BareImpl, BareServer};
    use shadowed::{ShadowClient, ShadowImpl, ShadowServer, S};

    let bare = start(BareServer::new(BareImpl)).await;
    let client = BareClient::connect(&bare.endpoint).await.unwrap();
    assert_eq!(
        client.concat("ab".into(), vec![1, 2, 3]).await.unwrap(),
        "ab3"
    );
    assert_eq!(client.check(0).await.unwrap(), Err("zero".to_owned()));
    assert_eq!(client.check(1).await.unwrap(), Ok(None));
    assert_eq!(client.check(5).await.unwrap(), Ok(Some(10)));
    client.nothing().await.unwrap();
    assert_eq!(
        client.blob(Payload::from_static(b"p")).await.unwrap(),
        b"p".to_vec()
    );
    assert_eq!(
        BareImpl.check(7).await,
        Ok(Some(14)),
        "the trait is usable directly"
    );
    bare.stop().await;

    let shadow = start(ShadowServer::new(ShadowImpl)).await;
    let client = ShadowClient::connect(&shadow.endpoint).await.unwrap();
    assert_eq!(
        client.names(1, 2, S(3), 4, 5, 6, 7, 8).await.unwrap(),
        S(36)
    );
    shadow.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Visibility follows the trait.

mod restricted {
    use rdma_rpc::rdma_service;

    /// Visible in this crate only; so are its client and server.
    #[rdma_service]
    pub(crate) trait Internal {
        /// Adds one.
        async fn inc(&self, x: u32) -> u32;
    }

    pub(crate) struct InternalImpl;

    impl Internal for InternalImpl {
        async fn inc(&self, x: u32) -> u32 {
            x + 1
        }
    }
}

#[tokio::test]
async fn crate_visible_services_are_usable_from_other_modules() {
    use restricted::{InternalClient, InternalImpl, InternalServer};
    let running = start(InternalServer::new(InternalImpl)).await;
    let client = InternalClient::connect(&running.endpoint).await.unwrap();
    assert_eq!(client.inc(41).await.unwrap(), 42);
    running.stop().await;
}
