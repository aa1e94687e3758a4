//! A `serde::Deserializer` adapter that makes decoding of untrusted input bounded:
//! - nesting deeper than [`MAX_DEPTH`] is an error (instead of a stack overflow that would kill
//!   the process);
//! - sequences and maps report no size hint, so collections grow with the elements actually
//!   decoded instead of reserving what a forged length prefix claims (serde pre-allocates up to
//!   1 MiB per collection from the hint, at every nesting level).

use std::cell::Cell;
use std::fmt;

use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor,
};

/// Deepest nesting of sequences, maps, options, newtypes and enums accepted.
pub const MAX_DEPTH: usize = 128;

/// Wraps a deserializer; `depth` counts the current nesting.
pub(crate) struct Guard<'a, D> {
    pub(crate) inner: D,
    pub(crate) depth: &'a Cell<usize>,
}

struct GuardVisitor<'a, V> {
    inner: V,
    depth: &'a Cell<usize>,
}

struct GuardSeed<'a, S> {
    inner: S,
    depth: &'a Cell<usize>,
}

struct Nested<'a, A> {
    inner: A,
    depth: &'a Cell<usize>,
}

/// Enters one nesting level for the duration of `f`.
fn nest<E: de::Error, R>(depth: &Cell<usize>, f: impl FnOnce() -> Result<R, E>) -> Result<R, E> {
    let d = depth.get() + 1;
    if d > MAX_DEPTH {
        return Err(E::custom(format_args!(
            "input nests deeper than {MAX_DEPTH} levels"
        )));
    }
    depth.set(d);
    let r = f();
    depth.set(d - 1);
    r
}

macro_rules! forward_deserialize {
    ($($method:ident),*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
            let v = self.wrap(visitor);
            self.inner.$method(v)
        }
    )*};
}

impl<'a, D> Guard<'a, D> {
    /// `visitor`, counting nesting against this deserializer's depth.
    fn wrap<V>(&self, visitor: V) -> GuardVisitor<'a, V> {
        GuardVisitor {
            inner: visitor,
            depth: self.depth,
        }
    }
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Guard<'_, D> {
    type Error = D::Error;

    forward_deserialize!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let v = self.wrap(visitor);
        self.inner.deserialize_unit_struct(name, v)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let v = self.wrap(visitor);
        self.inner.deserialize_newtype_struct(name, v)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let v = self.wrap(visitor);
        self.inner.deserialize_tuple(len, v)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let v = self.wrap(visitor);
        self.inner.deserialize_tuple_struct(name, len, v)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let v = self.wrap(visitor);
        self.inner.deserialize_struct(name, fields, v)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let v = self.wrap(visitor);
        self.inner.deserialize_enum(name, variants, v)
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

macro_rules! forward_visit {
    ($($method:ident($ty:ty)),*) => {$(
        fn $method<E: de::Error>(self, v: $ty) -> Result<V::Value, E> {
            self.inner.$method(v)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for GuardVisitor<'_, V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }

    forward_visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>)
    );

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        let depth = self.depth;
        nest(depth, || self.inner.visit_some(Guard { inner: d, depth }))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<V::Value, D::Error> {
        let depth = self.depth;
        nest(depth, || {
            self.inner.visit_newtype_struct(Guard { inner: d, depth })
        })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let depth = self.depth;
        nest(depth, || self.inner.visit_seq(Nested { inner: seq, depth }))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        let depth = self.depth;
        nest(depth, || self.inner.visit_map(Nested { inner: map, depth }))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        let depth = self.depth;
        nest(depth, || {
            self.inner.visit_enum(Nested { inner: data, depth })
        })
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for GuardSeed<'_, S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Guard {
            inner: d,
            depth: self.depth,
        })
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Nested<'_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, A::Error> {
        self.inner.next_element_seed(GuardSeed {
            inner: seed,
            depth: self.depth,
        })
    }

    fn size_hint(&self) -> Option<usize> {
        None
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Nested<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, A::Error> {
        self.inner.next_key_seed(GuardSeed {
            inner: seed,
            depth: self.depth,
        })
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.inner.next_value_seed(GuardSeed {
            inner: seed,
            depth: self.depth,
        })
    }

    fn size_hint(&self) -> Option<usize> {
        None
    }
}

impl<'a, 'de, A: EnumAccess<'de>> EnumAccess<'de> for Nested<'a, A> {
    type Error = A::Error;
    type Variant = Nested<'a, A::Variant>;

    fn variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<(T::Value, Self::Variant), A::Error> {
        let depth = self.depth;
        let (v, variant) = self.inner.variant_seed(GuardSeed { inner: seed, depth })?;
        Ok((
            v,
            Nested {
                inner: variant,
                depth,
            },
        ))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Nested<'_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        let depth = self.depth;
        self.inner
            .newtype_variant_seed(GuardSeed { inner: seed, depth })
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        let depth = self.depth;
        self.inner.tuple_variant(
            len,
            GuardVisitor {
                inner: visitor,
                depth,
            },
        )
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        let depth = self.depth;
        self.inner.struct_variant(
            fields,
            GuardVisitor {
                inner: visitor,
                depth,
            },
        )
    }
}
