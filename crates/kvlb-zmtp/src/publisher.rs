//! Publishes KV event batches exactly as a vLLM engine does: a ZeroMQ PUB socket (three frames:
//! topic, u64 big-endian sequence, msgpack batch) and an optional replay ROUTER socket that
//! resends the last 10,000 batches from a requested sequence number on (vLLM 0.33 layout).
//! Also the balancer's side of replay, `replay`, which reads both the vLLM 0.33 / SGLang layout
//! and the older vLLM one.

#![forbid(unsafe_code)]

use crate::{DealerClient, Message, PubServer, RouterServer};
use kvlb_core::kv_events::{decode_batch, encode_batch, EventFormat, KvEventBatch};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Batches an engine keeps for replay.
pub const REPLAY_KEEP: usize = 10_000;

/// The sequence number that ends a replay: 0xFFFFFFFFFFFFFFFF (vLLM 0.33, SGLang), which is also
/// the bit pattern of the -1 older vLLM sends as a signed int.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

pub struct KvEventPublisher {
    pub_server: PubServer,
    replay_server: Option<RouterServer>,
    history: Arc<Mutex<History>>,
    topic: Vec<u8>,
    format: EventFormat,
}

/// The sequence counter and the batches kept for replay, under one lock so that the wire order,
/// the numbering and the replay order agree.
struct History {
    next_seq: u64,
    kept: VecDeque<(u64, Arc<Vec<u8>>)>,
}

impl KvEventPublisher {
    /// Bind the PUB socket at `pub_addr` ("tcp://127.0.0.1:0" style) and, if given, the replay
    /// ROUTER socket; background threads serve subscribers.
    pub fn bind(
        pub_addr: &str,
        replay_addr: Option<&str>,
        topic: &str,
        format: EventFormat,
    ) -> std::io::Result<KvEventPublisher> {
        let pub_server = PubServer::bind(pub_addr)?;
        let history = Arc::new(Mutex::new(History {
            next_seq: 0,
            kept: VecDeque::new(),
        }));
        let replay_server = match replay_addr {
            Some(addr) => {
                let history = history.clone();
                let topic = topic.as_bytes().to_vec();
                Some(RouterServer::bind(addr, move |request: &[Vec<u8>]| {
                    let history = history.lock().unwrap_or_else(|e| e.into_inner());
                    replay_replies(&history, &topic, request)
                })?)
            }
            None => None,
        };
        Ok(KvEventPublisher {
            pub_server,
            replay_server,
            history,
            topic: topic.as_bytes().to_vec(),
            format,
        })
    }

    /// The bound addresses (PUB, replay).
    pub fn local_addrs(&self) -> (SocketAddr, Option<SocketAddr>) {
        (
            self.pub_server.local_addr(),
            self.replay_server.as_ref().map(|r| r.local_addr()),
        )
    }

    /// Encode, number and send one batch to every subscriber; keep it for replay. Never blocks
    /// on a slow subscriber.
    pub fn publish(&self, batch: &KvEventBatch) {
        let payload = Arc::new(encode_batch(batch, self.format));
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let seq = history.next_seq;
        history.next_seq += 1;
        self.pub_server
            .send(&[&self.topic, &seq.to_be_bytes(), &payload]);
        history.kept.push_back((seq, payload));
        if history.kept.len() > REPLAY_KEEP {
            history.kept.pop_front();
        }
    }

    /// The sequence number the next batch will carry (batches published so far).
    pub fn next_seq(&self) -> u64 {
        self.history
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .next_seq
    }

    /// Connected subscribers with at least one subscription; a publisher that wants its first
    /// batch seen waits for this (ZeroMQ drops what is published before a subscription lands).
    pub fn subscribed_peers(&self) -> usize {
        self.pub_server.subscribed_peers()
    }

    /// Messages lost because a subscriber was too slow.
    pub fn dropped_messages(&self) -> u64 {
        self.pub_server.dropped_messages()
    }
}

