//! Tensors anywhere inside a serde message: while a message is encoded, each `Tensor` it meets is
//! set aside in a table and written as its index; while decoding, the index is replaced by the
//! received tensor. This is how ipc-channel carries operating-system handles.
//!
//! A received message's tensors are made only here, each when the message's serde code names
//! it, straight from its row of the descriptor table ([`Received`]): no tensor is made, moved or
//! kept in a vector of its own before the message holds it.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use ipc_core::Stream;
use serde::de::{DeserializeOwned, Error as _};
use serde::ser::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::nesting::{self, Failed};
use crate::tensor::{Storage, Tensor, TransferPath};
use crate::wire::Descriptors;

thread_local! {
    static OUTGOING: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
    static INCOMING: RefCell<Option<Incoming>> = const { RefCell::new(None) };
    /// How many tensors this thread's last encoded message held (see [`encode`]).
    static LAST_COUNT: Cell<usize> = const { Cell::new(0) };
    /// A sent message's table, emptied, for the next message this thread encodes ([`recycle`]).
    static SPARE: RefCell<Vec<Tensor>> = const { RefCell::new(Vec::new()) };
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

/// The most tensors [`encode`] makes room for before it meets them, and that a recycled table
/// keeps room for (about 450 KiB).
const MAX_ROOM: usize = 4096;

/// The serde bytes of `message` and the tensors it holds, in the order the bytes refer to them.
pub(crate) fn encode<T: Serialize>(message: &T) -> Result<(Vec<u8>, Vec<Tensor>)> {
    // Room for as many tensors as this thread's last message had: messages of one type
    // repeat, and a table grown tensor by tensor copies itself ten times for 1,024 tensors.
    let room = LAST_COUNT.with(Cell::get);
    let mut table = SPARE.with(|spare| std::mem::take(&mut *spare.borrow_mut()));
    table.reserve(room);
    OUTGOING.with(|outgoing| *outgoing.borrow_mut() = Some(table));
    let _reset = Reset(&OUTGOING);
    REFUSAL.with(|refusal| refusal.borrow_mut().take());
    // The frame's size is checked when it is sent.
    let bytes = nesting::to_stdvec(message).map_err(|failed| match failed {
        Failed::Postcard(e) => Error::Encode(refusal_text(e, "Serialize")),
        too_deep => Error::Encode(format!("{too_deep} (a receiver refuses those)")),
    })?;
    let tensors = OUTGOING.with(|table| table.borrow_mut().take()).unwrap_or_default();
    LAST_COUNT.with(|last| last.set(tensors.len().min(MAX_ROOM)));
    Ok((bytes, tensors))
}

/// Where a received message's storage record's tensors are: the storage the receiver made for
/// the record, where their view offsets count from in it, the path it came by and the stream
/// their first use is ordered on.
#[derive(Clone)]
pub(crate) struct Record {
    pub storage: Arc<Storage>,
    pub base: usize,
    pub path: TransferPath,
    pub stream: Option<Arc<Stream>>,
}

/// A received message's tensors, not made yet: its checked descriptor table and one placed
/// [`Record`] per storage record. Tensor `i` is made when the message's serde code names it, a
/// view of its record's storage: what it costs is what the tensor holds (its storage's and
/// stream's counts, its inline shape and strides), and nothing else per tensor.
#[derive(Clone, Default)]
pub(crate) struct Received {
    table: Descriptors,
    records: Vec<Record>,
}

impl Received {
    /// The tensors of `table`, a view of `records[r]` each for the `r` its row names (the frame's
    /// decoder checked that every row names a record of the table; each record is placed here).
    pub fn new(table: Descriptors, records: Vec<Record>) -> Result<Received> {
        if records.len() != table.storages().len() {
            return Err(Error::internal(format_args!(
                "{} storages placed for {} storage records",
                records.len(),
                table.storages().len()
            )));
        }
        Ok(Received { table, records })
    }

    /// A storage of the message, whose holder holds the message's lease on the sender's memory.
    pub fn hold(&self) -> Option<Arc<Storage>> {
        self.records.first().map(|record| record.storage.clone())
    }

    /// Tensor `index`, made now.
    fn tensor(&self, index: usize) -> Option<Tensor> {
        let desc = self.table.tensors().get(index)?;
        let record = self.records.get(desc.storage as usize)?;
        Some(Tensor::from_parts(
            record.storage.clone(),
            desc.dtype,
            self.table.shape(index),
            self.table.strides(index),
            record.base + desc.view_offset as usize,
            record.path,
            record.stream.clone(),
        ))
    }
}

/// What a decoding message's tensors are taken from.
pub(crate) enum Incoming {
    /// Tensors made already (tests, the in-process floor of `testing::serde_floor`).
    Made(Vec<Option<Tensor>>),
    /// A received message's table, and which of its tensors were taken (a bit each).
    Received(Received, Vec<u64>),
    /// The in-process floor's ([`serde_floor`]): tensors made again as views of `storages`
    /// (tensor `i` of `storages[which[i]]`, with `of[i]`'s layout), and which were taken.
    Views { of: Vec<Tensor>, storages: Vec<Arc<Storage>>, which: Vec<u32>, taken: Vec<u64> },
}

impl From<Vec<Tensor>> for Incoming {
    fn from(tensors: Vec<Tensor>) -> Incoming {
        Incoming::Made(tensors.into_iter().map(Some).collect())
    }
}

impl From<Received> for Incoming {
    fn from(received: Received) -> Incoming {
        let words = received.table.len().div_ceil(64);
        Incoming::Received(received, vec![0; words])
    }
}

impl Incoming {
    /// Tensor `index`, which the message names once at most.
    fn take(&mut self, index: usize) -> std::result::Result<Tensor, Refusal> {
        match self {
            Incoming::Made(tensors) => match tensors.get_mut(index) {
                None => Err(Refusal::NotCarried(index)),
                Some(slot) => slot.take().ok_or(Refusal::NamedTwice(index)),
            },
            Incoming::Received(received, taken) => {
                claim(taken, index, received.table.len())?;
                received.tensor(index).ok_or(Refusal::NotCarried(index))
            }
            Incoming::Views { of, storages, which, taken } => {
                claim(taken, index, of.len())?;
                let tensor = &of[index]; // claimed: below `of.len()`
                let storage = &storages[which[index] as usize]; // one per tensor, made by `serde_floor`
                Ok(Tensor::from_parts(
                    storage.clone(),
                    tensor.dtype(),
                    tensor.shape(),
                    tensor.strides(),
                    tensor.storage.offset + tensor.offset(),
                    TransferPath::Local,
                    None,
                ))
            }
        }
    }
}

/// Why a received message's tensor could not be taken: a value, made into text only when raised
/// (taking a tensor is the per-tensor step of every received message).
#[derive(Clone, Copy)]
enum Refusal {
    NoTable,
    NotCarried(usize),
    NamedTwice(usize),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NoTable => write!(f, "a Tensor can only be deserialized by a tensor-queue Receiver"),
            Refusal::NotCarried(index) => write!(f, "the message names tensor {index}, which it does not carry"),
            Refusal::NamedTwice(index) => write!(f, "the message names tensor {index} twice"),
        }
    }
}

