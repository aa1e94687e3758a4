//! Tables keyed by 64-bit ids that the program hands out (request ids, work-request ids).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from ids to `V`, hashed with [`IdHasher`].
pub type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// Hashes a 64-bit id with one multiplication, folding the high half of the product into the
/// low one so that every bit of the id reaches the bits the table uses.
///
/// For ids that come from a counter, or from a peer that can only hurt its own connection's
/// table: SipHash, the standard map's default, costs more than the rest of the bookkeeping of
/// a call (measured: ~1,000 instructions per RDMA call on the client, 8% of its work).
#[derive(Debug, Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        let p = u128::from(n ^ self.0) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (p as u64) ^ ((p >> 64) as u64);
    }
}

/// A table that hands out the ids of what it holds: an id is a reusable slot's index (low 32
/// bits), the slot's generation (the next 24) and a tag of the caller's (the top 8), so finding
/// an entry is an index and a comparison, not a hash, and a stale id (its entry removed, the
/// slot reused) finds nothing.
///
/// For work-request ids on a connection's hot path, where an insert and a remove per message
/// of a hash map cost ~80 and ~60 distinct instructions each (callgrind, 2026-12-02).
#[derive(Debug)]
pub struct IdSlab<V> {
    /// per slot: the last id issued for it (0: never used), and its entry
    slots: Vec<(u64, Option<V>)>,
    /// indices of empty slots
    free: Vec<u32>,
    len: usize,
}

impl<V> Default for IdSlab<V> {
    fn default() -> Self {
        IdSlab {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

/// The generation bits of an [`IdSlab`] id.
const GENERATION_MASK: u64 = (1 << 24) - 1;

impl<V> IdSlab<V> {
    /// Holds `value` in a free slot; returns its id, whose top 8 bits are `tag`'s.
    #[inline(always)]
    pub fn insert(&mut self, tag: u8, value: V) -> u64 {
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(self.slots.len()).expect("fewer than 2^32 entries");
                self.slots.push((0, None));
                i
            }
        };
        let slot = &mut self.slots[index as usize];
        let generation = match ((slot.0 >> 32) & GENERATION_MASK) + 1 {
            g if g > GENERATION_MASK => 1,
            g => g,
        };
        let id = (u64::from(tag) << 56) | (generation << 32) | u64::from(index);
        *slot = (id, Some(value));
        self.len += 1;
        id
    }

    /// Takes out the entry of `id`, if it is still there.
    pub fn remove(&mut self, id: u64) -> Option<V> {
        let index = id as u32;
        let slot = self.slots.get_mut(index as usize)?;
        if slot.0 != id {
            return None;
        }
        let value = slot.1.take()?;
        self.free.push(index);
        self.len -= 1;
        Some(value)
    }

    /// How many entries it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every entry, to change in place.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.slots.iter_mut().filter_map(|slot| slot.1.as_mut())
    }

    /// Takes out every entry (their ids are then stale).
    pub fn drain(&mut self) -> Vec<V> {
        let mut out = Vec::with_capacity(self.len);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(v) = slot.1.take() {
                out.push(v);
                self.free.push(i as u32);
            }
        }
        self.len = 0;
        out
    }
}

/// A table keyed by the ids of an [`IdSlab`] (something else kept per entry of that slab): an
/// index and a comparison, like the slab. Ids from one slab only; an entry must be removed
/// before the slab reuses its slot.
#[derive(Debug)]
pub struct IdIndex<V> {
    slots: Vec<Option<(u64, V)>>,
    len: usize,
}

impl<V> Default for IdIndex<V> {
    fn default() -> Self {
        IdIndex {
            slots: Vec::new(),
            len: 0,
        }
    }
}

impl<V> IdIndex<V> {
    /// Keeps `value` under `id`; gives back what was there under another id (which means an
    /// entry outlived its id in the slab: a bug of the caller's).
    pub fn insert(&mut self, id: u64, value: V) -> Option<V> {
        let index = id as u32 as usize;
        if index >= self.slots.len() {
            self.slots.resize_with(index + 1, || None);
        }
        let old = self.slots[index].replace((id, value));
        if old.is_none() {
            self.len += 1;
        }
        old.map(|(_, v)| v)
    }

    /// Takes out the entry under `id`, if there is one.
    pub fn remove(&mut self, id: u64) -> Option<V> {
        let slot = self.slots.get_mut(id as u32 as usize)?;
        match slot {
            Some((held, _)) if *held == id => {
                self.len -= 1;
                slot.take().map(|(_, v)| v)
            }
            _ => None,
        }
    }

