//! Publishes KV event batches exactly as a vLLM engine does: a ZeroMQ PUB socket (three frames:
//! topic, u64 big-endian sequence, msgpack batch) and an optional replay ROUTER socket.

use super::{EventFormat, KvEventBatch};
use std::net::SocketAddr;

pub struct KvEventPublisher {}

impl KvEventPublisher {
    /// Bind the PUB socket at `pub_addr` ("tcp://127.0.0.1:0" style) and, if given, the replay
    /// ROUTER socket; background threads serve subscribers.
    pub fn bind(
        _pub_addr: &str,
        _replay_addr: Option<&str>,
        _topic: &str,
        _format: EventFormat,
    ) -> std::io::Result<KvEventPublisher> {
        todo!()
    }

    /// The bound addresses (PUB, replay).
    pub fn local_addrs(&self) -> (SocketAddr, Option<SocketAddr>) {
        todo!()
    }

    /// Encode, number and send one batch to every subscriber; keep it for replay. Never blocks
    /// on a slow subscriber.
    pub fn publish(&self, _batch: &KvEventBatch) {
        todo!()
    }
}
