//! Tensors anywhere inside a serde message: while a message is encoded, each `Tensor` it meets is
//! set aside in a table and written as its index; while decoding, the index is replaced by the
//! received tensor. This is how ipc-channel carries operating-system handles.

use std::cell::RefCell;

use serde::de::{DeserializeOwned, Error as _};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::tensor::Tensor;

thread_local! {
    static OUTGOING: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
    static INCOMING: RefCell<Option<Vec<Option<Tensor>>>> = const { RefCell::new(None) };
    /// The text of the tensor table's own refusal, which postcard's error cannot carry.
    static REFUSAL: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Raises a custom serde error and keeps its text in [`REFUSAL`] for the caller.
fn refuse<E: std::fmt::Display, R>(text: String, custom: impl FnOnce(String) -> E) -> std::result::Result<R, E> {
    REFUSAL.with(|refusal| *refusal.borrow_mut() = Some(text.clone()));
    Err(custom(text))
}

/// The serde format is postcard (a specified, compact format: variable-length integers, no field
/// names). Decoding reads only from the payload, so a hostile length prefix cannot make it
/// allocate more than the payload holds (serde's collections cap what they reserve up front).
///
/// postcard keeps no text of a custom error (one a message type's own `serialize` or
/// `deserialize` raises): those reach the caller as "the message type's own ... failed". The
/// tensor table's own refusals keep their text through [`REFUSAL`].
fn refusal_text(error: postcard::Error, own: &str) -> String {
    let ours = REFUSAL.with(|refusal| refusal.borrow_mut().take());
    match (ours, error) {
        (Some(text), _) => text,
        (None, postcard::Error::SerdeSerCustom | postcard::Error::SerdeDeCustom) => {
            format!("the message type's own {own} failed (postcard carries no text of its reason)")
        }
        (None, other) => other.to_string(),
    }
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
    REFUSAL.with(|refusal| refusal.borrow_mut().take());
    // The frame's size is checked when it is sent.
    let bytes = postcard::to_stdvec(message).map_err(|e| Error::Encode(refusal_text(e, "Serialize")))?;
    let tensors = OUTGOING.with(|table| table.borrow_mut().take()).unwrap_or_default();
    Ok((bytes, tensors))
}

/// The message in `bytes`, with `tensors` put back in place. Tensors the message does not claim
/// are dropped (and so released).
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], tensors: Vec<Tensor>) -> Result<T> {
    INCOMING.with(|table| *table.borrow_mut() = Some(tensors.into_iter().map(Some).collect()));
    REFUSAL.with(|refusal| refusal.borrow_mut().take());
    let result = match postcard::take_from_bytes(bytes) {
        Ok((message, [])) => Ok(message),
        Ok((_, rest)) => Err(Error::Decode(format!("{} bytes follow the message", rest.len()))),
        Err(e) => Err(Error::Decode(refusal_text(e, "Deserialize"))),
    };
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
            None => refuse("a Tensor can only be serialized by a tensor-queue Sender".to_string(), S::Error::custom),
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
        match taken {
            Ok(tensor) => Ok(tensor),
            Err(text) => refuse(text, D::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    use super::*;
    use crate::tensor::dtype::DType;

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
        assert!(postcard::to_stdvec(&t).is_err(), "a tensor outside a Sender has no table to go to");
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

    /// postcard drops the text of a type's own errors: the caller still learns whose code failed.
    #[test]
    fn a_type_s_own_error_names_the_type_s_code() {
        assert!(matches!(encode(&Picky), Err(Error::Encode(m)) if m.contains("own Serialize failed")));
        let (bytes, tensors) = encode(&0u8).unwrap();
        assert!(
            matches!(decode::<Picky>(&bytes, tensors), Err(Error::Decode(m)) if m.contains("own Deserialize failed"))
        );
    }

    /// Bytes after the message mean the sender's type is not the receiver's.
    #[test]
    fn trailing_bytes_are_refused() {
        let (bytes, tensors) = encode(&(1u8, 2u8)).unwrap();
        assert!(matches!(decode::<u8>(&bytes, tensors), Err(Error::Decode(m)) if m.contains("1 bytes follow")));
    }

    /// A refusal of the tensor table is not taken for a later, unrelated failure's reason.
    #[test]
    fn a_stale_refusal_does_not_name_a_later_failure() {
        let t = Tensor::zeros(crate::tensor::dtype::DType::U8, &[1]).unwrap();
        let twice = encode(&(0u32, 0u32)).unwrap().0;
        assert!(matches!(decode::<(Tensor, Tensor)>(&twice, vec![t]), Err(Error::Decode(m)) if m.contains("twice")));
        let (bytes, tensors) = encode(&0u8).unwrap();
        assert!(
            matches!(decode::<Picky>(&bytes, tensors), Err(Error::Decode(m)) if m.contains("own Deserialize failed"))
        );
    }
}