    /// How many entries it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Takes out every entry.
    pub fn drain(&mut self) -> Vec<V> {
        self.len = 0;
        self.slots
            .iter_mut()
            .filter_map(|s| s.take().map(|(_, v)| v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_ids_spread_over_the_tables_bits() {
        // hashbrown takes the bucket from the low bits and a tag from the top 7: consecutive
        // ids with a constant top byte (transport-rdma's work-request ids) must vary in both
        let hash = |id: u64| {
            let mut h = IdHasher::default();
            h.write_u64(id);
            h.finish()
        };
        let ids: Vec<u64> = (0..64).map(|i| (3 << 56) | i).collect();
        let low: std::collections::HashSet<u64> = ids.iter().map(|&i| hash(i) & 63).collect();
        let top: std::collections::HashSet<u64> = ids.iter().map(|&i| hash(i) >> 57).collect();
        assert!(low.len() > 32, "low bits: {} distinct of 64", low.len());
        assert!(top.len() > 32, "top bits: {} distinct of 64", top.len());
        let mut m: IdMap<u64> = IdMap::default();
        for &i in &ids {
            m.insert(i, i);
        }
        assert!(ids.iter().all(|i| m.get(i) == Some(i)));
    }
    #[test]
    fn slab_ids_are_unique_and_stale_ids_find_nothing() {
        let mut s: IdSlab<&str> = IdSlab::default();
        let a = s.insert(2, "a");
        let b = s.insert(1, "b");
        assert_eq!((a >> 56, b >> 56), (2, 1), "the tag is the top byte");
        assert_ne!(a as u32, b as u32, "two entries, two slots");
        assert_eq!(s.len(), 2);
        assert_eq!(s.remove(a), Some("a"));
        assert_eq!(s.remove(a), None, "removed once");
        // the slot is reused under a new generation: the old id does not reach the new entry
        let c = s.insert(2, "c");
        assert_eq!(c as u32, a as u32, "the free slot is reused");
        assert_ne!(c, a);
        assert_eq!(s.remove(a), None);
        assert_eq!(s.remove(c ^ (1 << 56)), None, "another tag is another id");
        assert_eq!(s.remove(u64::from(u32::MAX)), None, "no such slot");
        assert_eq!(s.remove(c), Some("c"));
        assert_eq!(s.remove(b), Some("b"));
        assert!(s.is_empty());
    }

    #[test]
    fn slab_values_mut_reaches_every_entry_and_only_those() {
        let mut s: IdSlab<u32> = IdSlab::default();
        let ids: Vec<u64> = (0..5).map(|i| s.insert(1, i)).collect();
        s.remove(ids[1]);
        s.remove(ids[3]);
        for v in s.values_mut() {
            *v += 10;
        }
        assert_eq!(s.remove(ids[0]), Some(10));
        assert_eq!(s.remove(ids[2]), Some(12));
        assert_eq!(s.remove(ids[4]), Some(14));
        assert!(s.is_empty());
    }

    #[test]
    fn slab_generations_wrap_without_reaching_zero() {
        let mut s: IdSlab<u32> = IdSlab::default();
        let mut seen = std::collections::HashSet::new();
        for i in 0..(GENERATION_MASK + 3) as u32 {
            let id = s.insert(0, i);
            assert_ne!(id, 0, "an id is never 0");
            assert_ne!(
                (id >> 32) & GENERATION_MASK,
                0,
                "generation 0 is never issued"
            );
            if i < 1000 {
                assert!(seen.insert(id), "ids repeat only after a full cycle");
            }
            assert_eq!(s.remove(id), Some(i));
        }
    }

    #[test]
    fn slab_drain_takes_everything_and_stays_usable() {
        let mut s: IdSlab<u32> = IdSlab::default();
        let ids: Vec<u64> = (0..10).map(|i| s.insert(3, i)).collect();
        assert_eq!(s.remove(ids[4]), Some(4));
        let mut all = s.drain();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 5, 6, 7, 8, 9]);
        assert!(s.is_empty());
        assert!(
            ids.iter().all(|&id| s.remove(id).is_none()),
            "drained ids are stale"
        );
        let again: Vec<u64> = (0..10).map(|i| s.insert(3, i)).collect();
        assert!(
            again.iter().all(|id| !ids.contains(id)),
            "new ids after a drain"
        );
        assert_eq!(s.len(), 10);
    }

    #[test]
    fn index_follows_a_slabs_ids() {
        let mut slab: IdSlab<()> = IdSlab::default();
        let mut index: IdIndex<&str> = IdIndex::default();
        let a = slab.insert(2, ());
        let b = slab.insert(2, ());
        assert_eq!(index.insert(b, "b"), None);
        assert_eq!(index.insert(a, "a"), None);
        assert_eq!(index.len(), 2);
        assert_eq!(index.remove(a), Some("a"));
        assert_eq!(index.remove(a), None);
        slab.remove(a);
        let c = slab.insert(2, ());
        assert_eq!(
            index.remove(c),
            None,
            "the reused slot holds nothing under the new id"
        );
        assert_eq!(index.insert(c, "c"), None);
        assert_eq!(
            index.remove(a),
            None,
            "a stale id does not take the new entry"
        );
        assert_eq!(
            index.insert(c ^ (1 << 32), "x"),
            Some("c"),
            "a clash is reported"
        );
        let mut rest = index.drain();
        rest.sort_unstable();
        assert_eq!(rest, vec!["b", "x"]);
        assert!(index.is_empty());
    }
}
