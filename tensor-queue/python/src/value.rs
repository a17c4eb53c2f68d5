//! The value tree: what a Python message may hold, as a serde type the Rust channel carries.
//!
//! None, bool, int, float, str, bytes, list, tuple, dict and arrays (NumPy, torch, any DLPack
//! object), nested. Types are kept exactly (a tuple stays a tuple, a bool a bool, an array comes
//! back as the framework it left); anything else is refused at `send` with a `NotSendable`
//! (a `TypeError`) that names where it sits. Nothing is pickled and nothing runs on receipt.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::{Deserialize, Serialize};
use tensor_queue::Tensor;

use crate::dlpack::{self, SendOrder};
use crate::errors::raise;

/// How deep a message may nest (deeper is refused at `send`, where it also stops cycles, and on
/// receipt, where it stops a hostile peer's message from overflowing the stack).
const MAX_DEPTH: usize = 64;

/// One node of a message.
#[derive(Serialize, Deserialize)]
pub enum Value {
    /// `None`.
    None,
    /// `bool`.
    Bool(bool),
    /// An `int` that fits 64 bits.
    Int(i64),
    /// A larger `int`, as Python writes it in hexadecimal (`-0x1f`; decimal from older senders,
    /// which `int(text, 0)` reads too). Hexadecimal, since Python bounds the digits of a decimal
    /// conversion (4,300 by default: a larger `int` raised a bare `ValueError` at `send`, or lost
    /// the message at a receiver with the default bound: outside tester, Python round 10).
    BigInt(String),
    /// `float`.
    Float(f64),
    /// `str`.
    Str(String),
    /// `bytes`.
    Bytes(Vec<u8>),
    /// `list`.
    List(#[serde(deserialize_with = "nested")] Vec<Value>),
    /// `tuple`.
    Tuple(#[serde(deserialize_with = "nested")] Vec<Value>),
    /// `dict`, in insertion order.
    Dict(#[serde(deserialize_with = "nested")] Vec<(Value, Value)>),
    /// An array and the framework it came from.
    Array(Tensor, Framework),
}

thread_local! {
    /// How many containers the message being decoded on this thread has open.
    static DECODING_DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Decodes a container's items, refusing a message that nests deeper than a sender may send
/// ([`MAX_DEPTH`] levels below its root): a hostile peer's very deep message is a decode error
/// (the receiver refuses that message), not a stack overflow.
fn nested<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<T, D::Error> {
    struct Level;
    impl Drop for Level {
        fn drop(&mut self) {
            DECODING_DEPTH.with(|depth| depth.set(depth.get() - 1));
        }
    }
    let depth = DECODING_DEPTH.with(|depth| {
        depth.set(depth.get() + 1);
        depth.get()
    });
    let _level = Level;
    // The root container is level 1 and its items sit at path length 1: a sender refuses any
    // value at a path longer than MAX_DEPTH, so no container it sends is deeper than MAX_DEPTH + 1.
    if depth > MAX_DEPTH + 1 {
        return Err(serde::de::Error::custom(format!(
            "a message nests deeper than {MAX_DEPTH} levels (a sender refuses those)"
        )));
    }
    T::deserialize(deserializer)
}

/// The framework an array left, so that it comes back as the same.
#[derive(Serialize, Deserialize, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Framework {
    /// `numpy.ndarray`.
    Numpy,
    /// A NumPy scalar (`numpy.float32(1.5)`).
    NumpyScalar,
    /// `torch.Tensor`.
    Torch,
    /// Any other DLPack object: it arrives as a `tensor_queue.Array`.
    Other,
}

/// One step of the way from the message's root to a value, for error messages.
enum Step<'py> {
    Key(Bound<'py, PyAny>),
    Index(usize),
}

/// Where a value sits, as Python would write it: `msg["box"][1]`.
fn where_(path: &[Step<'_>]) -> String {
    let mut text = String::from("msg");
    for step in path {
        match step {
            Step::Index(i) => text.push_str(&format!("[{i}]")),
            Step::Key(key) => match key.cast::<PyString>() {
                Ok(s) => text.push_str(&format!("[{:?}]", s.to_string_lossy())),
                Err(_) => text.push_str(&format!("[{}]", key.repr().map(|r| r.to_string()).unwrap_or_default())),
            },
        }
    }
    text
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    let class = value.get_type();
    let module = class.module().map(|m| m.to_string()).unwrap_or_default();
    let name = class.qualname().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    if module == "builtins" { name } else { format!("{module}.{name}") }
}

/// Encodes a Python message; `order` gathers what its GPU arrays' copies need.
pub fn encode(message: &Bound<'_, PyAny>, order: &mut SendOrder) -> PyResult<Value> {
    let mut path = Vec::new();
    let encoded = encode_at(message, &mut path, false, order);
    let finished = order.finish().map_err(|e| raise("TensorQueueError", e));
    let encoded = encoded?;
    finished?;
    Ok(encoded)
}

fn not_sendable(path: &[Step<'_>], why: impl std::fmt::Display) -> PyErr {
    raise("NotSendable", format!("{} {why}", where_(path)))
}

fn encode_at<'py>(
    value: &Bound<'py, PyAny>,
    path: &mut Vec<Step<'py>>,
    key: bool,
    order: &mut SendOrder,
) -> PyResult<Value> {
    if path.len() > MAX_DEPTH {
        return Err(not_sendable(path, format!("nests deeper than {MAX_DEPTH} levels (or refers to itself)")));
    }
    if value.is_none() {
        return Ok(Value::None);
    }
    if let Ok(b) = value.cast_exact::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if value.is_exact_instance_of::<PyInt>() {
        return Ok(match value.extract::<i64>() {
            Ok(i) => Value::Int(i),
            Err(_) => Value::BigInt(value.call_method1("__format__", ("#x",))?.extract()?),
        });
    }
    if value.is_exact_instance_of::<PyFloat>() {
        return Ok(Value::Float(value.extract::<f64>()?));
    }
    if let Ok(s) = value.cast_exact::<PyString>() {
        // A str with a lone surrogate has no UTF-8 form (`"\ud800"`): not sendable, said where.
        let text =
            s.to_str().map_err(|_| not_sendable(path, "is a str with a lone surrogate, which has no UTF-8 form"))?;
        return Ok(Value::Str(text.to_owned()));
    }
    if let Ok(b) = value.cast_exact::<PyBytes>() {
        return Ok(Value::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(tuple) = value.cast_exact::<PyTuple>() {
        let mut items = Vec::with_capacity(tuple.len());
        for (i, item) in tuple.iter().enumerate() {
            path.push(Step::Index(i));
            items.push(encode_at(&item, path, key, order)?);
            path.pop();
        }
        return Ok(Value::Tuple(items));
    }
    if key {
        return Err(not_sendable(
            path,
            format!(
                "is a dict key of type {}: keys may be None, bool, int, float, str, bytes or tuples of them",
                type_name(value)
            ),
        ));
    }
    if let Ok(list) = value.cast_exact::<PyList>() {
        let mut items = Vec::with_capacity(list.len());
        for (i, item) in list.iter().enumerate() {
            path.push(Step::Index(i));
            items.push(encode_at(&item, path, false, order)?);
            path.pop();
        }
        return Ok(Value::List(items));
    }
    if let Ok(dict) = value.cast_exact::<PyDict>() {
        let mut items = Vec::with_capacity(dict.len());
        for (k, v) in dict.iter() {
            path.push(Step::Key(k.clone()));
            let encoded_key = encode_at(&k, path, true, order)?;
            let encoded_value = encode_at(&v, path, false, order)?;
            path.pop();
            items.push((encoded_key, encoded_value));
        }
        return Ok(Value::Dict(items));
    }
    match dlpack::import(value, order) {
        Ok(Some((tensor, framework))) => Ok(Value::Array(tensor, framework)),
        Ok(None) => Err(not_sendable(
            path,
            format!(
                "is a {}, which a message cannot carry (only None, bool, int, float, str, bytes, list, tuple, \
                 dict and arrays: NumPy, torch or any DLPack object; nothing is pickled)",
                type_name(value)
            ),
        )),
        Err(dlpack::ImportError::Python(error)) => Err(error),
        Err(dlpack::ImportError::Refused(why)) => Err(not_sendable(path, why)),
        Err(dlpack::ImportError::Failed(error)) => Err(crate::errors::to_py(error)),
    }
}

/// Decodes a received message into Python objects. A message that cannot be made into them (a
/// peer's `int` text that is no number, a dict key that is no key) raises `Rejected`, as a message
/// refused alone; the next `recv` goes on.
pub fn decode<'py>(py: Python<'py>, value: Value) -> PyResult<Bound<'py, PyAny>> {
    decode_at(py, value, &mut Vec::new()).map_err(|error| {
        if crate::errors::is_ours(py, &error)
            || !(error.is_instance_of::<PyValueError>(py) || error.is_instance_of::<PyTypeError>(py))
        {
            return error;
        }
        raise("Rejected", format!("a received message could not be made into Python objects: {error}"))
    })
}

/// `ordered`: the stream waits queued so far for this message's CUDA tensors.
fn decode_at<'py>(py: Python<'py>, value: Value, ordered: &mut Vec<(usize, usize)>) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::None => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, b).to_owned().into_any(),
        Value::Int(i) => i.into_pyobject(py)?.into_any(),
        Value::BigInt(text) => py.get_type::<PyInt>().call1((text, 0))?,
        Value::Float(f) => PyFloat::new(py, f).into_any(),
        Value::Str(s) => PyString::new(py, &s).into_any(),
        Value::Bytes(b) => PyBytes::new(py, &b).into_any(),
        Value::List(items) => {
            let items = items.into_iter().map(|v| decode_at(py, v, ordered)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Tuple(items) => {
            let items = items.into_iter().map(|v| decode_at(py, v, ordered)).collect::<PyResult<Vec<_>>>()?;
            PyTuple::new(py, items)?.into_any()
        }
        Value::Dict(items) => {
            let dict = PyDict::new(py);
            for (k, v) in items {
                dict.set_item(decode_at(py, k, ordered)?, decode_at(py, v, ordered)?)?;
            }
            dict.into_any()
        }
        Value::Array(tensor, framework) => dlpack::export(py, tensor, framework, ordered)?,
    })
}

/// How many arrays a message holds.
pub fn count_arrays(value: &Value) -> u64 {
    match value {
        Value::Array(..) => 1,
        Value::List(items) | Value::Tuple(items) => items.iter().map(count_arrays).sum(),
        Value::Dict(items) => items.iter().map(|(k, v)| count_arrays(k) + count_arrays(v)).sum(),
        _ => 0,
    }
}
