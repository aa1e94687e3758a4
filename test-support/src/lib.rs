//! Helpers shared by the integration tests of the workspace's crates (not published).

use std::future::Future;

/// A one-worker tokio runtime on a thread of its own, for a server that a test kills the way a
/// process dies: every task, connection and handler of the runtime dropped at once, mid-flight,
/// with no shutdown and no goodbye.
pub struct DoomedRuntime {
    kill: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl DoomedRuntime {
    /// Runs `start` on a new runtime in a new thread. `start` resolves to what the caller gets
    /// back now (an endpoint, pool counters) and what stays with the runtime: the latter is
    /// dropped only after the runtime, as a killed process's objects would be last seen.
    pub fn start<F, Fut, T, K>(start: F) -> (T, DoomedRuntime)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = (T, K)>,
        T: Send + 'static,
        K: 'static,
    {
        let (kill, killed) = tokio::sync::oneshot::channel::<()>();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("the doomed runtime");
            let kept = rt.block_on(async move {
                let (back, kept) = start().await;
                tx.send(back).expect("the test waits for the start");
                let _ = killed.await;
                kept
            });
            // what ran on the runtime dies first, from its own point of view mid-flight
            drop(rt);
            drop(kept);
        });
        let back = rx.recv().expect("the doomed runtime started");
        (back, DoomedRuntime { kill, thread })
    }

    /// Kills the runtime; returns once it and what it kept are gone. Call it from a
    /// multi-threaded runtime (it blocks in place) or from outside one.
    pub fn kill(self) {
        let _ = self.kill.send(());
        let join = || self.thread.join().expect("the doomed runtime's thread");
        match tokio::runtime::Handle::try_current() {
            Ok(_) => tokio::task::block_in_place(join),
            Err(_) => join(),
        }
    }
}
