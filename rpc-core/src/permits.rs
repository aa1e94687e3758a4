//! A counting semaphore for one connection's hot path: a client's credits, a transport's send
//! slots.
//!
//! Taking and returning a permit with no task waiting is one atomic operation each, where
//! tokio's `Semaphore` takes its waiter list's lock on every return (its `add_permits_locked`:
//! ~70 distinct instructions and a lock per permit on a small RDMA call, callgrind,
//! 2026-12-02). Tasks that find none wait in FIFO order through a [`Notify`]; a permit returned
//! while tasks wait goes to the first of them, and [`Permits::try_acquire`] then fails, so that
//! a newcomer does not take it first. (Two tasks that start to wait at the same moment may
//! still pass each other once; nobody waits behind a task that came later for long.)

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Set in [`Permits::state`] once closed.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// A number of permits, taken one at a time (see the [module docs](self)).
#[derive(Debug)]
pub struct Permits {
    /// free permits, and [`CLOSED`]
    state: AtomicUsize,
    /// tasks waiting in [`acquire`](Self::acquire)
    waiting: AtomicUsize,
    /// tasks waiting in [`wait_all_free`](Self::wait_all_free): only then does a return that
    /// frees the last permit notify (a `Notify`'s `notify_waiters` takes its lock, and a lone
    /// call on an idle connection frees the last permit on every call)
    waiting_all_free: AtomicUsize,
    /// how many there are in all (for [`wait_all_free`](Self::wait_all_free))
    total: usize,
    /// wakes the waiting tasks, first come first
    wake: Notify,
    /// wakes those waiting for every permit to be free
    all_free: Notify,
}

/// Why [`Permits::try_acquire`] took none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryAcquireError {
    /// none is free, or tasks wait for them
    NoPermits,
    /// [`Permits::close`] was called
    Closed,
}

/// [`Permits::acquire`] failed: the permits were closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// A permit of a [`Permits`], returned when dropped.
#[derive(Debug)]
#[must_use = "a permit is returned as soon as it is dropped"]
pub struct Permit<'a>(&'a Permits);

