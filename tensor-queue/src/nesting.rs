//! How deep a received message may nest. Decoding a value of a recursive type (a tree, a list of
//! lists) recurses once per level, and postcard sets no bound: a peer's message of a few hundred
//! KiB that nests a hundred thousand levels would overflow the receiving thread's stack, which
//! aborts the whole process (no error, no unwinding). [`Limited`] wraps a serde deserializer
//! and refuses a message at [`MAX_NESTING`] levels instead, as a decode error of that message
//! alone.
//!
//! A sender counts the same way ([`to_stdvec`]), so that a message its receiver would refuse is
//! refused at `send`, where its author learns of it.
//!
//! A level is a compound value: a struct, tuple, sequence, map, enum variant, `Some` or newtype
//! struct (so a node of `enum Tree { Leaf(u32), Node { children: Vec<Tree> } }` costs three).
//! The wrapper sits between every deserializer and visitor of the message; what it adds per
//! value is one count, checked where a compound value opens.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor};
use serde::ser::{self, Serialize, Serializer};

/// The most levels a received message may nest. Room for what the Python package sends (64
/// levels of containers, a dict's three deep here), and little stack: decoding a 3-level node
/// of a derived recursive type takes under 1 KiB of stack in a debug build (1,000 nodes fit a
/// 2 MiB thread, a tokio worker's, and 3,000 overflowed it), 256 levels about 90 KiB.
pub(crate) const MAX_NESTING: usize = 256;

/// Why [`take_from_bytes`] failed.
#[derive(Debug)]
pub(crate) enum Failed {
    /// The message nests deeper than [`MAX_NESTING`] levels.
    TooDeep,
    /// postcard's own error (among them the message type's own, raised in its `deserialize`).
    Postcard(postcard::Error),
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Failed::TooDeep => write!(f, "the message nests deeper than {MAX_NESTING} levels"),
            Failed::Postcard(error) => error.fmt(f),
        }
    }
}

/// A `T` decoded (postcard) from the front of `bytes`, nesting at most [`MAX_NESTING`] levels,
/// and the bytes after it.
pub(crate) fn take_from_bytes<'de, T: de::Deserialize<'de>>(bytes: &'de [u8]) -> Result<(T, &'de [u8]), Failed> {
    let tripped = Cell::new(false);
    let mut deserializer = postcard::Deserializer::from_bytes(bytes);
    let decoded = T::deserialize(Limited::new(&mut deserializer, &tripped))
        .and_then(|value| Ok((value, deserializer.finalize()?)));
    decoded.map_err(|error| if tripped.get() { Failed::TooDeep } else { Failed::Postcard(error) })
}

/// The postcard bytes of `message`, if it nests at most [`MAX_NESTING`] levels (counted as a
/// receiver counts them).
pub(crate) fn to_stdvec<T: Serialize + ?Sized>(message: &T) -> Result<Vec<u8>, Failed> {
    let tripped = Cell::new(false);
    let mut serializer = postcard::Serializer { output: postcard::ser_flavors::StdVec::new() };
    message
        .serialize(Limited::new(&mut serializer, &tripped))
        .and_then(|()| postcard::ser_flavors::Flavor::finalize(serializer.output))
        .map_err(|error| if tripped.get() { Failed::TooDeep } else { Failed::Postcard(error) })
}

/// A deserializer (or a visitor, seed or access of one) with `left` levels still allowed;
/// `tripped` is set when a message went deeper, so that the caller can say why it failed
/// (the error itself is the format's own custom error, which may carry no text).
struct Limited<'a, X> {
    inner: X,
    left: usize,
    tripped: &'a Cell<bool>,
}

impl<'a, X> Limited<'a, X> {
    /// `inner`, allowed [`MAX_NESTING`] levels below it.
    fn new(inner: X, tripped: &'a Cell<bool>) -> Self {
        Limited { inner, left: MAX_NESTING, tripped }
    }

