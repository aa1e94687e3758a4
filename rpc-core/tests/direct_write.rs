//! A lone call's caller writes its own frame (no hand-off to the writer task), and whatever the
//! sink cannot take or flush at once is finished by the writer task: a sink that is not ready,
//! a flush that is pending, a flush that fails. The transport here is a scripted in-process
//! fake (its sink counts and can refuse), not a network transport.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use futures::{FutureExt, Sink, Stream};
use rpc_core::wire::{Header, Kind, Message};
use rpc_core::{Bincode, Client, Config, RpcError, Transport};
use tokio::sync::{mpsc, oneshot};

/// What the fake sink does on its next calls, and what it saw.
#[derive(Default)]
struct Script {
    /// `poll_ready` answers Pending this many more times (waking at once, like a socket whose
    /// buffer drains).
    not_ready: usize,
    /// `poll_flush` answers Pending this many more times (waking at once).
    flush_pending: usize,
    /// `poll_flush` fails.
    fail_flush: bool,
    /// Frames fed, not yet flushed.
    fed: VecDeque<Message>,
    /// Tasks that fed a frame (`tokio::task::try_id`).
    feeders: Vec<Option<tokio::task::Id>>,
    pending_readies: usize,
    pending_flushes: usize,
}

/// A transport whose frames go to the test (`sent`) and whose answers come from it (`answers`).
struct Scripted {
    script: Arc<Mutex<Script>>,
    sent: mpsc::UnboundedSender<Message>,
    answers: mpsc::UnboundedReceiver<Message>,
    dropped: oneshot::Sender<()>,
}

struct ScriptedSink {
    script: Arc<Mutex<Script>>,
    sent: mpsc::UnboundedSender<Message>,
    /// told when the sink is dropped
    dropped: Option<oneshot::Sender<()>>,
}

impl Drop for ScriptedSink {
    fn drop(&mut self) {
        if let Some(tx) = self.dropped.take() {
            let _ = tx.send(());
        }
    }
}

struct ScriptedStream(mpsc::UnboundedReceiver<Message>);

impl Transport for Scripted {
    type Reader = ScriptedStream;
    type Writer = ScriptedSink;
    fn split(self) -> (ScriptedStream, ScriptedSink) {
        (
            ScriptedStream(self.answers),
            ScriptedSink {
                script: self.script,
                sent: self.sent,
                dropped: Some(self.dropped),
            },
        )
    }
    fn peer(&self) -> String {
        "scripted".into()
    }
}

impl Stream for ScriptedStream {
    type Item = io::Result<Message>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|m| m.map(Ok))
    }
}

impl Sink<Message> for ScriptedSink {
    type Error = io::Error;
    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.script.lock().unwrap();
        if s.not_ready > 0 {
            s.not_ready -= 1;
            s.pending_readies += 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(Ok(()))
    }
    fn start_send(self: Pin<&mut Self>, msg: Message) -> io::Result<()> {
        let mut s = self.script.lock().unwrap();
        s.feeders.push(tokio::task::try_id());
        s.fed.push_back(msg);
        Ok(())
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.script.lock().unwrap();
        if s.fail_flush {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "scripted")));
        }
        if s.flush_pending > 0 {
            s.flush_pending -= 1;
            s.pending_flushes += 1;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        for m in s.fed.drain(..) {
            let _ = self.sent.send(m);
        }
        Poll::Ready(Ok(()))
    }
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_flush(cx)
    }
}

struct Peer {
    client: Client,
    script: Arc<Mutex<Script>>,
    sent: mpsc::UnboundedReceiver<Message>,
    answer: mpsc::UnboundedSender<Message>,
    sink_dropped: oneshot::Receiver<()>,
}

fn connect(script: Script) -> Peer {
    let script = Arc::new(Mutex::new(script));
    let (sent_tx, sent) = mpsc::unbounded_channel();
    let (answer, answers) = mpsc::unbounded_channel();
    let (dropped, sink_dropped) = oneshot::channel();
    let client = Client::new(
        Scripted {
            script: script.clone(),
            sent: sent_tx,
            answers,
            dropped,
        },
        Config::default(),
    );
    Peer {
        client,
        script,
        sent,
        answer,
        sink_dropped,
    }
}

impl Peer {
    /// Answers the next request that reaches the wire with its own body.
    async fn echo_one(&mut self) -> Message {
        let req = self.sent.recv().await.expect("a request");
        assert_eq!(req.header.kind, Kind::Request);
        let _ = self.answer.send(Message {
            header: Header::new(Kind::Response, req.header.id),
            body: req.body.clone(),
            attachments: Default::default(),
        });
        req
    }
}

