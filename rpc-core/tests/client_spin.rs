//! The caller of a lone call receives for itself ([`DirectSend::progress`]) while it waits,
//! within the transport's spin window ([`DirectSend::spin_window`]): its answer is found and
//! handled in its own task, with no receiving task in between. With the window at zero, or
//! with other calls in flight, callers leave receiving to the transport, and a spin that ran
//! out of window leaves the answer to the transport's receiving path.
//!
//! The transport is an in-process fake: its direct sender takes the requests, the test plays
//! the server and puts answers "on the wire", and `progress` delivers what is on the wire
//! through the response shortcut, as a transport that polls its completion queue from the
//! calling task does. Nothing else delivers unless the test does. A caller also leaves
//! receiving to the transport while another connection's lone call waits on its thread, and
//! on a multi-thread runtime. It spins in bursts of the transport's length
//! ([`DirectSend::spin_burst`]), letting the runtime's other tasks run between them.
//!
//! Like the RDMA transport, the fake lends an answer to the caller that polls for it
//! ([`DirectSend::progress_with`]): the caller decodes it borrowed, and it never reaches the
//! shortcut. Every answer of a fake that does not lend goes through the shortcut.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{ChanReader, ChanWriter, Lent};
use rpc_core::wire::{Header, Kind, Message};
use rpc_core::{
    Bincode, Client, Config, DirectSend, LentFrame, ResponseShortcut, RpcError, Transport,
};
use tokio::sync::mpsc;

/// The fake's link: requests the client posted directly, answers waiting to be received.
struct Link {
    shortcut: ResponseShortcut,
    window: Mutex<Duration>,
    /// what `spin_burst` answers
    burst: Duration,
    /// the requests posted through the direct sender
    posted: mpsc::UnboundedSender<Message>,
    /// answers not received yet
    wire: Mutex<VecDeque<Message>>,
    /// whether `progress_with` lends answers (else it is `progress`)
    lend: bool,
    /// whether a lent answer's `accept` says no (the transport could not count it)
    refuse: AtomicBool,
    /// calls of `progress`, those that found something, and the answers lent
    polls: AtomicUsize,
    found: AtomicUsize,
    lent: AtomicUsize,
    /// nanoseconds from `start` to the last `progress`
    start: Instant,
    last_poll: AtomicU64,
}

impl Link {
    /// Receives one answer from the wire, if there is one: offered to the shortcut, as a
    /// transport's receive path does (the client takes responses).
    fn receive(&self) -> bool {
        let Some(msg) = self.wire.lock().unwrap().pop_front() else {
            return false;
        };
        assert!(
            self.shortcut.offer(msg).is_none(),
            "the client takes responses"
        );
        true
    }
}

impl Link {
    /// Counts a poll, and when it came.
    fn count_poll(&self) {
        self.polls.fetch_add(1, Ordering::SeqCst);
        let ns = self.start.elapsed().as_nanos() as u64;
        self.last_poll.store(ns, Ordering::SeqCst);
    }
}

impl DirectSend for Link {
    fn ready(&self) -> bool {
        true
    }
    fn try_send(&self, msg: &Message) -> bool {
        self.posted.send(msg.clone()).is_ok()
    }
    fn spin_window(&self) -> Duration {
        *self.window.lock().unwrap()
    }
    fn spin_burst(&self) -> Duration {
        self.burst
    }
    fn progress(&self) -> bool {
        self.count_poll();
        let found = self.receive();
        if found {
            self.found.fetch_add(1, Ordering::SeqCst);
        }
        found
    }
    fn progress_with(&self, id: u64, take: &mut dyn FnMut(&mut dyn LentFrame) -> bool) -> bool {
        if !self.lend {
            return self.progress();
        }
        // what is on the wire is looked at once: an answer put there after this look waits
        // for the next poll (as on a real link), and is lent then
        let mut wire = self.wire.lock().unwrap();
        let lend = wire
            .front()
            .map(|m| m.header.kind == Kind::Response && m.header.id == id);
        if lend != Some(true) {
            drop(wire);
            if lend.is_none() {
                self.count_poll();
                return false;
            }
            return self.progress();
        }
        let answer = wire.pop_front().expect("looked at above");
        drop(wire);
        self.count_poll();
        // lent as a transport lends it: the frame's bytes, read in place
        let accept = !self.refuse.load(Ordering::SeqCst);
        let mut lent = Lent::new(&answer, accept);
        let taken = take(&mut lent);
        assert!(lent.asked, "the caller asks to accept its answer");
        if !taken {
            assert!(!accept, "the caller takes an answer it may take");
            // not counted as received: the usual path
            assert!(
                self.shortcut.offer(answer).is_none(),
                "the client takes responses"
            );
            self.found.fetch_add(1, Ordering::SeqCst);
            return true;
        }
        self.found.fetch_add(1, Ordering::SeqCst);
        self.lent.fetch_add(1, Ordering::SeqCst);
        true
    }
}