/// Answer `["", start_seq u64 BE]` with `["", topic, seq, payload]` per kept batch from
/// `start_seq` on, then `["", "", 0xFFFFFFFFFFFFFFFF, ""]`. A malformed request gets only the
/// end marker, so the asker does not wait for its timeout.
fn replay_replies(history: &History, topic: &[u8], request: &[Vec<u8>]) -> Vec<Message> {
    let start = match request.last() {
        Some(f) if f.len() == 8 => {
            let mut b = [0u8; 8];
            b.copy_from_slice(f);
            Some(u64::from_be_bytes(b))
        }
        _ => None,
    };
    let mut replies = Vec::new();
    if let Some(start) = start {
        for (seq, payload) in history.kept.iter().filter(|(seq, _)| *seq >= start) {
            replies.push(vec![
                Vec::new(),
                topic.to_vec(),
                seq.to_be_bytes().to_vec(),
                payload.to_vec(),
            ]);
        }
    }
    replies.push(vec![
        Vec::new(),
        Vec::new(),
        REPLAY_END_SEQ.to_be_bytes().to_vec(),
        Vec::new(),
    ]);
    replies
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Ask the replay endpoint of an engine (`tcp://host:port`) for every batch it kept from
/// `start_seq` on, within `timeout` overall. Accepts the vLLM 0.33 / SGLang reply layout
/// (`["", topic, seq, payload]`, ended by seq 0xFFFFFFFFFFFFFFFF) and the older vLLM one
/// (`["", seq, payload]`, ended by seq -1). Returns the batches with their sequence numbers.
pub fn replay(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> io::Result<Vec<(u64, KvEventBatch)>> {
    let deadline = Instant::now() + timeout;
    let mut dealer = DealerClient::connect(endpoint, timeout)?;
    dealer.send(&[b"", &start_seq.to_be_bytes()])?;
    let mut batches = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(reply) = dealer.recv(left)? else {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "replay from {endpoint}: no end marker within {timeout:?} ({} batches so far)",
                    batches.len()
                ),
            ));
        };
        let (seq, payload) = match reply.as_slice() {
            [delimiter, _topic, seq, payload] if delimiter.is_empty() => (seq, payload),
            [delimiter, seq, payload] if delimiter.is_empty() => (seq, payload),
            [seq, payload] => (seq, payload),
            _ => {
                return Err(invalid(format!(
                    "replay from {endpoint}: reply of {} frames, want [\"\", topic, seq, payload] \
                     or [\"\", seq, payload]",
                    reply.len()
                )))
            }
        };
        let seq: [u8; 8] = seq.as_slice().try_into().map_err(|_| {
            invalid(format!(
                "replay from {endpoint}: sequence frame of {} bytes, want 8",
                seq.len()
            ))
        })?;
        let seq = u64::from_be_bytes(seq);
        if seq == REPLAY_END_SEQ {
            return Ok(batches);
        }
        let batch = decode_batch(payload)
            .map_err(|e| invalid(format!("replay from {endpoint}: batch {seq}: {e}")))?;
        batches.push((seq, batch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SubClient;
    use kvlb_core::kv_events::{KvEvent, Medium};

    const T: Duration = Duration::from_secs(5);

    fn batch(i: u64) -> KvEventBatch {
        KvEventBatch {
            ts: 1_700_000_000.0 + i as f64,
            events: vec![KvEvent::BlockRemoved {
                block_hashes: vec![i],
                medium: Some(Medium::Gpu),
            }],
            dp_rank: None,
        }
    }

    #[test]
    fn publishes_numbered_batches_and_replays_them() {
        let publisher = KvEventPublisher::bind(
            "tcp://127.0.0.1:0",
            Some("tcp://127.0.0.1:0"),
            "kv@pod@model",
            EventFormat::Map,
        )
        .unwrap();
        let (pub_addr, replay_addr) = publisher.local_addrs();
        let mut sub = SubClient::connect(&format!("tcp://{pub_addr}"), T).unwrap();
        sub.subscribe(b"kv@").unwrap();
        let deadline = Instant::now() + T;
        while publisher.subscribed_peers() == 0 {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(5));
        }
        for i in 0..5 {
            publisher.publish(&batch(i));
        }
        for i in 0..5u64 {
            let m = sub.recv(T).unwrap().unwrap();
            assert_eq!(m.len(), 3);
            assert_eq!(m[0], b"kv@pod@model");
            assert_eq!(m[1], i.to_be_bytes());
            assert_eq!(decode_batch(&m[2]).unwrap(), batch(i));
        }
        let endpoint = format!("tcp://{}", replay_addr.unwrap());
        let got = replay(&endpoint, 2, T).unwrap();
        assert_eq!(got, (2..5).map(|i| (i, batch(i))).collect::<Vec<_>>());
        assert!(replay(&endpoint, 99, T).unwrap().is_empty());
        assert_eq!(publisher.next_seq(), 5);
    }

    #[test]
    fn keeps_only_the_last_batches() {
        let publisher =
            KvEventPublisher::bind("tcp://127.0.0.1:0", None, "t", EventFormat::Array).unwrap();
        for seq in 0..(REPLAY_KEEP as u64 + 5) {
            publisher.publish(&batch(seq));
        }
        let history = publisher.history.lock().unwrap();
        let replies = replay_replies(&history, b"t", &[Vec::new(), 0u64.to_be_bytes().to_vec()]);
        assert_eq!(replies.len(), REPLAY_KEEP + 1);
        assert_eq!(replies[0][2], 5u64.to_be_bytes());
        assert_eq!(replies[REPLAY_KEEP][2], u64::MAX.to_be_bytes());
        // Garbage gets just the end marker.
        assert_eq!(replay_replies(&history, b"t", &[b"junk".to_vec()]).len(), 1);
    }
}
