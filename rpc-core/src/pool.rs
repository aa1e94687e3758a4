//! A bounded buffer pool: size classes carved out of one region that a transport registers
//! once at start-up, so no registration ever happens on the hot path.
//!
//! The pool hands out [`Lease`]s: exclusive ranges (`offset`, `capacity`) of the region. It
//! never touches the memory itself, so it needs no `unsafe`; the transport owns the region and
//! gives access to a lease's bytes. A lease goes back to its free list when dropped, wherever
//! that happens, and the [`PoolStats`] counters say how many are out, so tests can prove that
//! every buffer came back.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One size class: `count` buffers of `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeClass {
    /// Bytes per buffer.
    pub size: usize,
    /// Number of buffers.
    pub count: usize,
}

/// Counters of a pool.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Leases handed out in total.
    pub leased: AtomicU64,
    /// Leases returned in total.
    pub returned: AtomicU64,
    /// Requests that found no free buffer of a fitting class.
    pub exhausted: AtomicU64,
    /// Requests larger than the largest class.
    pub too_large: AtomicU64,
}

impl PoolStats {
    /// Leases out now.
    pub fn outstanding(&self) -> u64 {
        self.leased.load(Ordering::Acquire) - self.returned.load(Ordering::Acquire)
    }
}

struct Class {
    size: usize,
    base: usize,
    free: Vec<u32>,
}

struct Inner {
    classes: Mutex<Vec<Class>>,
    stats: PoolStats,
    len: usize,
}

/// A pool of buffers in one region of [`Pool::region_len`] bytes. Cheap to clone (shared).
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("region_len", &self.inner.len)
            .field("outstanding", &self.inner.stats.outstanding())
            .finish()
    }
}

