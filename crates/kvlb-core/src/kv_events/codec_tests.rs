//! Encode/decode round trips in both formats, and hand-built messages for every variant engines
//! send (SGLang signed hashes, 32-byte digests, short old arrays, map batches, unknown keys).

#![forbid(unsafe_code)]

use super::*;
use rmp::encode as mp;

fn stored(hashes: Vec<u64>, parent: Option<u64>, block_size: u32) -> KvEvent {
    let n = hashes.len() as u32 * block_size;
    KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: parent,
        token_ids: (0..n).map(|t| t * 1000 + 7).collect(),
        block_size,
        lora_id: None,
        key: Default::default(),
        medium: Some(Medium::Gpu),
    }
}

fn sample_batch() -> KvEventBatch {
    KvEventBatch {
        ts: 1_764_000_000.125,
        events: vec![
            stored(vec![1, u64::MAX, 1 << 40], None, 16),
            KvEvent::BlockStored {
                block_hashes: vec![42],
                parent_block_hash: Some(0x8000_0000_0000_0001),
                token_ids: vec![150_000; 4],
                block_size: 4,
                lora_id: Some(-3),
                key: Default::default(),
                medium: Some(Medium::CpuPinned),
            },
            KvEvent::BlockStored {
                block_hashes: vec![],
                parent_block_hash: Some(5),
                token_ids: vec![],
                block_size: 16,
                lora_id: Some(7),
                key: Default::default(),
                medium: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![1, 2],
                medium: Some(Medium::Disk),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![3],
                medium: None,
            },
            KvEvent::AllBlocksCleared,
        ],
        dp_rank: Some(2),
    }
}

#[test]
fn round_trip_every_format() {
    for format in [EventFormat::Map, EventFormat::Array, EventFormat::MapNil] {
        let batch = sample_batch();
        assert_eq!(decode_batch(&encode_batch(&batch, format)).unwrap(), batch);
        let empty = KvEventBatch {
            ts: 0.0,
            events: vec![],
            dp_rank: None,
        };
        assert_eq!(decode_batch(&encode_batch(&empty, format)).unwrap(), empty);
    }
}

#[test]
fn map_nil_form_writes_every_key_with_nil_values() {
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![
            stored(vec![9], None, 1),
            KvEvent::BlockRemoved {
                block_hashes: vec![9],
                medium: None,
            },
        ],
        dp_rank: None,
    };
    let bytes = encode_batch(&batch, EventFormat::MapNil);
    let text = String::from_utf8_lossy(&bytes);
    for key in ["parent_block_hash", "lora_id", "lora_name", "medium"] {
        assert!(text.contains(key), "{key} missing");
    }
    // [ts, [stored, removed], nil]: the BlockStored map has all eight keys, parent nil.
    assert_eq!(&bytes[10..12], &[0x92, 0x88]);
    let key = b"parent_block_hash";
    let parent = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(bytes[parent], 0xc0, "parent_block_hash is nil");
    // BlockRemoved: type, block_hashes and medium (nil).
    assert!(bytes.windows(2).any(|w| w == [0x83, 0xa4]));
    assert_eq!(decode_batch(&bytes).unwrap(), batch);
}

#[test]
fn array_form_is_positional_with_eight_elements() {
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![stored(vec![9], None, 1)],
        dp_rank: None,
    };
    let bytes = encode_batch(&batch, EventFormat::Array);
    let mut expect = vec![0x93, 0xcb];
    expect.extend_from_slice(&1.0f64.to_bits().to_be_bytes());
    expect.extend_from_slice(&[0x91, 0x98]);
    expect.push(0xab);
    expect.extend_from_slice(b"BlockStored");
    expect.extend_from_slice(&[0x91, 9, 0xc0, 0x91, 7, 1, 0xc0, 0xa3]);
    expect.extend_from_slice(b"GPU");
    expect.extend_from_slice(&[0xc0, 0xc0]);
    assert_eq!(bytes, expect);
}

// Hand-built messages, written the way other engines write them.

fn key(out: &mut Vec<u8>, k: &str) {
    mp::write_str(out, k).unwrap();
}

