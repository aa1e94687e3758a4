//! The reader's queue: what the receive side delivers (from the completion dispatch or a
//! transfer's task) waits here for the connection's reader.
//!
//! One consumer, a few producers, and at most a receive window's worth of items (each holds its
//! slot's credit until it is taken), so a `VecDeque` and the consumer's waker under one
//! uncontended lock do. It replaces tokio's unbounded channel, whose linked blocks, atomic
//! waker and semaphore cost the server ~1,100 instructions per small call over RDMA in the
//! reader alone (callgrind in the guest, 2026-12-01; see docs/latency.md, item 17).

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::{Mutex, MutexGuard};

struct State<T> {
    queue: VecDeque<T>,
    /// The consumer's, while it waits for an item.
    waker: Option<Waker>,
    /// Live [`Sender`]s: with none left, the consumer sees the end once the queue is empty.
    senders: usize,
    /// Whether the [`Receiver`] is still there (else sending fails).
    open: bool,
}

struct Shared<T>(Mutex<State<T>>);

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // (no poisoning: nothing here panics while holding the lock, and if something did, the
        // queue would still be consistent, every change being one call on it)
        self.0.lock()
    }
}

/// A queue with room for as many items as its producers give it.
pub(crate) fn inbox<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared(Mutex::new(State {
        queue: VecDeque::new(),
        waker: None,
        senders: 1,
        open: true,
    })));
    (Sender(Arc::clone(&shared)), Receiver(shared))
}

/// A producer's end.
pub(crate) struct Sender<T>(Arc<Shared<T>>);

impl<T> Sender<T> {
    /// Queues `item` and wakes the consumer; gives `item` back if the receiver is gone.
    pub(crate) fn send(&self, item: T) -> Result<(), T> {
        let mut state = self.0.lock();
        if !state.open {
            return Err(item);
        }
        state.queue.push_back(item);
        let waker = state.waker.take();
        drop(state);
        if let Some(w) = waker {
            w.wake();
        }
        Ok(())
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        Sender(Arc::clone(&self.0))
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.senders -= 1;
        let waker = if state.senders == 0 {
            state.waker.take()
        } else {
            None
        };
        drop(state);
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The consumer's end.
pub(crate) struct Receiver<T>(Arc<Shared<T>>);

impl<T> Receiver<T> {
    /// The next item; `None` once every sender is gone and the queue is empty.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut state = self.0.lock();
        if let Some(item) = state.queue.pop_front() {
            return Poll::Ready(Some(item));
        }
        if state.senders == 0 {
            return Poll::Ready(None);
        }
        match &mut state.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            w => *w = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.open = false;
        let left = std::mem::take(&mut state.queue);
        drop(state);
        // (items may give back resources that take other locks: dropped outside this one)
        drop(left);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use super::*;

    /// Counts its wake-ups.
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counter() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (Arc::clone(&c), Waker::from(c))
    }

    #[test]
    fn items_come_in_order_and_wake_a_waiting_receiver() {
        let (tx, mut rx) = inbox();
        let (count, waker) = counter();
        let mut cx = Context::from_waker(&waker);
        assert!(rx.poll_recv(&mut cx).is_pending());
        tx.send(1).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        // no waker registered now: a second item wakes no one
        tx.send(2).unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(1)));
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(2)));
        assert!(rx.poll_recv(&mut cx).is_pending());
    }

    #[test]
    fn the_end_comes_after_the_last_sender_and_the_last_item() {
        let (tx, mut rx) = inbox();
        let tx2 = tx.clone();
        let (count, waker) = counter();
        let mut cx = Context::from_waker(&waker);
        tx2.send(7).unwrap();
        drop(tx2);
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some(7)));
        assert!(rx.poll_recv(&mut cx).is_pending(), "one sender is left");
        drop(tx);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the last sender's drop wakes"
        );
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(None));
    }

    #[test]
    fn sending_to_a_dropped_receiver_gives_the_item_back_and_queued_ones_are_dropped() {
        let (tx, rx) = inbox();
        let queued = Arc::new(());
        tx.send(Arc::clone(&queued)).unwrap();
        assert_eq!(Arc::strong_count(&queued), 2);
        drop(rx);
        assert_eq!(Arc::strong_count(&queued), 1, "the queued item was dropped");
        let back = tx.send(Arc::clone(&queued)).unwrap_err();
        assert!(Arc::ptr_eq(&back, &queued));
    }
}