    /// `other`, with the same levels left.
    fn wrap<Y>(&self, other: Y) -> Limited<'a, Y> {
        Limited { inner: other, left: self.left, tripped: self.tripped }
    }

    /// `other`, `levels` further down, or `None` (and `tripped` set) if that is too deep.
    fn below<Y>(&self, levels: usize, other: Y) -> Option<Limited<'a, Y>> {
        let left = self.left.checked_sub(levels);
        self.tripped.set(self.tripped.get() || left.is_none());
        Some(Limited { inner: other, left: left?, tripped: self.tripped })
    }

    /// `other`, one level further down; an error once no levels are left.
    fn descend<Y, E: de::Error>(&self, other: Y) -> Result<Limited<'a, Y>, E> {
        self.below(1, other).ok_or_else(|| E::custom(Failed::TooDeep))
    }

    /// `other`, `levels` further down; an error if that is too deep.
    fn nest<Y, E: ser::Error>(&self, levels: usize, other: Y) -> Result<Limited<'a, Y>, E> {
        self.below(levels, other).ok_or_else(|| E::custom(Failed::TooDeep))
    }
}

/// Forwards `deserialize_*` methods, the visitor wrapped.
macro_rules! forward_deserialize {
    ($($method:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $method<V: Visitor<'de>>(self, $($arg: $ty,)* visitor: V) -> Result<V::Value, Self::Error> {
            let visitor = self.wrap(visitor);
            self.inner.$method($($arg,)* visitor)
        }
    )*};
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Limited<'_, D> {
    type Error = D::Error;

    forward_deserialize! {
        deserialize_any();
        deserialize_bool();
        deserialize_i8();
        deserialize_i16();
        deserialize_i32();
        deserialize_i64();
        deserialize_i128();
        deserialize_u8();
        deserialize_u16();
        deserialize_u32();
        deserialize_u64();
        deserialize_u128();
        deserialize_f32();
        deserialize_f64();
        deserialize_char();
        deserialize_str();
        deserialize_string();
        deserialize_bytes();
        deserialize_byte_buf();
        deserialize_option();
        deserialize_unit();
        deserialize_unit_struct(name: &'static str);
        deserialize_newtype_struct(name: &'static str);
        deserialize_seq();
        deserialize_tuple(len: usize);
        deserialize_tuple_struct(name: &'static str, len: usize);
        deserialize_map();
        deserialize_struct(name: &'static str, fields: &'static [&'static str]);
        deserialize_enum(name: &'static str, variants: &'static [&'static str]);
        deserialize_identifier();
        deserialize_ignored_any();
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// Forwards `visit_*` methods of values that hold no others.
macro_rules! forward_visit {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method<E: de::Error>(self, value: $ty) -> Result<V::Value, E> {
            self.inner.$method(value)
        }
    )*};
}

impl<'de, V: Visitor<'de>> Visitor<'de> for Limited<'_, V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        self.inner.expecting(formatter)
    }

    forward_visit! {
        visit_bool(bool);
        visit_i8(i8);
        visit_i16(i16);
        visit_i32(i32);
        visit_i64(i64);
        visit_i128(i128);
        visit_u8(u8);
        visit_u16(u16);
        visit_u32(u32);
        visit_u64(u64);
        visit_u128(u128);
        visit_f32(f32);
        visit_f64(f64);
        visit_char(char);
        visit_str(&str);
        visit_borrowed_str(&'de str);
        visit_string(String);
        visit_bytes(&[u8]);
        visit_borrowed_bytes(&'de [u8]);
        visit_byte_buf(Vec<u8>);
    }

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        let deserializer = self.descend(deserializer)?;
        self.inner.visit_some(deserializer)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        let deserializer = self.descend(deserializer)?;
        self.inner.visit_newtype_struct(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        let seq = self.descend(seq)?;
        self.inner.visit_seq(seq)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        let map = self.descend(map)?;
        self.inner.visit_map(map)
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        let data = self.descend(data)?;
        self.inner.visit_enum(data)
    }
}

impl<'de, T: DeserializeSeed<'de>> DeserializeSeed<'de> for Limited<'_, T> {
    type Value = T::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<T::Value, D::Error> {
        let deserializer = self.wrap(deserializer);
        self.inner.deserialize(deserializer)
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for Limited<'_, A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        let seed = self.wrap(seed);
        self.inner.next_element_seed(seed)
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for Limited<'_, A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        let seed = self.wrap(seed);
        self.inner.next_key_seed(seed)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, A::Error> {
        let seed = self.wrap(seed);
        self.inner.next_value_seed(seed)
    }

    fn size_hint(&self) -> Option<usize> {
        self.inner.size_hint()
    }
}

impl<'a, 'de, A: EnumAccess<'de>> EnumAccess<'de> for Limited<'a, A> {
    type Error = A::Error;
    type Variant = Limited<'a, A::Variant>;

    fn variant_seed<V: DeserializeSeed<'de>>(self, seed: V) -> Result<(V::Value, Self::Variant), A::Error> {
        let seed = self.wrap(seed);
        let (left, tripped) = (self.left, self.tripped);
        let (value, variant) = self.inner.variant_seed(seed)?;
        Ok((value, Limited { inner: variant, left, tripped }))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for Limited<'_, A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.inner.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        let seed = self.wrap(seed);
        self.inner.newtype_variant_seed(seed)
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        let visitor = self.wrap(visitor);
        self.inner.tuple_variant(len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        let visitor = self.wrap(visitor);
        self.inner.struct_variant(fields, visitor)
    }
}

/// A value to serialize with the levels left where it sits.
impl<T: Serialize + ?Sized> Serialize for Limited<'_, &T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.inner.serialize(self.wrap(serializer))
    }
}

/// Forwards `serialize_*` methods of values that hold no others.
macro_rules! forward_serialize {
    ($($method:ident($ty:ty);)*) => {$(
        fn $method(self, value: $ty) -> Result<S::Ok, S::Error> {
            self.inner.$method(value)
        }
    )*};
}

/// Forwards `serialize_*` methods that open a compound value `levels` deep, its serializer
/// wrapped with the levels left inside it.
macro_rules! open_compound {
    ($($method:ident($($arg:ident: $ty:ty),*) -> $compound:ident, $levels:literal;)*) => {$(
        fn $method(self, $($arg: $ty),*) -> Result<Self::$compound, S::Error> {
            let levels = self.nest($levels, ())?;
            Ok(levels.wrap(self.inner.$method($($arg),*)?))
        }
    )*};
}

impl<'a, S: Serializer> Serializer for Limited<'a, S> {
    type Ok = S::Ok;
    type Error = S::Error;
    type SerializeSeq = Limited<'a, S::SerializeSeq>;
    type SerializeTuple = Limited<'a, S::SerializeTuple>;
    type SerializeTupleStruct = Limited<'a, S::SerializeTupleStruct>;
    type SerializeTupleVariant = Limited<'a, S::SerializeTupleVariant>;
    type SerializeMap = Limited<'a, S::SerializeMap>;
    type SerializeStruct = Limited<'a, S::SerializeStruct>;
    type SerializeStructVariant = Limited<'a, S::SerializeStructVariant>;

    forward_serialize! {
        serialize_bool(bool);
        serialize_i8(i8);
        serialize_i16(i16);
        serialize_i32(i32);
        serialize_i64(i64);
        serialize_i128(i128);
        serialize_u8(u8);
        serialize_u16(u16);
        serialize_u32(u32);
        serialize_u64(u64);
        serialize_u128(u128);
        serialize_f32(f32);
        serialize_f64(f64);
        serialize_char(char);
        serialize_str(&str);
        serialize_bytes(&[u8]);
        serialize_unit_struct(&'static str);
    }

    fn serialize_none(self) -> Result<S::Ok, S::Error> {
        self.inner.serialize_none()
    }

    fn serialize_unit(self) -> Result<S::Ok, S::Error> {
        self.inner.serialize_unit()
    }

    // Each compound value below is the level a receiver's visitor counts for it: `Some`, a
    // newtype struct, an enum variant (and, for a tuple or struct variant, its fields' sequence
    // as a second), a sequence, tuple, struct or map.

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        let value = self.nest(1, value)?;
        self.inner.serialize_some(&value)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, name: &'static str, value: &T) -> Result<S::Ok, S::Error> {
        let value = self.nest(1, value)?;
        self.inner.serialize_newtype_struct(name, &value)
    }

    fn serialize_unit_variant(self, name: &'static str, index: u32, variant: &'static str) -> Result<S::Ok, S::Error> {
        self.nest(1, ())?;
        self.inner.serialize_unit_variant(name, index, variant)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        let value = self.nest(1, value)?;
        self.inner.serialize_newtype_variant(name, index, variant, &value)
    }

    // A tuple or struct variant is two levels: its variant, and its fields' sequence.
    open_compound! {
        serialize_seq(len: Option<usize>) -> SerializeSeq, 1;
        serialize_tuple(len: usize) -> SerializeTuple, 1;
        serialize_tuple_struct(name: &'static str, len: usize) -> SerializeTupleStruct, 1;
        serialize_tuple_variant(name: &'static str, index: u32, variant: &'static str, len: usize) -> SerializeTupleVariant, 2;
        serialize_map(len: Option<usize>) -> SerializeMap, 1;
        serialize_struct(name: &'static str, len: usize) -> SerializeStruct, 1;
        serialize_struct_variant(name: &'static str, index: u32, variant: &'static str, len: usize) -> SerializeStructVariant, 2;
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// Implements a compound serializer's trait for `Limited`: each item it takes is wrapped with
/// the levels left inside the compound value.
macro_rules! limited_compound {
    ($($trait:ident { $($method:ident($($key:ident: $key_ty:ty),*);)* })*) => {$(
        impl<S: ser::$trait> ser::$trait for Limited<'_, S> {
            type Ok = S::Ok;
            type Error = S::Error;

            $(fn $method<T: Serialize + ?Sized>(&mut self, $($key: $key_ty,)* value: &T) -> Result<(), S::Error> {
                let value = self.wrap(value);
                self.inner.$method($($key,)* &value)
            })*

            fn end(self) -> Result<S::Ok, S::Error> {
                self.inner.end()
            }
        }
    )*};
}

limited_compound! {
    SerializeSeq { serialize_element(); }
    SerializeTuple { serialize_element(); }
    SerializeTupleStruct { serialize_field(); }
    SerializeTupleVariant { serialize_field(); }
    SerializeMap { serialize_key(); serialize_value(); }
    SerializeStruct { serialize_field(key: &'static str); }
    SerializeStructVariant { serialize_field(key: &'static str); }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::{Deserialize, Serialize};

    /// A recursive message type, as users write them.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Tree {
        Leaf(u32),
        Node { children: Vec<Tree>, label: Option<Box<Tree>> },
    }

    /// The message, or whether it nested too deep.
    fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, bool> {
        match take_from_bytes(bytes) {
            Ok((value, [])) => Ok(value),
            Ok(_) => panic!("bytes left over"),
            Err(failed) => Err(matches!(failed, Failed::TooDeep)),
        }
    }

    /// A `Tree` of `depth` nodes, each the only child of the one above.
    fn chain(depth: usize) -> Tree {
        (0..depth).fold(Tree::Leaf(7), |tree, _| Tree::Node { children: vec![tree], label: None })
    }

    /// The postcard bytes of `chain(depth)`, written out directly (serializing a very deep tree
    /// would itself recurse too deep): each node is variant 1, one child; then the leaf, and
    /// each node's `label: None`.
    fn chain_bytes(depth: usize) -> Vec<u8> {
        let mut bytes = [1u8, 1].repeat(depth);
        bytes.extend([0, 7]);
        bytes.extend(std::iter::repeat_n(0u8, depth));
        bytes
    }

    #[test]
    fn messages_within_the_bound_decode_as_without_it() {
        let tree = Tree::Node { children: vec![Tree::Leaf(1), chain(3)], label: Some(Box::new(Tree::Leaf(2))) };
        let bytes = postcard::to_stdvec(&tree).unwrap();
        assert_eq!(decode::<Tree>(&bytes), Ok(tree));
        // A node's variant and its struct are two levels, its Vec a third; the leaf's variant one.
        let deepest = (MAX_NESTING - 1) / 3;
        assert_eq!(chain_bytes(deepest), postcard::to_stdvec(&chain(deepest)).unwrap());
        assert_eq!(decode::<Tree>(&chain_bytes(deepest)), Ok(chain(deepest)));
        let flat: Vec<(u8, Option<String>, [u16; 3])> =
            (0..200).map(|i| (i as u8, Some(i.to_string()), [i; 3])).collect();
        assert_eq!(decode(&postcard::to_stdvec(&flat).unwrap()), Ok(flat), "long is not deep");
        assert_eq!(decode::<Tree>(&[9]), Err(false), "other errors stay what they are");
    }

    #[test]
    fn a_message_nested_past_the_bound_is_an_error_not_a_stack_overflow() {
        for depth in [(MAX_NESTING - 1) / 3 + 1, 1000, 1_000_000] {
            let result = decode::<Tree>(&chain_bytes(depth));
            assert_eq!(result, Err(true), "{depth} levels");
        }
        // Every kind of compound value counts: options, newtypes, tuples, maps.
        #[derive(Debug, Serialize, Deserialize)]
        struct Wrapped(Option<Box<Wrapped>>);
        let mut deep = [1u8].repeat(MAX_NESTING);
        deep.push(0);
        assert!(matches!(decode::<Wrapped>(&deep), Err(true)), "Some inside a newtype, {MAX_NESTING} times");
        let mut maps = [1u8, 0].repeat(MAX_NESTING);
        maps.extend([0].repeat(MAX_NESTING));
        assert!(matches!(decode::<Maps>(&maps), Err(true)), "maps of maps");
        #[derive(Deserialize)]
        struct Maps(#[allow(dead_code)] std::collections::BTreeMap<u8, Maps>);
    }

    /// Whether `value` encodes, and whether its bytes decode as a `T`.
    fn both_ways<T: Serialize + serde::de::DeserializeOwned>(value: &T) -> (bool, bool) {
        let plain = postcard::to_stdvec(value).unwrap();
        let encoded = to_stdvec(value);
        if let Ok(bytes) = &encoded {
            assert_eq!(bytes, &plain, "the bytes postcard writes");
        }
        (encoded.is_ok(), decode::<T>(&plain).is_ok())
    }

    #[test]
    fn a_sender_refuses_exactly_what_its_receiver_would() {
        #[derive(Serialize, Deserialize)]
        struct Wrapped(Option<Box<Wrapped>>);
        #[derive(Serialize, Deserialize)]
        enum List {
            End,
            Cons(u8, Box<List>),
        }
        #[derive(Serialize, Deserialize)]
        struct Maps(std::collections::BTreeMap<u8, Maps>);
        let mut seen = [0usize; 4];
        for depth in 0..MAX_NESTING {
            let wrapped = (0..depth).fold(Wrapped(None), |inner, _| Wrapped(Some(Box::new(inner))));
            let list = (0..depth).fold(List::End, |tail, n| List::Cons(n as u8, Box::new(tail)));
            let maps = (0..depth).fold(Maps(Default::default()), |inner, _| Maps([(1, inner)].into()));
            for (kind, (encoded, decoded)) in
                [both_ways(&chain(depth)), both_ways(&wrapped), both_ways(&list), both_ways(&maps)]
                    .into_iter()
                    .enumerate()
            {
                assert_eq!(encoded, decoded, "type {kind} at depth {depth}");
                seen[kind] += encoded as usize;
            }
        }
        // Each type reaches the bound within the loop, at its own levels per step.
        assert_eq!(seen, [(MAX_NESTING - 1) / 3 + 1, MAX_NESTING / 2, (MAX_NESTING - 1) / 2 + 1, MAX_NESTING / 2]);
    }
}