fn batch_array(events: &[Vec<u8>], dp_rank: Option<i64>) -> Vec<u8> {
    let mut out = Vec::new();
    mp::write_array_len(&mut out, 3).unwrap();
    mp::write_f64(&mut out, 12.5).unwrap();
    mp::write_array_len(&mut out, events.len() as u32).unwrap();
    for e in events {
        out.extend_from_slice(e);
    }
    match dp_rank {
        Some(r) => {
            mp::write_sint(&mut out, r).unwrap();
        }
        None => mp::write_nil(&mut out).unwrap(),
    }
    out
}

fn tokens(out: &mut Vec<u8>, n: u32) {
    mp::write_array_len(out, n).unwrap();
    for t in 0..n {
        mp::write_uint(out, t as u64).unwrap();
    }
}

#[test]
fn sglang_signed_hashes_keep_their_bit_pattern() {
    let mut e = Vec::new();
    mp::write_map_len(&mut e, 6).unwrap();
    key(&mut e, "type");
    key(&mut e, "BlockStored");
    key(&mut e, "block_hashes");
    mp::write_array_len(&mut e, 2).unwrap();
    mp::write_i64(&mut e, -8635429971592222890).unwrap();
    mp::write_sint(&mut e, 1256577331724852459).unwrap();
    key(&mut e, "parent_block_hash");
    mp::write_sint(&mut e, -1).unwrap();
    key(&mut e, "token_ids");
    tokens(&mut e, 2);
    key(&mut e, "block_size");
    mp::write_uint(&mut e, 1).unwrap();
    key(&mut e, "medium");
    key(&mut e, "GPU");
    let batch = decode_batch(&batch_array(&[e], Some(0))).unwrap();
    assert_eq!(batch.dp_rank, Some(0));
    let KvEvent::BlockStored {
        block_hashes,
        parent_block_hash,
        ..
    } = &batch.events[0]
    else {
        panic!("{batch:?}")
    };
    assert_eq!(
        block_hashes,
        &vec![(-8635429971592222890i64) as u64, 1256577331724852459]
    );
    assert_eq!(*parent_block_hash, Some(u64::MAX));
}

#[test]
fn digest_hashes_use_last_eight_bytes() {
    let digest: Vec<u8> = (0u8..32).collect();
    let mut e = Vec::new();
    mp::write_array_len(&mut e, 8).unwrap();
    key(&mut e, "BlockStored");
    mp::write_array_len(&mut e, 1).unwrap();
    mp::write_bin(&mut e, &digest).unwrap();
    mp::write_bin(&mut e, &digest[..]).unwrap(); // parent
    tokens(&mut e, 16);
    mp::write_uint(&mut e, 16).unwrap();
    mp::write_nil(&mut e).unwrap();
    key(&mut e, "GPU");
    mp::write_nil(&mut e).unwrap();
    let mut removed = Vec::new();
    mp::write_map_len(&mut removed, 2).unwrap();
    key(&mut removed, "block_hashes");
    mp::write_array_len(&mut removed, 1).unwrap();
    mp::write_bin(&mut removed, &digest).unwrap();
    key(&mut removed, "type");
    key(&mut removed, "BlockRemoved");
    let batch = decode_batch(&batch_array(&[e, removed], None)).unwrap();
    let id = 0x18191a1b1c1d1e1fu64;
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![id],
                parent_block_hash: Some(id),
                token_ids: (0..16).collect(),
                block_size: 16,
                lora_id: None,
                key: Default::default(),
                medium: Some(Medium::Gpu),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![id],
                medium: None,
            }
        ]
    );
}

