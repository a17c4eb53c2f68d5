//! Tensors anywhere inside a serde message: while a message is encoded, each `Tensor` it meets is
//! set aside in a table and written as its index; while decoding, the index is replaced by the
//! received tensor. This is how ipc-channel carries operating-system handles.

use std::cell::RefCell;

use serde::de::{DeserializeOwned, Error as _};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::{Error, Result, Tensor};

thread_local! {
    static OUTGOING: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
    static INCOMING: RefCell<Option<Vec<Option<Tensor>>>> = const { RefCell::new(None) };
}

/// The serde format is bincode with variable-length integers (compact). It keeps the text of
/// custom errors (a message type's own `serialize` or `deserialize` errors reach the caller
/// whole), which postcard drops. Decoding is limited to the payload's own length, so a hostile
/// length prefix cannot make it allocate more.
fn decoding(limit: usize) -> impl bincode::Options {
    use bincode::Options;
    bincode::DefaultOptions::new().with_limit(limit as u64)
}

/// Clears a table when encoding or decoding ends, even by panic.
struct Reset(&'static std::thread::LocalKey<RefCell<Option<Vec<Tensor>>>>);

impl Drop for Reset {
    fn drop(&mut self) {
        self.0.with(|table| table.borrow_mut().take());
    }
}

/// The serde bytes of `message` and the tensors it holds, in the order the bytes refer to them.
pub(crate) fn encode<T: Serialize>(message: &T) -> Result<(Vec<u8>, Vec<Tensor>)> {
    OUTGOING.with(|table| *table.borrow_mut() = Some(Vec::new()));
    let _reset = Reset(&OUTGOING);
    // Written in one pass: with a limit, bincode first walks the message to size it, and each
    // tensor would be set aside twice. The frame's size is checked when it is sent.
    let mut bytes = Vec::new();
    bincode::Options::serialize_into(bincode::DefaultOptions::new(), &mut bytes, message)
        .map_err(|e| Error::Encode(e.to_string()))?;
    let tensors = OUTGOING.with(|table| table.borrow_mut().take()).unwrap_or_default();
    Ok((bytes, tensors))
}

/// The message in `bytes`, with `tensors` put back in place. Tensors the message does not claim
/// are dropped (and so released).
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], tensors: Vec<Tensor>) -> Result<T> {
    INCOMING.with(|table| *table.borrow_mut() = Some(tensors.into_iter().map(Some).collect()));
    let result = bincode::Options::deserialize(decoding(bytes.len()), bytes).map_err(|e| Error::Decode(e.to_string()));
    INCOMING.with(|table| table.borrow_mut().take());
    result
}

impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let index = OUTGOING.with(|table| {
            let mut table = table.borrow_mut();
            let table = table.as_mut()?;
            table.push(self.clone());
            Some(table.len() - 1)
        });
        match index {
            Some(index) => serializer.serialize_u32(index as u32),
            None => Err(S::Error::custom("a Tensor can only be serialized by a tensor-queue Sender")),
        }
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let index = u32::deserialize(deserializer)? as usize;
        let taken = INCOMING.with(|table| {
            let mut table = table.borrow_mut();
            let Some(table) = table.as_mut() else {
                return Err("a Tensor can only be deserialized by a tensor-queue Receiver".to_string());
            };
            match table.get_mut(index) {
                None => Err(format!("the message names tensor {index}, which it does not carry")),
                Some(slot) => slot.take().ok_or_else(|| format!("the message names tensor {index} twice")),
            }
        });
        taken.map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::DType;

    #[derive(Serialize, Deserialize)]
    struct Inner {
        weights: Vec<Tensor>,
        name: String,
    }

    #[derive(Serialize, Deserialize)]
    struct Outer {
        x: Tensor,
        inner: Inner,
        maybe: Option<Tensor>,
        by_name: BTreeMap<String, Tensor>,
        step: u64,
    }

    #[test]
    fn tensors_anywhere_travel_beside_the_bytes() {
        let t = |v: f32| Tensor::from_slice(&[v], DType::F32, &[1]).unwrap();
        let message = Outer {
            x: t(1.0),
            inner: Inner { weights: vec![t(2.0), t(3.0)], name: "w".into() },
            maybe: Some(t(4.0)),
            by_name: BTreeMap::from([("b".to_string(), t(5.0))]),
            step: 9,
        };
        let (bytes, tensors) = encode(&message).unwrap();
        assert_eq!(tensors.len(), 5);
        let back: Outer = decode(&bytes, tensors).unwrap();
        assert_eq!(back.inner.weights[1].to_vec::<f32>().unwrap(), [3.0]);
        assert_eq!(back.by_name["b"].to_vec::<f32>().unwrap(), [5.0]);
        assert_eq!((back.step, back.inner.name.as_str()), (9, "w"));
    }

    #[test]
    fn bad_references_are_errors_not_panics() {
        let (bytes, mut tensors) = encode(&(Tensor::zeros(DType::U8, &[1]).unwrap(), 1u8)).unwrap();
        tensors.clear();
        assert!(matches!(decode::<(Tensor, u8)>(&bytes, tensors), Err(Error::Decode(_))));
        let t = Tensor::zeros(DType::U8, &[1]).unwrap();
        let outside = bincode::serialize(&t).unwrap_err().to_string();
        assert!(outside.contains("only be serialized by a tensor-queue Sender"), "{outside}");
        let twice = encode(&(0u32, 0u32)).unwrap().0;
        assert!(matches!(decode::<(Tensor, Tensor)>(&twice, vec![t]), Err(Error::Decode(m)) if m.contains("twice")));
    }
}

#[cfg(test)]
mod custom_errors {
    use super::*;

    /// A message type whose own serde code fails with a reason.
    struct Picky;

    impl Serialize for Picky {
        fn serialize<S: Serializer>(&self, _: S) -> std::result::Result<S::Ok, S::Error> {
            Err(S::Error::custom("picky refuses to be sent"))
        }
    }

    impl<'de> Deserialize<'de> for Picky {
        fn deserialize<D: Deserializer<'de>>(_: D) -> std::result::Result<Self, D::Error> {
            Err(D::Error::custom("picky refuses to arrive"))
        }
    }

    /// Found by an outside test: postcard dropped the text of a type's own errors.
    #[test]
    fn a_type_s_own_error_text_reaches_the_caller() {
        assert!(matches!(encode(&Picky), Err(Error::Encode(m)) if m.contains("picky refuses to be sent")));
        let (bytes, tensors) = encode(&0u8).unwrap();
        assert!(
            matches!(decode::<Picky>(&bytes, tensors), Err(Error::Decode(m)) if m.contains("picky refuses to arrive"))
        );
    }
}
