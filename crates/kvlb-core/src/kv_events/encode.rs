//! msgpack encoding of KV event batches exactly as vLLM 0.33 writes them (msgspec with
//! `omit_defaults`, which leaves out only the fields that have a default): the batch is always
//! the positional `[ts, events, dp_rank]`; events are maps tagged by "type" holding every field
//! of vLLM's classes that has no default, nil or not (`parent_block_hash`, `lora_id`, `medium`,
//! `lora_name`), byte for byte as msgspec writes them; or positional arrays with the tag first
//! (older engines); or `MapNil`'s maps (the same keys in the smallest map headers).
//! `KvEvent::Undecodable` is not written.

#![forbid(unsafe_code)]
#![warn(clippy::disallowed_methods, clippy::disallowed_types)]

use super::{EventFormat, KvEvent, KvEventBatch};
use rmp::encode as mp;

/// The msgpack payload of one batch (the third frame of a KV event message).
pub fn encode_batch(batch: &KvEventBatch, format: EventFormat) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + batch.events.len() * 64);
    write_batch(&mut out, batch, format);
    out
}

// Writing msgpack into a Vec cannot fail: the only errors rmp reports come from the writer, and
// Vec's is infallible. Lengths are u32 on the wire; a batch with more than 4 G elements in one
// list is a broken invariant of the caller.
fn len32(n: usize) -> u32 {
    u32::try_from(n).expect("msgpack list longer than u32::MAX")
}

fn write_batch(out: &mut Vec<u8>, batch: &KvEventBatch, format: EventFormat) {
    let _ = mp::write_array_len(out, 3);
    let _ = mp::write_f64(out, batch.ts);
    let written = |e: &&KvEvent| !matches!(e, KvEvent::Undecodable(_));
    let _ = mp::write_array_len(out, len32(batch.events.iter().filter(written).count()));
    for event in batch.events.iter().filter(written) {
        match format {
            EventFormat::Map => write_event_map(out, event, true),
            EventFormat::MapNil => write_event_map(out, event, false),
            EventFormat::Array => write_event_array(out, event),
        }
    }
    write_opt_int(out, batch.dp_rank);
}

fn write_opt_int(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => {
            let _ = mp::write_sint(out, v);
        }
        None => {
            let _ = mp::write_nil(out);
        }
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    let _ = mp::write_array_len(out, len32(hashes.len()));
    for &h in hashes {
        let _ = mp::write_uint(out, h);
    }
}

fn write_tokens(out: &mut Vec<u8>, tokens: &[u32]) {
    let _ = mp::write_array_len(out, len32(tokens.len()));
    for &t in tokens {
        let _ = mp::write_uint(out, t as u64);
    }
}

fn write_key(out: &mut Vec<u8>, key: &str) {
    let _ = mp::write_str(out, key);
}

/// `msgspec_header`: BlockStored's map header as msgspec writes it for vLLM's class (16 bits:
/// it sizes the header for the class's 16 fields, of which 8 are written); otherwise the
/// smallest header (`MapNil`).
fn write_event_map(out: &mut Vec<u8>, event: &KvEvent, msgspec_header: bool) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            key,
        } => {
            // vLLM's extra_keys (a default of None, so written only when set): per block the
            // adapter name, and on a prompt's block 0 the salt after it.
            let salted = key
                .cache_salt
                .as_ref()
                .filter(|_| parent_block_hash.is_none());
            let extra = key.lora_name.is_some() || salted.is_some();
            let fields = if extra { 9 } else { 8 };
            if msgspec_header {
                out.extend_from_slice(&[0xde, 0, fields]);
            } else {
                let _ = mp::write_map_len(out, fields as u32);
            }
            write_key(out, "type");
            write_key(out, "BlockStored");
            write_key(out, "block_hashes");
            write_hashes(out, block_hashes);
            write_key(out, "parent_block_hash");
            match parent_block_hash {
                Some(parent) => {
                    let _ = mp::write_uint(out, *parent);
                }
                None => {
                    let _ = mp::write_nil(out);
                }
            }
            write_key(out, "token_ids");
            write_tokens(out, token_ids);
            write_key(out, "block_size");
            let _ = mp::write_uint(out, *block_size as u64);
            write_key(out, "lora_id");
            write_opt_int(out, *lora_id);
            write_key(out, "medium");
            write_opt_medium(out, medium);
            write_key(out, "lora_name");
            write_opt_str(out, key.lora_name.as_deref());
            if extra {
                write_key(out, "extra_keys");
                let _ = mp::write_array_len(out, block_hashes.len() as u32);
                for i in 0..block_hashes.len() {
                    let salt = salted.filter(|_| i == 0);
                    let n = key.lora_name.is_some() as u32 + salt.is_some() as u32;
                    if n == 0 {
                        let _ = mp::write_nil(out);
                        continue;
                    }
                    let _ = mp::write_array_len(out, n);
                    for s in key.lora_name.iter().chain(salt) {
                        let _ = mp::write_str(out, s);
                    }
                }
            }
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => {
            let _ = mp::write_map_len(out, 3);
            write_key(out, "type");
            write_key(out, "BlockRemoved");
            write_key(out, "block_hashes");
            write_hashes(out, block_hashes);
            write_key(out, "medium");
            write_opt_medium(out, medium);
        }
        KvEvent::AllBlocksCleared => {
            let _ = mp::write_map_len(out, 1);
            write_key(out, "type");
            write_key(out, "AllBlocksCleared");
        }
        KvEvent::Undecodable(_) => {}
    }
}

fn write_opt_str(out: &mut Vec<u8>, v: Option<&str>) {
    match v {
        Some(s) => {
            let _ = mp::write_str(out, s);
        }
        None => {
            let _ = mp::write_nil(out);
        }
    }
}

fn write_opt_medium(out: &mut Vec<u8>, medium: &Option<super::Medium>) {
    match medium {
        Some(m) => write_key(out, m.as_str()),
        None => {
            let _ = mp::write_nil(out);
        }
    }
}

fn write_event_array(out: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            key,
        } => {
            let _ = mp::write_array_len(out, 8);
            write_key(out, "BlockStored");
            write_hashes(out, block_hashes);
            match parent_block_hash {
                Some(p) => {
                    let _ = mp::write_uint(out, *p);
                }
                None => {
                    let _ = mp::write_nil(out);
                }
            }
            write_tokens(out, token_ids);
            let _ = mp::write_uint(out, *block_size as u64);
            write_opt_int(out, *lora_id);
            write_opt_medium(out, medium);
            write_opt_str(out, key.lora_name.as_deref());
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
        } => {
            let _ = mp::write_array_len(out, 3);
            write_key(out, "BlockRemoved");
            write_hashes(out, block_hashes);
            write_opt_medium(out, medium);
        }
        KvEvent::AllBlocksCleared => {
            let _ = mp::write_array_len(out, 1);
            write_key(out, "AllBlocksCleared");
        }
        KvEvent::Undecodable(_) => {}
    }
}