#[test]
fn old_short_arrays_and_long_arrays() {
    // vLLM 0.9: six elements, no medium.
    let mut six = Vec::new();
    mp::write_array_len(&mut six, 6).unwrap();
    key(&mut six, "BlockStored");
    mp::write_array_len(&mut six, 1).unwrap();
    mp::write_uint(&mut six, 77).unwrap();
    mp::write_nil(&mut six).unwrap();
    tokens(&mut six, 4);
    mp::write_uint(&mut six, 4).unwrap();
    mp::write_nil(&mut six).unwrap();
    // A future engine: extra trailing elements of any shape.
    let mut long = Vec::new();
    mp::write_array_len(&mut long, 11).unwrap();
    key(&mut long, "BlockStored");
    mp::write_array_len(&mut long, 1).unwrap();
    mp::write_uint(&mut long, 78).unwrap();
    mp::write_uint(&mut long, 77).unwrap();
    tokens(&mut long, 4);
    mp::write_uint(&mut long, 4).unwrap();
    mp::write_uint(&mut long, 3).unwrap();
    key(&mut long, "CPU");
    key(&mut long, "my-lora");
    mp::write_map_len(&mut long, 1).unwrap();
    key(&mut long, "nested");
    mp::write_array_len(&mut long, 2).unwrap();
    mp::write_f32(&mut long, 1.5).unwrap();
    mp::write_bool(&mut long, true).unwrap();
    mp::write_ext_meta(&mut long, 4, 5).unwrap();
    long.extend_from_slice(&[1, 2, 3, 4]);
    mp::write_bin(&mut long, b"x").unwrap();
    let mut removed_short = Vec::new();
    mp::write_array_len(&mut removed_short, 2).unwrap();
    key(&mut removed_short, "BlockRemoved");
    mp::write_array_len(&mut removed_short, 1).unwrap();
    mp::write_uint(&mut removed_short, 77).unwrap();
    let mut cleared = Vec::new();
    mp::write_array_len(&mut cleared, 1).unwrap();
    key(&mut cleared, "AllBlocksCleared");
    let batch = decode_batch(&batch_array(&[six, long, removed_short, cleared], None)).unwrap();
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![77],
                parent_block_hash: None,
                token_ids: (0..4).collect(),
                block_size: 4,
                lora_id: None,
                key: Default::default(),
                medium: None,
            },
            KvEvent::BlockStored {
                block_hashes: vec![78],
                parent_block_hash: Some(77),
                token_ids: (0..4).collect(),
                block_size: 4,
                lora_id: Some(3),
                key: BlockKey {
                    lora_name: Some("my-lora".into()),
                    ..Default::default()
                },
                medium: Some(Medium::Cpu),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![77],
                medium: None,
            },
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn maps_in_any_order_with_unknown_keys_and_unknown_types() {
    let mut e = Vec::new();
    mp::write_map_len(&mut e, 9).unwrap();
    key(&mut e, "group_idx");
    mp::write_uint(&mut e, 0).unwrap();
    key(&mut e, "token_ids");
    tokens(&mut e, 2);
    key(&mut e, "extra_keys");
    mp::write_array_len(&mut e, 1).unwrap();
    mp::write_array_len(&mut e, 2).unwrap();
    key(&mut e, "salt");
    mp::write_nil(&mut e).unwrap();
    key(&mut e, "block_size");
    mp::write_uint(&mut e, 2).unwrap();
    key(&mut e, "lora_name");
    mp::write_nil(&mut e).unwrap();
    key(&mut e, "medium");
    key(&mut e, "EXTERNAL");
    key(&mut e, "block_hashes");
    mp::write_array_len(&mut e, 1).unwrap();
    mp::write_uint(&mut e, 5).unwrap();
    key(&mut e, "session_id");
    key(&mut e, "s-1");
    key(&mut e, "type");
    key(&mut e, "BlockStored");
    // An event type this build does not know, in both forms: skipped.
    let mut future_map = Vec::new();
    mp::write_map_len(&mut future_map, 2).unwrap();
    key(&mut future_map, "type");
    key(&mut future_map, "BlockPinned");
    key(&mut future_map, "block_hashes");
    mp::write_array_len(&mut future_map, 0).unwrap();
    let mut future_array = Vec::new();
    mp::write_array_len(&mut future_array, 2).unwrap();
    key(&mut future_array, "BlockPinned");
    mp::write_array_len(&mut future_array, 0).unwrap();
    // AllBlocksCleared as a map with nothing else.
    let mut cleared = Vec::new();
    mp::write_map_len(&mut cleared, 1).unwrap();
    key(&mut cleared, "type");
    key(&mut cleared, "AllBlocksCleared");
    let batch = decode_batch(&batch_array(&[future_map, e, future_array, cleared], None)).unwrap();
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored {
                block_hashes: vec![5],
                parent_block_hash: None,
                token_ids: vec![0, 1],
                block_size: 2,
                lora_id: None,
                // The one string of block 0's extra keys, without an adapter: the salt.
                key: BlockKey {
                    cache_salt: Some("salt".into()),
                    ..Default::default()
                },
                medium: Some(Medium::External),
            },
            KvEvent::AllBlocksCleared
        ]
    );
}