/// Claims tensor `index` of `len`, whose bits of `taken` say which were claimed already.
fn claim(taken: &mut [u64], index: usize, len: usize) -> std::result::Result<(), Refusal> {
    let word = taken.get_mut(index / 64).filter(|_| index < len).ok_or(Refusal::NotCarried(index))?;
    let bit = 1u64 << (index % 64);
    if *word & bit != 0 {
        return Err(Refusal::NamedTwice(index));
    }
    *word |= bit;
    Ok(())
}

/// Keeps `table`, a sent message's tensors, emptied, for this thread's next [`encode`]: a big
/// message's table is allocated once, not per message (freeing 100 KiB per message makes the
/// allocator give memory back to the kernel and fault it in again). Tables of more than
/// [`MAX_ROOM`] tensors are freed.
pub(crate) fn recycle(mut table: Vec<Tensor>) {
    table.clear();
    if table.capacity() > 0 && table.capacity() <= MAX_ROOM {
        // A thread gone (its locals dropped) frees the table instead.
        let _ = SPARE.try_with(|spare| {
            if let Ok(mut spare) = spare.try_borrow_mut()
                && spare.capacity() < table.capacity()
            {
                *spare = table;
            }
        });
    }
}

/// The message in `bytes`, with `tensors` put back in place. Tensors the message does not claim
/// are dropped, or never made (and so released).
pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], tensors: impl Into<Incoming>) -> Result<T> {
    let tensors = tensors.into();
    INCOMING.with(|table| *table.borrow_mut() = Some(tensors));
    REFUSAL.with(|refusal| refusal.borrow_mut().take());
    let result = match nesting::take_from_bytes(bytes) {
        Ok((message, [])) => Ok(message),
        Ok((_, rest)) => Err(Error::Decode(format!("{} bytes follow the message", rest.len()))),
        Err(Failed::Postcard(e)) => Err(Error::Decode(refusal_text(e, "Deserialize"))),
        Err(too_deep) => Err(Error::Decode(too_deep.to_string())),
    };
    INCOMING.with(|table| table.borrow_mut().take());
    result
}