fn call(client: &Client, n: u64) -> impl std::future::Future<Output = Result<u64, RpcError>> {
    client.call::<Bincode, u64, u64>(1, "echo", &n)
}

#[tokio::test(flavor = "current_thread")]
async fn a_lone_call_is_written_by_its_caller() {
    let mut peer = connect(Script::default());
    let mut first = Box::pin(call(&peer.client, 7));
    // One poll, in this task: on a current-thread runtime the writer task cannot have run, so
    // the frame was fed and flushed by the caller.
    assert!(first.as_mut().now_or_never().is_none());
    {
        let s = peer.script.lock().unwrap();
        assert_eq!(
            s.feeders,
            vec![tokio::task::try_id()],
            "fed by the caller's task"
        );
    }
    let req = peer.sent.try_recv().expect("flushed by the caller");
    let _ = peer.answer.send(Message {
        header: Header::new(Kind::Response, req.header.id),
        body: req.body.clone(),
        attachments: Default::default(),
    });
    assert_eq!(first.await.unwrap(), 7);

    // With another call in flight, frames go through the writer task (so that they share a write).
    let a = tokio::spawn(call(&peer.client, 1));
    let b = tokio::spawn(call(&peer.client, 2));
    peer.echo_one().await;
    peer.echo_one().await;
    assert_eq!(a.await.unwrap().unwrap(), 1);
    assert_eq!(b.await.unwrap().unwrap(), 2);
    let s = peer.script.lock().unwrap();
    assert_eq!(s.feeders.len(), 3);
    assert!(
        s.feeders[1..].iter().any(|t| *t != s.feeders[0]),
        "with two calls in flight one frame is fed by the writer task"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_sink_that_is_not_ready_leaves_the_frame_to_the_writer() {
    let mut peer = connect(Script {
        not_ready: 2,
        ..Script::default()
    });
    let c = tokio::spawn(call(&peer.client, 11));
    let req = peer.echo_one().await;
    assert_eq!(c.await.unwrap().unwrap(), 11);
    let s = peer.script.lock().unwrap();
    assert_eq!(
        s.pending_readies, 2,
        "the sink refused twice before it took the frame"
    );
    assert_eq!(s.feeders.len(), 1, "the frame was fed once");
    assert_eq!(req.header.method, 1);
}

#[tokio::test(flavor = "current_thread")]
async fn a_pending_flush_is_finished_by_the_writer() {
    let mut peer = connect(Script {
        flush_pending: 1,
        ..Script::default()
    });
    let c = tokio::spawn(call(&peer.client, 12));
    peer.echo_one().await;
    assert_eq!(c.await.unwrap().unwrap(), 12);
    // and the link is usable as before
    let c = tokio::spawn(call(&peer.client, 13));
    peer.echo_one().await;
    assert_eq!(c.await.unwrap().unwrap(), 13);
    let s = peer.script.lock().unwrap();
    assert_eq!(s.pending_flushes, 1);
    assert_eq!(s.feeders.len(), 2);
}

#[tokio::test(flavor = "current_thread")]
async fn a_failed_write_fails_the_call_and_closes_the_connection() {
    let peer = connect(Script {
        fail_flush: true,
        ..Script::default()
    });
    let err = call(&peer.client, 14).await.unwrap_err();
    assert!(matches!(err, RpcError::ConnectionClosed), "{err:?}");
    assert!(peer.client.is_closed());
    let err = call(&peer.client, 15).await.unwrap_err();
    assert!(matches!(err, RpcError::ConnectionClosed), "{err:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_dead_connection_frees_its_writer_while_the_client_lives() {
    let mut peer = connect(Script::default());
    let c = tokio::spawn(call(&peer.client, 16));
    peer.echo_one().await;
    assert_eq!(c.await.unwrap().unwrap(), 16);
    // the peer goes away: the reader sees the end of the stream
    drop(peer.answer);
    peer.client.closed().await;
    // the transport's writer is dropped (its resources freed) though the client handle lives
    tokio::time::timeout(std::time::Duration::from_secs(10), peer.sink_dropped)
        .await
        .expect("the writer of a dead connection was not dropped")
        .expect("dropped once");
    let err = call(&peer.client, 17).await.unwrap_err();
    assert!(matches!(err, RpcError::ConnectionClosed), "{err:?}");
}