struct Fake {
    link: Arc<Link>,
    written: mpsc::UnboundedSender<Message>,
    incoming: mpsc::UnboundedReceiver<Message>,
}

impl Transport for Fake {
    type Reader = ChanReader;
    type Writer = ChanWriter;
    fn split(self) -> (ChanReader, ChanWriter) {
        (ChanReader(self.incoming), ChanWriter(self.written))
    }
    fn peer(&self) -> String {
        "fake".into()
    }
    fn response_shortcut(&self) -> Option<ResponseShortcut> {
        Some(self.link.shortcut.clone())
    }
    fn direct_send(&self) -> Option<Arc<dyn DirectSend>> {
        Some(self.link.clone())
    }
}

/// The test's end of the fake.
struct Server {
    link: Arc<Link>,
    posted: mpsc::UnboundedReceiver<Message>,
    written: mpsc::UnboundedReceiver<Message>,
    _reader: mpsc::UnboundedSender<Message>,
}

impl Server {
    /// The next request, posted directly or through the writer; fails the test rather than
    /// hang if none comes.
    async fn next_request(&mut self) -> Message {
        let next = async {
            loop {
                let m = tokio::select! {
                    Some(m) = self.posted.recv() => m,
                    Some(m) = self.written.recv() => m,
                };
                if m.header.kind == Kind::Request {
                    return m;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), next)
            .await
            .expect("a request")
    }

    /// Puts the answer to `req` (an echo of its body) on the wire, where only a receive finds
    /// it.
    fn answer(&self, req: &Message) {
        self.answer_with(req, 0, req.body.clone());
    }

    /// Puts an answer to `req` with error code `aux` (0: none) and `body` on the wire.
    fn answer_with(&self, req: &Message, aux: u32, body: bytes::Bytes) {
        let mut header = Header::new(Kind::Response, req.header.id);
        header.method = req.header.method;
        header.aux = aux;
        self.link.wire.lock().unwrap().push_back(Message {
            header,
            body,
            attachments: Default::default(),
        });
    }

    fn polls(&self) -> usize {
        self.link.polls.load(Ordering::SeqCst)
    }
}

fn connect(window: Duration) -> (Client, Server) {
    connect_bursting(window, Duration::ZERO)
}

/// [`connect`], with the transport asking for bursts of `burst` (zero: the client's own).
fn connect_bursting(window: Duration, burst: Duration) -> (Client, Server) {
    connect_link(window, burst, true)
}

/// [`connect_bursting`], with a transport that lends answers or not.
fn connect_link(window: Duration, burst: Duration, lend: bool) -> (Client, Server) {
    let (posted_tx, posted) = mpsc::unbounded_channel();
    let (written_tx, written) = mpsc::unbounded_channel();
    let (reader_tx, incoming) = mpsc::unbounded_channel();
    let link = Arc::new(Link {
        shortcut: ResponseShortcut::new(),
        window: Mutex::new(window),
        burst,
        posted: posted_tx,
        wire: Mutex::new(VecDeque::new()),
        lend,
        refuse: AtomicBool::new(false),
        polls: AtomicUsize::new(0),
        found: AtomicUsize::new(0),
        lent: AtomicUsize::new(0),
        start: Instant::now(),
        last_poll: AtomicU64::new(0),
    });
    let client = Client::new(
        Fake {
            link: link.clone(),
            written: written_tx,
            incoming,
        },
        Config::default(),
    );
    (
        client,
        Server {
            link,
            posted,
            written,
            _reader: reader_tx,
        },
    )
}

fn call(client: &Client, n: u64) -> impl std::future::Future<Output = Result<u64, RpcError>> {
    client.call::<Bincode, u64, u64>(1, "echo", &n)
}

/// Answers each request as soon as it is posted, from a thread of its own (as the peer
/// does), and never receives: only the callers' own polls can deliver the answers.
fn answer_everything(server: Server) -> std::thread::JoinHandle<Server> {
    answer_requests(server, 20)
}

/// [`answer_everything`], for `n` requests.
fn answer_requests(mut server: Server, n: usize) -> std::thread::JoinHandle<Server> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for _ in 0..n {
                let req = server.next_request().await;
                server.answer(&req);
            }
        });
        server
    })
}