/// The least a message's tensors can cost in one process with no channel: `message` encoded
/// (its tensors set aside), its tensors made again as views of one storage per chunk (as a
/// receiver makes one storage per record), and the message decoded with them. What a channel
/// costs above this is the channel's own.
///
/// ```
/// # fn main() -> tensor_queue::Result<()> {
/// use tensor_queue::{DType, Tensor, testing::serde_floor};
/// let tensors: Vec<Tensor> = (0..4u8).map(|i| Tensor::new(&[i; 8], &[8])).collect::<Result<_, _>>()?;
/// let again = serde_floor(&tensors)?;
/// assert_eq!(again[3].to_vec::<u8>()?, [3; 8]);
/// # let _ = DType::U8;
/// # Ok(()) }
/// ```
pub fn serde_floor<T: Serialize + DeserializeOwned>(message: &T) -> Result<T> {
    let (payload, tensors) = encode(message)?;
    let mut storages: Vec<Arc<Storage>> = Vec::new();
    let mut which = Vec::with_capacity(tensors.len());
    for tensor in &tensors {
        let chunk = &tensor.storage.chunk;
        if !storages.last().is_some_and(|storage| Arc::ptr_eq(&storage.chunk, chunk)) {
            storages.push(Arc::new(Storage::whole_chunk(chunk.clone())));
        }
        which.push(storages.len() as u32 - 1);
    }
    let taken = vec![0; tensors.len().div_ceil(64)];
    decode(&payload, Incoming::Views { of: tensors, storages, which, taken })
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
        let taken = INCOMING.with_borrow_mut(|table| table.as_mut().map_or(Err(Refusal::NoTable), |t| t.take(index)));
        taken.or_else(|refusal| refuse(refusal.to_string(), D::Error::custom))
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
    fn a_recycled_table_holds_no_tensor_and_the_floor_gives_views_of_the_same_bytes() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], DType::F32, &[2, 2]).unwrap();
        let message = vec![t.clone(), t.transpose(0, 1).unwrap()];
        let (_, tensors) = encode(&message).unwrap();
        assert_eq!(Arc::strong_count(&t.storage), 5);
        recycle(tensors);
        assert_eq!(Arc::strong_count(&t.storage), 3, "the recycled table let go of its tensors");
        let (_, again) = encode(&message).unwrap(); // made in the recycled table
        assert_eq!(again.len(), 2);
        let back = serde_floor(&message).unwrap();
        assert_eq!(back[1].to_vec::<f32>().unwrap(), [1.0, 3.0, 2.0, 4.0]);
        assert_eq!((back[1].shape(), back[1].strides()), (t.shape(), &[1i64, 2][..]));
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
mod received {
    use super::*;
    use crate::tensor::dtype::DType;
    use crate::wire::{Fence, Source, StorageDesc};