#[test]
fn batch_as_map_and_short_batch() {
    let mut ev = Vec::new();
    mp::write_array_len(&mut ev, 1).unwrap();
    key(&mut ev, "AllBlocksCleared");
    for rank_key in ["data_parallel_rank", "dp_rank"] {
        let mut b = Vec::new();
        mp::write_map_len(&mut b, 4).unwrap();
        key(&mut b, "events");
        mp::write_array_len(&mut b, 1).unwrap();
        b.extend_from_slice(&ev);
        key(&mut b, "unknown");
        mp::write_array_len(&mut b, 0).unwrap();
        key(&mut b, rank_key);
        mp::write_uint(&mut b, 3).unwrap();
        key(&mut b, "ts");
        mp::write_uint(&mut b, 99).unwrap(); // an integral timestamp
        assert_eq!(
            decode_batch(&b).unwrap(),
            KvEventBatch {
                ts: 99.0,
                events: vec![KvEvent::AllBlocksCleared],
                dp_rank: Some(3)
            }
        );
    }
    // [ts, events] without dp_rank, ts as float32.
    let mut b = Vec::new();
    mp::write_array_len(&mut b, 2).unwrap();
    mp::write_f32(&mut b, 2.5).unwrap();
    mp::write_array_len(&mut b, 0).unwrap();
    assert_eq!(
        decode_batch(&b).unwrap(),
        KvEventBatch {
            ts: 2.5,
            events: vec![],
            dp_rank: None
        }
    );
}

#[test]
fn errors_say_what_is_wrong() {
    let msg = |bytes: &[u8]| decode_batch(bytes).unwrap_err().to_string();
    // An event that cannot be read: the batch decodes, with the event's error in its place.
    let event_msg = |bytes: &[u8]| match &decode_batch(bytes).unwrap().events[..] {
        [KvEvent::Undecodable(e)] => e.to_string(),
        other => panic!("{other:?}"),
    };
    assert!(msg(&[]).contains("ends where a value was expected"));
    assert!(msg(&[0xa1, b'x']).contains("expected an array, found a string"));
    let mut no_type = Vec::new();
    mp::write_map_len(&mut no_type, 1).unwrap();
    key(&mut no_type, "block_hashes");
    mp::write_array_len(&mut no_type, 0).unwrap();
    assert!(
        event_msg(&batch_array(&[no_type], None)).contains("event 0: map event without \"type\"")
    );
    let mut no_tokens = Vec::new();
    mp::write_map_len(&mut no_tokens, 2).unwrap();
    key(&mut no_tokens, "type");
    key(&mut no_tokens, "BlockStored");
    key(&mut no_tokens, "block_hashes");
    mp::write_array_len(&mut no_tokens, 0).unwrap();
    assert!(event_msg(&batch_array(&[no_tokens], None)).contains("without \"token_ids\""));
    let mut neg_token = Vec::new();
    mp::write_array_len(&mut neg_token, 5).unwrap();
    key(&mut neg_token, "BlockStored");
    mp::write_array_len(&mut neg_token, 0).unwrap();
    mp::write_nil(&mut neg_token).unwrap();
    mp::write_array_len(&mut neg_token, 1).unwrap();
    mp::write_sint(&mut neg_token, -5).unwrap();
    mp::write_uint(&mut neg_token, 1).unwrap();
    assert!(
        event_msg(&batch_array(&[neg_token], None)).contains("token_ids: expected an unsigned int")
    );
    // An event whose msgpack framing is broken breaks the batch.
    let mut cut = batch_array(&[bad_stored()], None);
    cut.truncate(cut.len() - 2);
    assert!(msg(&cut).contains("truncated"));
    let mut huge = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(msg(&huge).contains("elements announced"));
    let mut trailing = encode_batch(&sample_batch(), EventFormat::Map);
    trailing.push(0xc0);
    assert!(msg(&trailing).contains("trailing"));
    let mut deep = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0xc0];
    deep.push(0x9f); // an extra batch element nested far too deep
    deep[0] = 0x94;
    deep.extend(std::iter::repeat_n(0x91, 10_000));
    assert!(msg(&deep).contains("nested deeper"));
}

/// xorshift64*: a seeded generator, so a failure names the case that broke.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

