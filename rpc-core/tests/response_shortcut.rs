//! A transport's response shortcut: the client takes responses from wherever the transport
//! receives them (over RDMA, the task that polled the completion queue) and wakes the caller,
//! with no hand-off to its reader task. Other frames still go through the reader; late
//! answers are dropped; answers taken this way count as traffic for the keep-alive.
//!
//! The transport here is an in-process fake (the test plays the server and offers each frame
//! to the shortcut, as a transport's receive path does), not a network transport.

mod common;

use std::time::Duration;

use common::{ChanReader, ChanWriter};
use futures::FutureExt;
use rpc_core::wire::{Header, Kind, Message};
use rpc_core::{Bincode, Client, Config, ResponseShortcut, RpcError, Transport};
use tokio::sync::mpsc;

/// An in-process fake transport: frames the client writes go to `sent`; the test delivers
/// frames with [`Server::deliver`], which offers each to the shortcut first.
struct Fake {
    sent: mpsc::UnboundedSender<Message>,
    queued: mpsc::UnboundedReceiver<Message>,
    shortcut: ResponseShortcut,
}

impl Transport for Fake {
    type Reader = ChanReader;
    type Writer = ChanWriter;
    fn split(self) -> (ChanReader, ChanWriter) {
        (ChanReader(self.queued), ChanWriter(self.sent))
    }
    fn peer(&self) -> String {
        "fake".into()
    }
    fn response_shortcut(&self) -> Option<ResponseShortcut> {
        Some(self.shortcut.clone())
    }
}

/// The test's end: what the client wrote, and a way to deliver frames to it.
struct Server {
    sent: mpsc::UnboundedReceiver<Message>,
    queue: mpsc::UnboundedSender<Message>,
    shortcut: ResponseShortcut,
}

impl Server {
    /// Delivers a frame as a transport's receive path does; true if the client took it
    /// through the shortcut, false if it went to the reader.
    fn deliver(&self, msg: Message) -> bool {
        match self.shortcut.offer(msg) {
            None => true,
            Some(msg) => {
                let _ = self.queue.send(msg);
                false
            }
        }
    }

    async fn next_request(&mut self) -> Message {
        loop {
            let m = self.sent.recv().await.expect("client alive");
            if m.header.kind == Kind::Request {
                return m;
            }
        }
    }
}

fn answer(req: &Message) -> Message {
    Message {
        header: Header::new(Kind::Response, req.header.id),
        body: req.body.clone(),
        attachments: Default::default(),
    }
}

fn connect(config: Config) -> (Client, Server) {
    let (sent_tx, sent) = mpsc::unbounded_channel();
    let (queue, queued) = mpsc::unbounded_channel();
    let shortcut = ResponseShortcut::new();
    // before a client installs its taker, everything is given back
    assert!(shortcut
        .offer(Message::control(Kind::Response, 1))
        .is_some());
    let client = Client::new(
        Fake {
            sent: sent_tx,
            queued,
            shortcut: shortcut.clone(),
        },
        config,
    );
    (
        client,
        Server {
            sent,
            queue,
            shortcut,
        },
    )
}

fn call(client: &Client, n: u64) -> impl std::future::Future<Output = Result<u64, RpcError>> {
    client.call::<Bincode, u64, u64>(1, "echo", &n)
}

#[tokio::test]
async fn responses_are_taken_from_another_thread_and_other_frames_go_through_the_reader() {
    let (client, mut server) = connect(Config::default());
    let calls: Vec<_> = (0..8u64).map(|n| tokio::spawn(call(&client, n))).collect();
    let mut reqs = Vec::new();
    for _ in 0..8 {
        reqs.push(server.next_request().await);
    }
    // answered out of order, from a thread that is not the runtime's (as a completion
    // handler may be)
    let server = std::thread::spawn(move || {
        for req in reqs.iter().rev() {
            assert!(server.deliver(answer(req)), "a response is taken");
        }
        server
    })
    .join()
    .unwrap();
    for (n, c) in calls.into_iter().enumerate() {
        assert_eq!(c.await.unwrap().unwrap(), n as u64);
    }

    // a ping is not the shortcut's: the reader gets it and the client answers
    let mut server = server;
    assert!(!server.deliver(Message::control(Kind::Ping, 77)));
    let pong = loop {
        let m = server.sent.recv().await.unwrap();
        if m.header.kind == Kind::Pong {
            break m;
        }
    };
    assert_eq!(pong.header.id, 77);
    assert_eq!(client.in_flight(), 0);
}

#[tokio::test]
async fn a_late_or_unknown_answer_is_dropped_and_the_connection_goes_on() {
    let (client, mut server) = connect(Config::default());
    let mut first = Box::pin(call(&client, 5));
    assert!(first.as_mut().now_or_never().is_none());
    let req = server.next_request().await;
    drop(first); // cancelled: the client tells the server
    assert!(server.deliver(answer(&req)), "taken, and dropped");
    assert!(
        server.deliver(Message::control(Kind::Response, 0xdead_beef_0000_0001)),
        "an answer to no call is taken, and dropped"
    );
    let c = tokio::spawn(call(&client, 6));
    let req = server.next_request().await;
    assert!(server.deliver(answer(&req)));
    assert_eq!(c.await.unwrap().unwrap(), 6);
    assert!(!client.is_closed());
    assert_eq!(client.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn answers_taken_through_the_shortcut_count_as_traffic() {
    let mut config = Config::default();
    config.keepalive_interval = Duration::from_secs(1);
    config.keepalive_timeout = Duration::from_secs(3);
    let (client, mut server) = connect(config);
    // one call answered per keep-alive period for 10 periods: the client hears from the
    // server only through the shortcut, and neither pings nor gives up
    for n in 0..10 {
        let c = tokio::spawn(call(&client, n));
        let req = server.next_request().await;
        assert!(server.deliver(answer(&req)));
        assert_eq!(c.await.unwrap().unwrap(), n);
        tokio::time::sleep(Duration::from_millis(900)).await;
        while let Ok(m) = server.sent.try_recv() {
            assert_ne!(m.header.kind, Kind::Ping, "pinged at period {n}");
        }
    }
    assert!(!client.is_closed());
    // then silence: the client pings, and gives up once the timeout has passed
    tokio::time::timeout(Duration::from_secs(10), client.closed())
        .await
        .expect("a silent server is given up on");
    let mut pinged = false;
    while let Ok(m) = server.sent.try_recv() {
        pinged |= m.header.kind == Kind::Ping;
    }
    assert!(pinged, "the client pinged the silent server");
}
