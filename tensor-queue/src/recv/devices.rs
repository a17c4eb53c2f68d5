//! The receiver's devices: the contexts received tensors live on, the streams the user chose for
//! them, where they should land, and the NCCL workers of senders on other hosts.

use std::sync::Arc;

use ipc_core::{Context, Device, Stream, Uuid};

use crate::error::Result;
use crate::links::nccl::Workers;
use crate::links::wake::Wake;
use crate::route::Routing;
use crate::sync::lock;

/// The contexts of the devices received tensors live on, the streams the user chose for them,
/// and where they should land.
pub(crate) struct Devices {
    pub routing: Routing,
    contexts: std::sync::Mutex<Vec<(Uuid, Arc<Context>)>>,
    /// Streams set with `Receiver::set_stream`: every connection orders that device's tensors
    /// on it (and so one slow producer delays the others there, the user's choice).
    chosen: std::sync::Mutex<Vec<(Uuid, Arc<Stream>)>>,
    /// The workers of the NCCL communicators joined for senders on other hosts (`remote.rs`),
    /// waited for when the receiver is dropped.
    pub nccl_workers: Workers,
    /// How those workers tell `recv` that a parked message's receives are issued.
    pub nccl_wake: Wake,
}

impl Devices {
    pub fn new(routing: Routing) -> Result<Devices> {
        Ok(Devices {
            routing,
            contexts: Default::default(),
            chosen: Default::default(),
            nccl_workers: Workers::default(),
            nccl_wake: Wake::new()?,
        })
    }

    pub fn context(&self, uuid: &Uuid) -> Result<Arc<Context>> {
        let mut contexts = lock(&self.contexts);
        if let Some((_, context)) = contexts.iter().find(|(u, _)| u == uuid) {
            return Ok(context.clone());
        }
        let context = Context::primary(Device::by_uuid(uuid)?)?;
        contexts.push((*uuid, context.clone()));
        Ok(context)
    }

    pub fn choose(&self, stream: Arc<Stream>) -> Result<()> {
        let uuid = stream.context().device().uuid()?;
        let mut chosen = lock(&self.chosen);
        chosen.retain(|(u, _)| *u != uuid);
        chosen.push((uuid, stream));
        Ok(())
    }

    pub fn chosen(&self, uuid: &Uuid) -> Option<Arc<Stream>> {
        lock(&self.chosen).iter().find(|(u, _)| u == uuid).map(|(_, s)| s.clone())
    }
}