#[test]
fn garbage_never_panics() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let valid = [
        encode_batch(&sample_batch(), EventFormat::Map),
        encode_batch(&sample_batch(), EventFormat::Array),
        encode_batch(&sample_batch(), EventFormat::MapNil),
    ];
    // Every truncation of valid messages fails cleanly.
    for v in &valid {
        for cut in 0..v.len() {
            assert!(
                decode_batch(&v[..cut]).is_err(),
                "prefix of {cut} bytes decoded"
            );
        }
    }
    // Random bytes, and valid messages with random bytes overwritten.
    for case in 0..20_000 {
        let bytes: Vec<u8> = if case % 2 == 0 {
            let len = (rng.next() % 64) as usize;
            (0..len).map(|_| rng.next() as u8).collect()
        } else {
            let mut v = valid[case % 4 / 2].clone();
            for _ in 0..1 + rng.next() % 4 {
                let i = (rng.next() as usize) % v.len();
                v[i] = rng.next() as u8;
            }
            v
        };
        let _ = decode_batch(&bytes);
    }
}

/// SGLang 0.5.23 with EAGLE speculative decoding: each page's `token_ids` are the bigrams
/// `(t_j, t_{j+1})` of its raw tokens (the last one reaching into the next page).
fn bigram_stored(hash: i64, parent: Option<i64>, raw: &[u32]) -> Vec<u8> {
    let pairs = raw.len() as u32 - 1;
    let mut e = Vec::new();
    mp::write_map_len(&mut e, 6).unwrap();
    key(&mut e, "type");
    key(&mut e, "BlockStored");
    key(&mut e, "block_hashes");
    mp::write_array_len(&mut e, 1).unwrap();
    mp::write_sint(&mut e, hash).unwrap();
    key(&mut e, "parent_block_hash");
    match parent {
        Some(p) => mp::write_sint(&mut e, p).map(|_| ()).unwrap(),
        None => mp::write_nil(&mut e).unwrap(),
    }
    key(&mut e, "token_ids");
    mp::write_array_len(&mut e, pairs).unwrap();
    for w in raw.windows(2) {
        mp::write_array_len(&mut e, 2).unwrap();
        mp::write_uint(&mut e, w[0] as u64).unwrap();
        mp::write_uint(&mut e, w[1] as u64).unwrap();
    }
    key(&mut e, "block_size");
    mp::write_uint(&mut e, pairs as u64).unwrap();
    key(&mut e, "medium");
    key(&mut e, "GPU");
    e
}

#[test]
fn sglang_eagle_bigram_token_ids_are_the_raw_tokens() {
    // Raw tokens 100..109: two pages of four bigrams, the second page chained on the first.
    let raw: Vec<u32> = (100..109).collect();
    let first = bigram_stored(-7, None, &raw[..5]);
    let second = bigram_stored(8, Some(-7), &raw[4..9]);
    let batch = decode_batch(&batch_array(&[first, second], Some(0))).unwrap();
    let tokens: Vec<(&Vec<u32>, u32)> = batch
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                token_ids,
                block_size,
                ..
            } => Some((token_ids, *block_size)),
            _ => None,
        })
        .collect();
    assert_eq!(
        tokens,
        vec![(&raw[..4].to_vec(), 4), (&raw[4..8].to_vec(), 4)],
        "{batch:?}"
    );
}

/// A BlockStored whose `token_ids` cannot be read (a negative token id).
fn bad_stored() -> Vec<u8> {
    let mut e = Vec::new();
    mp::write_map_len(&mut e, 5).unwrap();
    key(&mut e, "type");
    key(&mut e, "BlockStored");
    key(&mut e, "block_hashes");
    mp::write_array_len(&mut e, 1).unwrap();
    mp::write_uint(&mut e, 1).unwrap();
    key(&mut e, "token_ids");
    mp::write_array_len(&mut e, 2).unwrap();
    mp::write_uint(&mut e, 1).unwrap();
    mp::write_sint(&mut e, -5).unwrap();
    key(&mut e, "block_size");
    mp::write_uint(&mut e, 2).unwrap();
    key(&mut e, "medium");
    key(&mut e, "GPU");
    e
}