/// Makes 20 calls one after the other while [`answer_everything`] plays the server: each answer
/// can only reach its caller through the caller's own receiving.
async fn twenty_calls_the_caller_receives(client: &Client, server: Server) -> Server {
    let peer = answer_everything(server);
    for n in 0..20u64 {
        let got = tokio::time::timeout(Duration::from_secs(10), call(client, n))
            .await
            .expect("answered: the caller received it itself");
        assert_eq!(got.unwrap(), n);
    }
    peer.join().unwrap()
}

/// Lets this runtime's other tasks run, as often as they want to, a hundred turns.
async fn let_tasks_run() {
    for _ in 0..100 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_lone_caller_receives_its_own_answer() {
    let (client, server) = connect(Duration::from_secs(30));
    let server = twenty_calls_the_caller_receives(&client, server).await;
    assert_eq!(server.link.found.load(Ordering::SeqCst), 20);
    assert_eq!(
        server.link.lent.load(Ordering::SeqCst),
        20,
        "every answer was decoded borrowed"
    );
    assert!(server.link.wire.lock().unwrap().is_empty());
    assert_eq!(client.in_flight(), 0, "every call's slot is free again");
}

/// A lent answer's attachments are copied out of the borrowed frame into payloads the caller
/// keeps: an echo of payloads of 0 to 300 bytes gets each back whole.
#[tokio::test(flavor = "current_thread")]
async fn lent_answers_carry_their_payloads() {
    let (client, mut server) = connect(Duration::from_secs(30));
    for len in [0usize, 1, 64, 300] {
        let sent = rpc_core::Payload::from((0..len).map(|i| i as u8).collect::<Vec<u8>>());
        let pending =
            tokio::spawn(client.call::<Bincode, _, rpc_core::Payload>(2, "echo", &(sent.clone(),)));
        let req = server.next_request().await;
        assert_eq!(
            req.attachments.len(),
            1,
            "the payload travels as an attachment"
        );
        let mut header = Header::new(Kind::Response, req.header.id);
        header.method = req.header.method;
        server.link.wire.lock().unwrap().push_back(Message {
            header,
            body: req.body.clone(),
            attachments: req.attachments.clone(),
        });
        let back = pending.await.unwrap().expect("echoed");
        assert_eq!(back, sent, "{len} bytes");
    }
    assert_eq!(server.link.lent.load(Ordering::SeqCst), 4);
    assert_eq!(client.in_flight(), 0);
}

/// An answer whose lending the transport cannot accept (`LentFrame::accept` says no) is left
/// to the transport, which delivers it the usual way.
#[tokio::test(flavor = "current_thread")]
async fn an_answer_not_accepted_goes_the_usual_way() {
    let (client, server) = connect(Duration::from_secs(30));
    server.link.refuse.store(true, Ordering::SeqCst);
    twenty_calls_none_lent(&client, server).await;
}

#[tokio::test(flavor = "current_thread")]
async fn a_transport_that_does_not_lend_delivers_through_the_shortcut() {
    let (client, server) = connect_link(Duration::from_secs(30), Duration::ZERO, false);
    twenty_calls_none_lent(&client, server).await;
}

/// [`twenty_calls_the_caller_receives`], each answer through the shortcut, none lent.
async fn twenty_calls_none_lent(client: &Client, server: Server) {
    let server = twenty_calls_the_caller_receives(client, server).await;
    assert_eq!(server.link.found.load(Ordering::SeqCst), 20);
    assert_eq!(server.link.lent.load(Ordering::SeqCst), 0);
    assert_eq!(client.in_flight(), 0);
}

/// A lent answer that is the server's error, or that does not decode, fails its call as it
/// would through the shortcut; the call's slot is freed and the next call is answered.
#[tokio::test(flavor = "current_thread")]
async fn lent_errors_and_undecodable_answers_fail_only_their_call() {
    let (client, mut server) = connect(Duration::from_secs(30));
    let pending = tokio::spawn(call(&client, 1));
    let req = server.next_request().await;
    let code = rpc_core::ServerErrorKind::UnknownMethod.code();
    server.answer_with(&req, code, bytes::Bytes::from_static(b"no such method"));
    match pending.await.unwrap() {
        Err(RpcError::Server(e)) => {
            assert_eq!(e.kind, rpc_core::ServerErrorKind::UnknownMethod);
            assert_eq!(e.message, "no such method");
        }
        other => panic!("expected the server's error, got {other:?}"),
    }
    let pending = tokio::spawn(call(&client, 2));
    let req = server.next_request().await;
    // a u64 needs 8 bytes (bincode, fixed-width) or 1 to 9 (varint): 0xff alone is neither
    server.answer_with(&req, 0, bytes::Bytes::from_static(&[0xff]));
    assert!(
        matches!(pending.await.unwrap(), Err(RpcError::Codec(_))),
        "an answer that does not decode is a codec error"
    );
    assert_eq!(server.link.lent.load(Ordering::SeqCst), 2);
    assert_eq!(client.in_flight(), 0);
    let server = twenty_calls_the_caller_receives(&client, server).await;
    assert_eq!(server.link.lent.load(Ordering::SeqCst), 22);
}

#[tokio::test(flavor = "current_thread")]
async fn with_no_spin_window_the_caller_never_receives() {
    let (client, mut server) = connect(Duration::ZERO);
    for n in 0..5u64 {
        let pending = tokio::spawn(call(&client, n));
        let req = server.next_request().await;
        server.answer(&req);
        // the transport's receiving path, here the test
        assert!(server.link.receive());
        assert_eq!(pending.await.unwrap().unwrap(), n);
    }
    assert_eq!(server.polls(), 0, "no caller polled");
}

#[tokio::test(flavor = "current_thread")]
async fn with_other_calls_in_flight_callers_leave_receiving_to_the_transport() {
    let (client, mut server) = connect(Duration::from_secs(30));
    // spawned in this order on one thread: the first is alone when it starts waiting (it may
    // spin once), the second is not
    let first = tokio::spawn(call(&client, 1));
    let second = tokio::spawn(call(&client, 2));
    let a = server.next_request().await;
    let b = server.next_request().await;
    // both wait now
    let_tasks_run().await;
    let polls = server.polls();
    let_tasks_run().await;
    assert_eq!(
        server.polls(),
        polls,
        "no caller polls with two calls waiting"
    );
    server.answer(&a);
    server.answer(&b);
    assert!(server.link.receive() && server.link.receive());
    let mut got = [
        first.await.unwrap().unwrap(),
        second.await.unwrap().unwrap(),
    ];
    got.sort_unstable();
    assert_eq!(got, [1, 2]);
    assert_eq!(server.polls(), polls, "answers came through the transport");
}

#[tokio::test(flavor = "current_thread")]
async fn a_spin_ends_with_its_window_and_the_transport_delivers_the_answer() {
    let window = Duration::from_millis(20);
    let (client, mut server) = connect(window);
    let pending = tokio::spawn(call(&client, 7));
    let req = server.next_request().await;
    assert!(server.polls() > 0, "the lone caller polled");
    // wait until the caller has spun past its window (it lets this task run between bursts)
    let from = server.link.start.elapsed();
    while server.link.start.elapsed() < from + window * 2 {
        tokio::task::yield_now().await;
    }
    let last = Duration::from_nanos(server.link.last_poll.load(Ordering::SeqCst));
    // A burst begun inside the window ends ~10 us later, unless the OS preempts the thread
    // during it (seen once in five runs with a build loading both cores): half a window of
    // slack, still far short of the two windows waited.
    assert!(
        last < from + window + window / 2,
        "the caller stopped polling within its window (last poll {last:?}, window ended by {:?})",
        from + window
    );
    let polls = server.polls();
    let_tasks_run().await;
    assert_eq!(server.polls(), polls, "the caller no longer polls");
    assert!(!pending.is_finished());
    server.answer(&req);
    assert!(server.link.receive());
    assert_eq!(pending.await.unwrap().unwrap(), 7);
    assert_eq!(server.polls(), polls);
}

#[tokio::test(flavor = "current_thread")]
async fn lone_calls_of_two_connections_on_one_thread_leave_receiving_to_the_transports() {
    let (one, mut server_one) = connect(Duration::from_secs(30));
    let (two, mut server_two) = connect(Duration::from_secs(30));
    // the first may spin once before the second starts waiting; from then on neither does
    let first = tokio::spawn(call(&one, 1));
    let second = tokio::spawn(call(&two, 2));
    let a = server_one.next_request().await;
    let b = server_two.next_request().await;
    let_tasks_run().await;
    let polls = (server_one.polls(), server_two.polls());
    let_tasks_run().await;
    assert_eq!(
        (server_one.polls(), server_two.polls()),
        polls,
        "no caller polls while another lone call waits on its thread"
    );
    server_one.answer(&a);
    server_two.answer(&b);
    assert!(server_one.link.receive() && server_two.link.receive());
    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(second.await.unwrap().unwrap(), 2);

    // with the other call gone, a lone call spins again
    let server = twenty_calls_the_caller_receives(&one, server_one).await;
    assert_eq!(server.link.found.load(Ordering::SeqCst), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_multi_thread_runtime_callers_leave_receiving_to_the_transport() {
    let (client, mut server) = connect(Duration::from_secs(30));
    for n in 0..5u64 {
        let pending = tokio::spawn(call(&client, n));
        let req = server.next_request().await;
        server.answer(&req);
        assert!(server.link.receive());
        assert_eq!(pending.await.unwrap().unwrap(), n);
    }
    assert_eq!(server.polls(), 0, "no caller polled");
}

/// Spawns a task that counts its turns on this thread, and lets it start.
async fn ticker() -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let turns = Arc::new(AtomicUsize::new(0));
    let ticker = tokio::spawn({
        let turns = Arc::clone(&turns);
        async move {
            loop {
                turns.fetch_add(1, Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
        }
    });
    let_tasks_run().await;
    (turns, ticker)
}

/// Counts the turns a task on this thread gets while the call below waits: with the client's
/// own 10 µs bursts the caller lets it run between them, with the transport's long bursts it
/// does not, since the answer comes within one. The peer answers only once the caller has
/// polled `polls_before_answer` times (some milliseconds of polling, far more than 10 µs).
async fn turns_of_another_task_while_waiting(burst: Duration) -> (usize, usize) {
    let (client, mut server) = connect_bursting(Duration::from_secs(30), burst);
    let (turns, ticker) = ticker().await;
    let link = Arc::clone(&server.link);
    let polls_before_answer = 20_000;
    let peer = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let req = rt.block_on(server.next_request());
        let from = link.polls.load(Ordering::SeqCst);
        while link.polls.load(Ordering::SeqCst) < from + polls_before_answer {
            std::hint::spin_loop();
        }
        server.answer(&req);
        // kept open until the call is over: a closed link would end the call
        server
    });
    let before = turns.load(Ordering::SeqCst);
    let got = tokio::time::timeout(Duration::from_secs(10), call(&client, 5))
        .await
        .expect("answered");
    assert_eq!(got.unwrap(), 5);
    let during = turns.load(Ordering::SeqCst) - before;
    drop(peer.join().unwrap());
    ticker.abort();
    (during, polls_before_answer)
}

#[tokio::test(flavor = "current_thread")]
async fn a_caller_spins_in_the_bursts_the_transport_asks_for() {
    let (during, polls) = turns_of_another_task_while_waiting(Duration::from_secs(30)).await;
    assert_eq!(
        during, 0,
        "one burst of the transport's length took the whole wait ({polls} polls)"
    );
    let (during, polls) = turns_of_another_task_while_waiting(Duration::ZERO).await;
    assert!(
        during > 0,
        "with the client's own bursts, another task ran while the caller polled {polls} times"
    );
}

/// Back-to-back lone calls whose answers all come within the caller's burst complete without
/// ever waiting; the caller still hands its thread back once tokio's cooperative budget (128
/// units a turn) is spent, so the thread's other tasks run between them.
#[tokio::test(flavor = "current_thread")]
async fn back_to_back_lone_calls_let_the_threads_other_tasks_run() {
    let calls = 1_000;
    let (client, server) = connect_bursting(Duration::from_secs(30), Duration::from_secs(30));
    let (turns, ticker) = ticker().await;
    let peer = answer_requests(server, calls);
    let before = turns.load(Ordering::SeqCst);
    let run = async {
        for n in 0..calls as u64 {
            assert_eq!(call(&client, n).await.unwrap(), n);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("answered");
    let during = turns.load(Ordering::SeqCst) - before;
    let server = peer.join().unwrap();
    ticker.abort();
    assert_eq!(
        server.link.found.load(Ordering::SeqCst),
        calls,
        "the caller received every answer itself"
    );
    assert!(
        during >= calls / 128 - 1,
        "another task ran {during} times during {calls} back-to-back calls"
    );
}