/// Why a pool could not be laid out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pool layout: {0}")]
pub struct LayoutError(&'static str);

impl Pool {
    /// Lays out `classes` back to back (each buffer aligned to 64 bytes). Classes must be
    /// non-empty and strictly increasing in size.
    pub fn new(classes: &[SizeClass]) -> Result<Pool, LayoutError> {
        if classes.is_empty() {
            return Err(LayoutError("no size classes"));
        }
        if classes.windows(2).any(|w| w[0].size >= w[1].size) {
            return Err(LayoutError("sizes must strictly increase"));
        }
        let mut base = 0usize;
        let mut out = Vec::with_capacity(classes.len());
        for c in classes {
            if c.size == 0 || c.count == 0 || c.count > u32::MAX as usize {
                return Err(LayoutError("empty class"));
            }
            let stride = c.size.div_ceil(64) * 64;
            let total = stride
                .checked_mul(c.count)
                .and_then(|t| t.checked_add(base))
                .ok_or(LayoutError("region too large"))?;
            out.push(Class {
                size: stride,
                base,
                // Pop from the end: hand out low indices first.
                free: (0..c.count as u32).rev().collect(),
            });
            base = total;
        }
        Ok(Pool {
            inner: Arc::new(Inner {
                classes: Mutex::new(out),
                stats: PoolStats::default(),
                len: base,
            }),
        })
    }

    /// Bytes of the region the transport must provide and register.
    pub fn region_len(&self) -> usize {
        self.inner.len
    }

    /// The pool's counters.
    pub fn stats(&self) -> &PoolStats {
        &self.inner.stats
    }

    /// Largest buffer the pool can lend.
    pub fn max_buffer(&self) -> usize {
        self.inner
            .classes
            .lock()
            .expect("pool lock")
            .last()
            .map_or(0, |c| c.size)
    }

    /// Lends a buffer of at least `len` bytes from the smallest class that has one free, or
    /// `None` if none has (the caller waits or refuses; the pool never grows).
    pub fn lease(&self, len: usize) -> Option<Lease> {
        let mut classes = self.inner.classes.lock().expect("pool lock");
        if classes.last().is_none_or(|c| c.size < len) {
            drop(classes);
            self.inner.stats.too_large.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        for (ci, c) in classes.iter_mut().enumerate() {
            if c.size < len {
                continue;
            }
            if let Some(index) = c.free.pop() {
                let offset = c.base + index as usize * c.size;
                let capacity = c.size;
                drop(classes);
                self.inner.stats.leased.fetch_add(1, Ordering::Release);
                return Some(Lease {
                    pool: self.inner.clone(),
                    class: ci as u32,
                    index,
                    offset,
                    capacity,
                    len,
                });
            }
        }
        drop(classes);
        self.inner.stats.exhausted.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// Exclusive use of one buffer of a [`Pool`]; returned to the pool when dropped.
pub struct Lease {
    pool: Arc<Inner>,
    class: u32,
    index: u32,
    offset: usize,
    capacity: usize,
    len: usize,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Lease {
    /// Offset of the buffer in the region.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether zero bytes were asked for.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the buffer holds (its class size).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Shrinks or grows the used length within the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "{len} exceeds capacity {}",
            self.capacity
        );
        self.len = len;
    }

    /// The region range `offset..offset + len`.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut classes = self.pool.classes.lock().expect("pool lock");
        let class = &mut classes[self.class as usize];
        debug_assert!(!class.free.contains(&self.index), "lease returned twice");
        class.free.push(self.index);
        drop(classes);
        self.pool.stats.returned.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn pool() -> Pool {
        Pool::new(&[
            SizeClass {
                size: 100,
                count: 3,
            },
            SizeClass {
                size: 4096,
                count: 2,
            },
            SizeClass {
                size: 1 << 20,
                count: 1,
            },
        ])
        .unwrap()
    }

    #[test]
    fn layout_and_classes() {
        let p = pool();
        assert_eq!(p.region_len(), 3 * 128 + 2 * 4096 + (1 << 20));
        let a = p.lease(10).unwrap();
        assert_eq!((a.offset(), a.capacity(), a.len()), (0, 128, 10));
        let b = p.lease(129).unwrap();
        assert_eq!(b.offset(), 3 * 128);
        assert!(p.lease((1 << 20) + 1).is_none());
        assert_eq!(p.stats().too_large.load(Ordering::Relaxed), 1);
        assert!(Pool::new(&[]).is_err());
        assert!(Pool::new(&[
            SizeClass { size: 8, count: 1 },
            SizeClass { size: 8, count: 1 }
        ])
        .is_err());
    }

    #[test]
    fn exhaustion_falls_back_to_larger_classes_then_fails() {
        let p = pool();
        let held: Vec<Lease> = (0..6).map(|_| p.lease(1).unwrap()).collect();
        assert!(p.lease(1).is_none());
        assert_eq!(p.stats().exhausted.load(Ordering::Relaxed), 1);
        assert_eq!(p.stats().outstanding(), 6);
        drop(held);
        assert_eq!(p.stats().outstanding(), 0);
        assert!(p.lease(1).is_some());
    }

    #[test]
    fn leases_return_from_other_threads() {
        let p = pool();
        let l = p.lease(5000).unwrap();
        std::thread::spawn(move || drop(l)).join().unwrap();
        assert_eq!(p.stats().outstanding(), 0);
    }

    proptest! {
        /// Random lease/return sequences against a model: no two live leases overlap, every
        /// lease fits its request, and all buffers come back.
        #[test]
        fn never_two_owners_and_all_return(ops in proptest::collection::vec((any::<bool>(), 0usize..5000, any::<prop::sample::Index>()), 0..200)) {
            let p = pool();
            let mut live: HashMap<usize, Lease> = HashMap::new();
            let mut next = 0usize;
            for (take, len, pick) in ops {
                if take {
                    if let Some(l) = p.lease(len) {
                        prop_assert!(l.capacity() >= len);
                        prop_assert!(l.offset() + l.capacity() <= p.region_len());
                        for other in live.values() {
                            let (a, b) = (l.offset()..l.offset() + l.capacity(), other.offset()..other.offset() + other.capacity());
                            prop_assert!(a.end <= b.start || b.end <= a.start, "overlap {:?} {:?}", a, b);
                        }
                        live.insert(next, l);
                        next += 1;
                    }
                } else if !live.is_empty() {
                    let keys: Vec<usize> = live.keys().copied().collect();
                    live.remove(&keys[pick.index(keys.len())]);
                }
                prop_assert_eq!(p.stats().outstanding(), live.len() as u64);
            }
            live.clear();
            prop_assert_eq!(p.stats().outstanding(), 0);
        }
    }
}