#[test]
fn one_unreadable_event_leaves_the_rest_of_the_batch() {
    let good = {
        let mut e = Vec::new();
        mp::write_array_len(&mut e, 5).unwrap();
        key(&mut e, "BlockStored");
        mp::write_array_len(&mut e, 1).unwrap();
        mp::write_uint(&mut e, 9).unwrap();
        mp::write_nil(&mut e).unwrap();
        tokens(&mut e, 2);
        mp::write_uint(&mut e, 2).unwrap();
        e
    };
    // Bigrams that do not continue one another are not a token sequence either.
    let mut broken_bigrams = bigram_stored(3, None, &[1, 2, 3]);
    let at = broken_bigrams.len() - 25; // the second pair's first element: 2 -> 4
    assert_eq!(broken_bigrams[at], 2, "{broken_bigrams:?}");
    broken_bigrams[at] = 4;
    let batch = decode_batch(&batch_array(&[bad_stored(), good, broken_bigrams], None)).unwrap();
    assert_eq!(batch.events.len(), 3, "{batch:?}");
    let stored: Vec<&KvEvent> = batch
        .events
        .iter()
        .filter(|e| matches!(e, KvEvent::BlockStored { .. }))
        .collect();
    assert_eq!(
        stored,
        vec![&KvEvent::BlockStored {
            block_hashes: vec![9],
            parent_block_hash: None,
            token_ids: vec![0, 1],
            block_size: 2,
            lora_id: None,
            key: Default::default(),
            medium: None,
        }]
    );
    let reasons = format!("{:?}", batch.events);
    assert!(reasons.contains("expected an unsigned int"), "{reasons}");
    assert!(reasons.contains("does not continue"), "{reasons}");
}

/// What vLLM 0.33's own encoder writes for `vllm_batch()`: msgspec 0.23.0 encoding the
/// classes of vllm/distributed/kv_events.py (loaded with stand-ins for its other vllm
/// imports) as
///
/// ```python
/// KVEventBatch(ts=1.5, events=[
///     BlockStored(block_hashes=[9, 2**64-1], parent_block_hash=None, token_ids=[1, 2, 3, 4],
///                 block_size=2, lora_id=None, medium="GPU", lora_name=None),
///     BlockStored(block_hashes=[10], parent_block_hash=2**64-1, token_ids=[150000, 5],
///                 block_size=2, lora_id=3, medium="CPU", lora_name=None),
///     BlockRemoved(block_hashes=[9], medium=None),
///     AllBlocksCleared(),
/// ], data_parallel_rank=2)
/// ```
///
/// `msgspec.msgpack.Encoder().encode(batch).hex()`, generated once. The fields without a
/// default are always written, nil or not; BlockStored's map has a 16-bit header (msgspec
/// sizes it for the struct's 16 fields).
const VLLM_0_33_BATCH: &str = "93cb3ff800000000000094de0008a474797065ab426c6f636b53746f726564\
    ac626c6f636b5f6861736865739209cfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a974\
    6f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055\
    a96c6f72615f6e616d65c0de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391\
    0ab1706172656e745f626c6f636b5f68617368cfffffffffffffffffa9746f6b656e5f69647392ce000249f005\
    aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3435055a96c6f72615f6e616d65c083a4\
    74797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739109a66d656469756dc081a4747970\
    65b0416c6c426c6f636b73436c656172656402";

fn vllm_batch() -> KvEventBatch {
    KvEventBatch {
        ts: 1.5,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![9, u64::MAX],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                key: Default::default(),
                medium: Some(Medium::Gpu),
            },
            KvEvent::BlockStored {
                block_hashes: vec![10],
                parent_block_hash: Some(u64::MAX),
                token_ids: vec![150_000, 5],
                block_size: 2,
                lora_id: Some(3),
                key: Default::default(),
                medium: Some(Medium::Cpu),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![9],
                medium: None,
            },
            KvEvent::AllBlocksCleared,
        ],
        dp_rank: Some(2),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn map_form_is_what_vllm_0_33_writes() {
    let bytes = encode_batch(&vllm_batch(), EventFormat::Map);
    assert_eq!(hex(&bytes), VLLM_0_33_BATCH.replace(' ', ""));
    assert_eq!(decode_batch(&bytes).unwrap(), vllm_batch());
}