    /// A received message of `rows` (storage record, view offset, shape, strides) over two
    /// records, each a whole chunk of a local tensor's.
    fn received(base: &[Tensor; 2], rows: &[(u32, u64, &[u64], &[i64])]) -> Received {
        let mut table = Descriptors::default();
        let mut records = Vec::new();
        for tensor in base {
            let chunk = tensor.storage.chunk.clone();
            let len = chunk.len() as u64;
            table.push_storage(StorageDesc {
                source: Source::SameDevice { chunk: chunk.id, offset: 0 },
                len,
                fence: Fence::None,
            });
            let storage = Arc::new(Storage::whole_chunk(chunk));
            records.push(Record { storage, base: 0, path: TransferPath::HostSharedMemory, stream: None });
        }
        for &(record, view_offset, shape, strides) in rows {
            table.push_tensor(record, view_offset, DType::I32, shape, strides);
        }
        Received::new(table, records).unwrap()
    }

    #[test]
    fn tensors_are_made_from_their_rows_once_each() {
        let a = Tensor::from_slice(&[1i32, 2, 3, 4, 5, 6], DType::I32, &[2, 3]).unwrap();
        let b = Tensor::from_slice(&[7i32, 8], DType::I32, &[2]).unwrap();
        let (at_a, at_b) = (a.storage.offset as u64, b.storage.offset as u64);
        let rows: [(u32, u64, &[u64], &[i64]); 3] =
            [(0, at_a, &[3, 2], &[1, 3]), (1, at_b + 4, &[1], &[1]), (0, at_a + 8, &[2], &[3])];
        let base = [a, b];
        let (bytes, _) = encode(&(0u32, 1u32, 2u32)).unwrap();
        let (t, u, v): (Tensor, Tensor, Tensor) = decode(&bytes, received(&base, &rows)).unwrap();
        assert_eq!((t.shape(), t.strides()), (&[3u64, 2][..], &[1i64, 3][..]));
        assert_eq!(t.to_vec::<i32>().unwrap(), [1, 4, 2, 5, 3, 6], "the transposed view of record 0");
        assert_eq!(u.to_vec::<i32>().unwrap(), [8]);
        assert_eq!(v.to_vec::<i32>().unwrap(), [3, 6]);
        assert_eq!(t.path(), TransferPath::HostSharedMemory);
        assert!(Arc::ptr_eq(&t.storage, &v.storage), "one storage per record");

        // Named twice, or not carried: refused, never a panic.
        let (twice, _) = encode(&(2u32, 2u32)).unwrap();
        let refused = decode::<(Tensor, Tensor)>(&twice, received(&base, &rows));
        assert!(matches!(refused, Err(Error::Decode(m)) if m.contains("tensor 2 twice")));
        let (beyond, _) = encode(&(3u32,)).unwrap();
        let refused = decode::<(Tensor,)>(&beyond, received(&base, &rows));
        assert!(matches!(refused, Err(Error::Decode(m)) if m.contains("tensor 3, which it does not carry")));
        let (far, _) = encode(&(1u32 << 20,)).unwrap();
        assert!(decode::<(Tensor,)>(&far, received(&base, &rows)).is_err());

        // Tensors the message does not name are never made; their storage goes with the table.
        let (one, _) = encode(&(1u32,)).unwrap();
        let (u,): (Tensor,) = decode(&one, received(&base, &rows)).unwrap();
        assert_eq!(u.to_vec::<i32>().unwrap(), [8]);
        assert_eq!(Arc::strong_count(&u.storage), 1, "only the tensor made holds its record's storage");
    }

    #[test]
    fn records_must_match_the_table() {
        let mut table = Descriptors::default();
        table.push_storage(StorageDesc { source: Source::Bytes { offset: 0 }, len: 4, fence: Fence::None });
        assert!(Received::new(table, Vec::new()).is_err());
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
