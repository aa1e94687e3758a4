//! [`Attachments`]: the payloads of one message, without a heap allocation for the common
//! case of one.

use std::fmt;
use std::ops::{Deref, DerefMut};

use crate::Payload;

/// The payloads attached to one [`Message`](crate::wire::Message), in the order the codec met
/// them.
///
/// Most calls carry no payload or one (a block, an object, a value), so one is held in place
/// and only a second moves them to the heap: a small call that carries a payload allocates
/// nothing for its attachment list, on either side. Use it as a slice (`len`, `iter`,
/// indexing); build it with [`new`](Self::new) and [`push`](Self::push), from a `Vec`, or by
/// collecting an iterator.
///
/// ```
/// use rpc_core::{wire::Attachments, Payload};
///
/// let mut atts = Attachments::new();
/// atts.push(Payload::copy_from_slice(b"block"));
/// assert_eq!(atts.len(), 1);
/// assert_eq!(&atts[0][..], b"block");
/// let all: Attachments = vec![Payload::copy_from_slice(b"a"), Payload::copy_from_slice(b"b")].into();
/// assert_eq!(all.iter().map(|p| p.len()).sum::<usize>(), 2);
/// ```
#[derive(Clone, Default)]
pub struct Attachments(Repr);

#[derive(Clone, Default)]
enum Repr {
    #[default]
    None,
    One([Payload; 1]),
    Many(Vec<Payload>),
}

impl Attachments {
    /// No attachments.
    pub const fn new() -> Attachments {
        Attachments(Repr::None)
    }

    /// Appends `payload`.
    #[inline]
    pub fn push(&mut self, payload: Payload) {
        match self.0 {
            Repr::None => self.0 = Repr::One([payload]),
            _ => self.push_more(payload),
        }
    }

    /// [`push`](Self::push) to attachments that hold one or more.
    fn push_more(&mut self, payload: Payload) {
        self.0 = match std::mem::take(&mut self.0) {
            Repr::None => Repr::One([payload]),
            Repr::One([first]) => Repr::Many(vec![first, payload]),
            Repr::Many(mut v) => {
                v.push(payload);
                Repr::Many(v)
            }
        };
    }

    /// Removes them all.
    pub fn clear(&mut self) {
        self.0 = Repr::None;
    }

    /// The payloads as a `Vec`.
    pub fn into_vec(self) -> Vec<Payload> {
        match self.0 {
            Repr::None => Vec::new(),
            Repr::One([p]) => vec![p],
            Repr::Many(v) => v,
        }
    }
}

impl Deref for Attachments {
    type Target = [Payload];

    fn deref(&self) -> &[Payload] {
        match &self.0 {
            Repr::None => &[],
            Repr::One(one) => one,
            Repr::Many(v) => v,
        }
    }
}

impl DerefMut for Attachments {
    fn deref_mut(&mut self) -> &mut [Payload] {
        match &mut self.0 {
            Repr::None => &mut [],
            Repr::One(one) => one,
            Repr::Many(v) => v,
        }
    }
}

impl From<Vec<Payload>> for Attachments {
    fn from(v: Vec<Payload>) -> Attachments {
        if v.len() <= 1 {
            v.into_iter().collect()
        } else {
            Attachments(Repr::Many(v))
        }
    }
}

impl From<Attachments> for Vec<Payload> {
    fn from(a: Attachments) -> Vec<Payload> {
        a.into_vec()
    }
}

impl FromIterator<Payload> for Attachments {
    fn from_iter<I: IntoIterator<Item = Payload>>(iter: I) -> Attachments {
        let mut iter = iter.into_iter();
        let Some(first) = iter.next() else {
            return Attachments::new();
        };
        let Some(second) = iter.next() else {
            return Attachments(Repr::One([first]));
        };
        let mut v = Vec::with_capacity(2 + iter.size_hint().0);
        v.push(first);
        v.push(second);
        v.extend(iter);
        Attachments(Repr::Many(v))
    }
}

impl Extend<Payload> for Attachments {
    fn extend<I: IntoIterator<Item = Payload>>(&mut self, iter: I) {
        for p in iter {
            self.push(p);
        }
    }
}

/// An owning iterator over [`Attachments`].
pub struct IntoIter(IterRepr);

enum IterRepr {
    One(std::array::IntoIter<Payload, 1>),
    Many(std::vec::IntoIter<Payload>),
}

impl Iterator for IntoIter {
    type Item = Payload;

    fn next(&mut self) -> Option<Payload> {
        match &mut self.0 {
            IterRepr::One(it) => it.next(),
            IterRepr::Many(it) => it.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            IterRepr::One(it) => it.size_hint(),
            IterRepr::Many(it) => it.size_hint(),
        }
    }
}

impl ExactSizeIterator for IntoIter {}

impl fmt::Debug for IntoIter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IntoIter")
            .field("remaining", &self.len())
            .finish()
    }
}

impl IntoIterator for Attachments {
    type Item = Payload;
    type IntoIter = IntoIter;

    fn into_iter(self) -> IntoIter {
        IntoIter(match self.0 {
            Repr::None => IterRepr::Many(Vec::new().into_iter()),
            Repr::One(one) => IterRepr::One(one.into_iter()),
            Repr::Many(v) => IterRepr::Many(v.into_iter()),
        })
    }
}

impl<'a> IntoIterator for &'a Attachments {
    type Item = &'a Payload;
    type IntoIter = std::slice::Iter<'a, Payload>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl PartialEq for Attachments {
    fn eq(&self, other: &Attachments) -> bool {
        **self == **other
    }
}

impl fmt::Debug for Attachments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &[u8]) -> Payload {
        Payload::copy_from_slice(s)
    }

    #[test]
    fn push_keeps_order_through_every_representation() {
        let mut a = Attachments::new();
        assert!(a.is_empty());
        for (i, s) in [&b"a"[..], b"bb", b"ccc"].into_iter().enumerate() {
            a.push(p(s));
            assert_eq!(a.len(), i + 1);
        }
        let lens: Vec<usize> = a.iter().map(|x| x.len()).collect();
        assert_eq!(lens, [1, 2, 3]);
        let owned: Vec<Payload> = a.clone().into_iter().collect();
        assert_eq!(owned, a.into_vec());
    }

    #[test]
    fn conversions_agree() {
        for n in 0..4 {
            let v: Vec<Payload> = (0..n).map(|_| p(b"xy")).collect();
            let from_vec = Attachments::from(v.clone());
            let collected: Attachments = v.clone().into_iter().collect();
            assert_eq!(from_vec, collected);
            assert_eq!(from_vec.len(), n);
            assert_eq!(from_vec.into_iter().len(), n);
            assert_eq!(Vec::from(collected), v);
        }
    }

    #[test]
    fn one_payload_is_held_in_place() {
        let mut a = Attachments::new();
        a.push(p(b"z"));
        assert!(
            matches!(a.0, Repr::One(_)),
            "one attachment does not allocate"
        );
        a[0] = p(b"w");
        assert_eq!(&a[0][..], b"w");
        a.clear();
        assert!(a.is_empty());
    }
}