/// vLLM's extra_keys: per block the adapter name, multimodal pairs, block 0's salt, prompt
/// embeddings digests; SGLang's cache_salt field. The encoder writes vLLM's form back.
#[test]
fn block_keys_from_extra_keys_and_fields() {
    // A BlockStored of three 2-token blocks with one more key written by `extra`.
    let event = |parent: Option<u64>, lora: Option<&str>, extra: &dyn Fn(&mut Vec<u8>)| {
        let mut e = Vec::new();
        mp::write_map_len(&mut e, 7).unwrap();
        key(&mut e, "type");
        key(&mut e, "BlockStored");
        key(&mut e, "block_hashes");
        mp::write_array_len(&mut e, 3).unwrap();
        for h in [1, 2, 3] {
            mp::write_uint(&mut e, h).unwrap();
        }
        key(&mut e, "parent_block_hash");
        match parent {
            Some(p) => mp::write_uint(&mut e, p).map(|_| ()).unwrap(),
            None => mp::write_nil(&mut e).unwrap(),
        }
        key(&mut e, "token_ids");
        tokens(&mut e, 6);
        key(&mut e, "block_size");
        mp::write_uint(&mut e, 2).unwrap();
        key(&mut e, "lora_name");
        match lora {
            Some(l) => key(&mut e, l),
            None => mp::write_nil(&mut e).unwrap(),
        }
        extra(&mut e);
        match decode_batch(&batch_array(&[e], None))
            .unwrap()
            .events
            .remove(0)
        {
            KvEvent::BlockStored { key, .. } => key,
            other => panic!("{other:?}"),
        }
    };
    type Entry<'a> = &'a dyn Fn(&mut Vec<u8>);
    let entries = |e: &mut Vec<u8>, blocks: &[Entry<'_>]| {
        key(e, "extra_keys");
        mp::write_array_len(e, blocks.len() as u32).unwrap();
        for b in blocks {
            b(e);
        }
    };
    // LoRA and salt from the prompt's start: ["a", "s"], ["a"], ["a"].
    let k = event(None, Some("a"), &|e| {
        let first = |e: &mut Vec<u8>| {
            mp::write_array_len(e, 2).unwrap();
            key(e, "a");
            key(e, "s");
        };
        let other = |e: &mut Vec<u8>| {
            mp::write_array_len(e, 1).unwrap();
            key(e, "a");
        };
        entries(e, &[&first, &other, &other]);
    });
    assert_eq!(
        k,
        BlockKey {
            lora_name: Some("a".into()),
            cache_salt: Some("s".into()),
            opaque_from: None
        }
    );
    // A multimodal pair on block 1, after a parent: no salt there, opaque from block 1.
    let k = event(Some(9), None, &|e| {
        let none = |e: &mut Vec<u8>| mp::write_nil(e).unwrap();
        let mm = |e: &mut Vec<u8>| {
            mp::write_array_len(e, 1).unwrap();
            mp::write_array_len(e, 2).unwrap();
            key(e, "img-hash");
            mp::write_uint(e, 0).unwrap();
        };
        entries(e, &[&none, &mm, &none]);
    });
    assert_eq!(k.opaque_from, Some(1));
    assert_eq!(k.cache_salt, None);
    // Prompt embeddings (a binary digest) on block 0.
    let k = event(None, None, &|e| {
        let embeds = |e: &mut Vec<u8>| {
            mp::write_array_len(e, 1).unwrap();
            mp::write_bin(e, &[7; 32]).unwrap();
        };
        let none = |e: &mut Vec<u8>| mp::write_nil(e).unwrap();
        entries(e, &[&embeds, &none, &none]);
    });
    assert_eq!(k.opaque_from, Some(0));
    // SGLang: its own field.
    let k = event(None, None, &|e| {
        key(e, "cache_salt");
        key(e, "tenant");
    });
    assert_eq!(k.cache_salt, Some("tenant".into()));

    // Encoded as vLLM does and read back.
    let stored = KvEvent::BlockStored {
        block_hashes: vec![1, 2],
        parent_block_hash: None,
        token_ids: vec![0; 32],
        block_size: 16,
        lora_id: Some(1),
        medium: Some(Medium::Gpu),
        key: BlockKey {
            lora_name: Some("a".into()),
            cache_salt: Some("s".into()),
            opaque_from: None,
        },
    };
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![stored],
        dp_rank: None,
    };
    for format in [EventFormat::Map, EventFormat::MapNil] {
        assert_eq!(
            decode_batch(&encode_batch(&batch, format)).unwrap(),
            batch,
            "{format:?}"
        );
    }
}
