//! Counters of the registered buffer pools (see the crate docs, "Buffer pools").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::verbs::PoolRegion;

/// A snapshot of the counters of every pool a [`PoolMonitor`] watches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounts {
    /// buffers lent in total (receive slots, rendezvous sources and sinks)
    pub leased: u64,
    /// buffers returned in total
    pub returned: u64,
    /// requests that found no free buffer of a fitting class
    pub exhausted: u64,
    /// requests larger than the largest class
    pub too_large: u64,
    /// rendezvous buffers registered on their own because the pool could not lend one (an
    /// `ibv_reg_mr` off the pool; 0 when the pools are sized for the load)
    pub fallback_registrations: u64,
    /// bytes of such buffers held now for the peer's transfers into us (pull sinks, push
    /// grants, and the payloads received in them), bounded per connection by
    /// [`RdmaOptions::max_fallback_bytes`](crate::RdmaOptions::max_fallback_bytes)
    pub fallback_bytes: u64,
    /// the most `fallback_bytes` seen at once
    pub fallback_bytes_peak: u64,
    /// attachments copied into registered memory to be sent by rendezvous, because they were
    /// not in the connection's registered memory already (heap payloads, and every push
    /// source; a payload filled in a buffer from `Client::payload_mut`, or received by pull on
    /// the same connection, is sent by pull as it is). Messages small enough to go inline are
    /// copied into a send slot and not counted here.
    pub copied_sends: u64,
    /// bytes of those copies
    pub copied_bytes: u64,
    /// pool regions still registered (a connection's regions go once the connection and
    /// every buffer of it, posted or held by a payload, are gone)
    pub live_regions: usize,
    /// bytes those regions hold
    pub registered_bytes: u64,
}

impl PoolCounts {
    /// Buffers out of their pool now: posted receive slots, rendezvous buffers the device or
    /// the peer may still use, and received payloads not yet dropped.
    pub fn outstanding(&self) -> u64 {
        self.leased - self.returned
    }
}

/// Watches the registered pools of one connection, or of every connection a listener accepted.
/// Cheap to clone.
#[derive(Clone, Default)]
pub struct PoolMonitor {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    live: Mutex<Vec<(rpc_core::pool::Pool, Weak<PoolRegion>)>>,
    /// counters of pools whose region is gone
    retired: Mutex<PoolCounts>,
    fallback: AtomicU64,
    fallback_bytes: AtomicU64,
    fallback_bytes_peak: AtomicU64,
    copied: AtomicU64,
    copied_bytes: AtomicU64,
}

impl std::fmt::Debug for PoolMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PoolMonitor").field(&self.counts()).finish()
    }
}

fn add(c: &mut PoolCounts, pool: &rpc_core::pool::Pool) {
    let s = pool.stats();
    c.leased += s.leased.load(Ordering::Acquire);
    c.returned += s.returned.load(Ordering::Acquire);
    c.exhausted += s.exhausted.load(Ordering::Relaxed);
    c.too_large += s.too_large.load(Ordering::Relaxed);
}

impl PoolMonitor {
    pub(crate) fn track(&self, region: &Arc<PoolRegion>) {
        let mut live = self.inner.live.lock().unwrap_or_else(|p| p.into_inner());
        self.retire_dead(&mut live);
        live.push((region.pool().clone(), Arc::downgrade(region)));
    }

    pub(crate) fn count_fallback(&self) {
        self.inner.fallback.fetch_add(1, Ordering::Relaxed);
    }

    /// An attachment of `n` bytes was copied into registered memory to be sent.
    pub(crate) fn count_copy(&self, n: usize) {
        self.inner.copied.fetch_add(1, Ordering::Relaxed);
        self.inner
            .copied_bytes
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// `n` bytes of fallback buffers for inbound transfers are now held (see `PoolCounts`).
    pub(crate) fn hold_fallback_bytes(&self, n: u64) {
        let now = self.inner.fallback_bytes.fetch_add(n, Ordering::AcqRel) + n;
        self.inner
            .fallback_bytes_peak
            .fetch_max(now, Ordering::AcqRel);
    }

    /// `n` bytes held by `hold_fallback_bytes` are released.
    pub(crate) fn release_fallback_bytes(&self, n: u64) {
        self.inner.fallback_bytes.fetch_sub(n, Ordering::AcqRel);
    }

    fn retire_dead(&self, live: &mut Vec<(rpc_core::pool::Pool, Weak<PoolRegion>)>) {
        let mut retired = self.inner.retired.lock().unwrap_or_else(|p| p.into_inner());
        live.retain(|(pool, region)| {
            if region.strong_count() > 0 {
                true
            } else {
                add(&mut retired, pool);
                false
            }
        });
    }

    /// The counters now.
    pub fn counts(&self) -> PoolCounts {
        let mut live = self.inner.live.lock().unwrap_or_else(|p| p.into_inner());
        self.retire_dead(&mut live);
        let mut c = *self.inner.retired.lock().unwrap_or_else(|p| p.into_inner());
        for (pool, _) in live.iter() {
            add(&mut c, pool);
            c.live_regions += 1;
            c.registered_bytes += pool.region_len() as u64;
        }
        c.fallback_registrations = self.inner.fallback.load(Ordering::Relaxed);
        c.fallback_bytes = self.inner.fallback_bytes.load(Ordering::Acquire);
        c.fallback_bytes_peak = self.inner.fallback_bytes_peak.load(Ordering::Acquire);
        c.copied_sends = self.inner.copied.load(Ordering::Relaxed);
        c.copied_bytes = self.inner.copied_bytes.load(Ordering::Relaxed);
        c
    }
}