impl Permit<'_> {
    /// Keeps the permit taken with no guard to return it: its holder returns it with
    /// [`Permits::release`] (a future that cannot hold a borrow of its own connection, or a
    /// transport whose completion returns it).
    pub fn forget(self) {
        std::mem::forget(self);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// A permit of a shared [`Permits`], returned when dropped.
#[derive(Debug)]
#[must_use = "a permit is returned as soon as it is dropped"]
pub struct OwnedPermit(Arc<Permits>);

impl Drop for OwnedPermit {
    fn drop(&mut self) {
        self.0.release();
    }
}

impl Permits {
    /// `n` free permits.
    ///
    /// # Panics
    /// If `n` does not fit in [`Permits::MAX`].
    pub fn new(n: usize) -> Permits {
        assert!(n <= Permits::MAX, "at most Permits::MAX permits");
        Permits {
            state: AtomicUsize::new(n),
            waiting: AtomicUsize::new(0),
            waiting_all_free: AtomicUsize::new(0),
            total: n,
            wake: Notify::new(),
            all_free: Notify::new(),
        }
    }

    /// The most permits one [`Permits`] holds.
    pub const MAX: usize = CLOSED - 1;

    /// How many are free now.
    pub fn available(&self) -> usize {
        self.state.load(Ordering::Acquire) & !CLOSED
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Takes one if one is free and no task waits for one.
    pub fn try_acquire(&self) -> Result<Permit<'_>, TryAcquireError> {
        if self.waiting.load(Ordering::SeqCst) != 0 {
            return Err(if self.is_closed() {
                TryAcquireError::Closed
            } else {
                TryAcquireError::NoPermits
            });
        }
        self.take().map(|()| Permit(self))
    }

    /// Like [`try_acquire`](Self::try_acquire), for a permit that outlives the borrow.
    pub fn try_acquire_owned(self: &Arc<Self>) -> Result<OwnedPermit, TryAcquireError> {
        self.try_acquire().map(|p| {
            std::mem::forget(p);
            OwnedPermit(Arc::clone(self))
        })
    }

    /// Waits for a permit (first come, first served), or until closed.
    pub async fn acquire(&self) -> Result<Permit<'_>, Closed> {
        if let Ok(p) = self.try_acquire() {
            return Ok(p);
        }
        self.wait().await.map(|()| Permit(self))
    }

    /// Like [`acquire`](Self::acquire), for a permit that outlives the borrow.
    pub fn acquire_owned(
        self: &Arc<Self>,
    ) -> impl Future<Output = Result<OwnedPermit, Closed>> + Send + 'static {
        let this = Arc::clone(self);
        async move {
            let p = this.acquire().await?;
            std::mem::forget(p);
            Ok(OwnedPermit(this))
        }
    }

    /// Waits until every permit is free (none taken), without taking any; at once if closed.
    pub async fn wait_all_free(&self) {
        // counted before looking, so that a return from here on that frees the last permit
        // notifies (`release` reads the count after adding the permit; both are SeqCst)
        let _counted = Waiting::count(&self.waiting_all_free);
        loop {
            let all = self.all_free.notified();
            tokio::pin!(all);
            all.as_mut().enable();
            let s = self.state.load(Ordering::SeqCst);
            if s & CLOSED != 0 || s & !CLOSED >= self.total {
                return;
            }
            all.await;
        }
    }

    /// Closes: waiting tasks and later calls fail; permits taken stay valid (returning them is
    /// harmless).
    pub fn close(&self) {
        self.state.fetch_or(CLOSED, Ordering::SeqCst);
        self.wake.notify_waiters();
        self.all_free.notify_waiters();
    }

    /// One free permit taken, if there is one.
    fn take(&self) -> Result<(), TryAcquireError> {
        let mut cur = self.state.load(Ordering::Relaxed);
        loop {
            if cur & CLOSED != 0 {
                return Err(TryAcquireError::Closed);
            }
            if cur == 0 {
                return Err(TryAcquireError::NoPermits);
            }
            match self.state.compare_exchange_weak(
                cur,
                cur - 1,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    /// The slow path: queued behind the tasks already waiting.
    async fn wait(&self) -> Result<(), Closed> {
        // counted before looking again, so that a permit returned from here on wakes someone
        // (`release` reads the count after adding the permit; both are SeqCst)
        let _counted = Waiting::count(&self.waiting);
        loop {
            let woken = self.wake.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            match self.take() {
                Ok(()) => {
                    // woken for a permit another waiter then took: pass the wake-up on
                    if self.available() > 0 {
                        self.wake.notify_one();
                    }
                    return Ok(());
                }
                Err(TryAcquireError::Closed) => return Err(Closed),
                Err(TryAcquireError::NoPermits) => woken.await,
            }
        }
    }

    /// Returns one permit, taken before and kept without its guard ([`Permit::forget`]). Each
    /// such permit is returned once: a return with none taken adds a permit that was never
    /// there.
    pub fn release(&self) {
        let before = self.state.fetch_add(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) != 0 {
            self.wake.notify_one();
        }
        if (before & !CLOSED) + 1 == self.total && self.waiting_all_free.load(Ordering::SeqCst) != 0
        {
            self.all_free.notify_waiters();
        }
    }
}

/// A task counted in a count of waiting tasks while it waits: counted in (SeqCst) when made,
/// out when dropped (it got what it waited for, failed, or was dropped itself). A notifier that
/// reads the count after its change, SeqCst too, then misses no waiter that looked before it.
#[derive(Debug)]
pub struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    /// Counts the calling task in `count`.
    pub fn count(count: &'a AtomicUsize) -> Waiting<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Poll;

    #[test]
    fn permits_are_taken_and_returned() {
        let p = Permits::new(2);
        let a = p.try_acquire().expect("free");
        let b = p.try_acquire().expect("free");
        assert_eq!(p.try_acquire().unwrap_err(), TryAcquireError::NoPermits);
        assert_eq!(p.available(), 0);
        drop(a);
        assert_eq!(p.available(), 1);
        drop(b);
        assert_eq!(p.available(), 2);
    }

    #[tokio::test]
    async fn a_waiter_gets_the_next_returned_permit_before_a_newcomer() {
        let p = Permits::new(1);
        let held = p.try_acquire().expect("free");
        let mut waiter = Box::pin(p.acquire());
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        drop(held);
        // a permit is free, but it is the waiter's: a newcomer does not get it
        assert_eq!(p.try_acquire().unwrap_err(), TryAcquireError::NoPermits);
        let Poll::Ready(Ok(got)) = futures::poll!(waiter.as_mut()) else {
            panic!("the waiter was not given the returned permit");
        };
        assert_eq!(p.available(), 0);
        drop(got);
        drop(waiter);
        assert!(p.try_acquire().is_ok(), "no one waits any more");
    }

    #[tokio::test]
    async fn waiters_are_served_in_order() {
        let p = Permits::new(1);
        let held = p.try_acquire().expect("free");
        let mut first = Box::pin(p.acquire());
        let mut second = Box::pin(p.acquire());
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(held);
        assert!(
            futures::poll!(second.as_mut()).is_pending(),
            "second came later"
        );
        let Poll::Ready(Ok(a)) = futures::poll!(first.as_mut()) else {
            panic!("first waiter not served");
        };
        drop(a);
        assert!(matches!(
            futures::poll!(second.as_mut()),
            Poll::Ready(Ok(_))
        ));
    }

    #[tokio::test]
    async fn a_dropped_waiter_passes_its_wake_up_on() {
        let p = Permits::new(1);
        let held = p.try_acquire().expect("free");
        let mut first = Box::pin(p.acquire());
        let mut second = Box::pin(p.acquire());
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert!(futures::poll!(second.as_mut()).is_pending());
        drop(held);
        drop(first); // woken for the permit, gone before taking it
        assert!(matches!(
            futures::poll!(second.as_mut()),
            Poll::Ready(Ok(_))
        ));
    }

    #[tokio::test]
    async fn close_fails_waiters_and_later_calls() {
        let p = Permits::new(1);
        let held = p.try_acquire().expect("free");
        let mut waiter = Box::pin(p.acquire());
        assert!(futures::poll!(waiter.as_mut()).is_pending());
        p.close();
        assert!(matches!(
            futures::poll!(waiter.as_mut()),
            Poll::Ready(Err(Closed))
        ));
        drop(held);
        assert_eq!(p.try_acquire().unwrap_err(), TryAcquireError::Closed);
        assert!(p.acquire().await.is_err());
        assert!(p.is_closed());
    }

    #[tokio::test]
    async fn wait_all_free_returns_once_every_permit_is_back() {
        let p = Arc::new(Permits::new(2));
        let a = p.try_acquire_owned().expect("free");
        let b = p.try_acquire_owned().expect("free");
        let mut all = Box::pin(p.wait_all_free());
        assert!(futures::poll!(all.as_mut()).is_pending());
        drop(a);
        assert!(
            futures::poll!(all.as_mut()).is_pending(),
            "one is still out"
        );
        drop(b);
        assert!(futures::poll!(all.as_mut()).is_ready());
    }

    /// Records whether it was woken.
    #[derive(Default)]
    struct WakeFlag(std::sync::atomic::AtomicBool);

    impl futures::task::ArcWake for WakeFlag {
        fn wake_by_ref(this: &Arc<Self>) {
            this.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_return_that_frees_the_last_permit_wakes_wait_all_free() {
        let p = Permits::new(2);
        let a = p.try_acquire().expect("free");
        let b = p.try_acquire().expect("free");
        let flag = Arc::new(WakeFlag::default());
        let waker = futures::task::waker(Arc::clone(&flag));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut all = Box::pin(p.wait_all_free());
        assert!(all.as_mut().poll(&mut cx).is_pending());
        drop(a);
        assert!(
            !flag.0.load(Ordering::SeqCst),
            "woken with a permit still out"
        );
        drop(b);
        assert!(
            flag.0.load(Ordering::SeqCst),
            "not woken when the last permit came back"
        );
        assert!(all.as_mut().poll(&mut cx).is_ready());
        drop(all);
        assert_eq!(
            p.waiting_all_free.load(Ordering::SeqCst),
            0,
            "the waiter is counted out"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_tasks_share_few_permits_without_losing_any() {
        let p = Arc::new(Permits::new(3));
        let inside = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (p, inside) = (Arc::clone(&p), Arc::clone(&inside));
                tokio::spawn(async move {
                    for _ in 0..200 {
                        let _permit = p.acquire_owned().await.expect("open");
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        assert!(n <= 3, "{n} holders of 3 permits");
                        tokio::task::yield_now().await;
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(p.available(), 3, "every permit came back");
        assert_eq!(p.waiting.load(Ordering::SeqCst), 0);
    }
}
