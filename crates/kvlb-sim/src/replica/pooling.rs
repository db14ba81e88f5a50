//! The endpoints of vLLM 0.33 that use no KV cache and answer at once, in vLLM's shapes, so a
//! balancer in front of the replica can be tested on them: `POST /v1/embeddings`
//! (`vllm/entrypoints/pooling/embed`), `/rerank`, `/v1/rerank`, `/v2/rerank`, `/score`,
//! `/v1/score` (`pooling/scoring`) and `/detokenize` (`serve/tokenize`). Pure: ids and times
//! come in as arguments.
//!
//! Texts are tokenized as a completions prompt is (the `--tokenizer` tokenizer with special
//! tokens, else the simulated one). The numbers are deterministic stand-ins for a model's:
//! an embedding is [`EMBED_DIMS`] floats derived from the token ids (unit length, as vLLM
//! normalizes them), a relevance score the share of the query's distinct tokens that the
//! document contains (with a small deterministic tie-breaker), in 0..1.
//!
//! Where this differs from vLLM, on purpose: the served model answers these endpoints as well
//! as generation (vLLM serves pooling endpoints only for a pooling model); multimodal inputs
//! are refused (the simulated model is text only, as vLLM refuses them for text models);
//! `dimensions` may shrink the vector (1..=8, renormalized); `encoding_format` is `float` or
//! `base64` (little-endian float32, as vLLM's default `native` byte order on x86).

#![forbid(unsafe_code)]

use super::models::Served;
use super::openai::{self, type_name, ApiError, HF_TOKENIZER};
use crate::engine::tokenizer;
use serde_json::{json, Map, Value};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Length of the simulated embedding vectors.
pub const EMBED_DIMS: usize = 8;

fn bad(message: impl Into<String>, param: Option<&'static str>) -> ApiError {
    ApiError {
        param,
        ..ApiError::bad_request(message)
    }
}

/// The `model` of a request: a served name (or none) or vLLM's 404.
fn model_name(m: &Map<String, Value>, served: &Served) -> Result<String, ApiError> {
    let model = match m.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(v) => {
            return Err(bad(
                format!("model: expected a string, got {}", type_name(v)),
                Some("model"),
            ))
        }
    };
    let named = served.check(model)?;
    Ok(served.response_name(&named))
}

/// vLLM's `UsageInfo` of a pooling request: prompt tokens only.
fn usage(prompt_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
        "prompt_tokens_details": null, "completion_tokens_details": null})
}

/// The unit vector of `ids` (its first `dims` components): per dimension, the sum over the
/// tokens of a hash of (token, dimension) mapped to -1..1.
pub fn embed(ids: &[u32], dims: usize) -> Vec<f32> {
    let dims = dims.clamp(1, EMBED_DIMS);
    let mut v = vec![0f64; dims];
    for &id in ids {
        for (d, x) in v.iter_mut().enumerate() {
            let h = xxh3_64_with_seed(&id.to_le_bytes(), d as u64);
            *x += (h as f64 / u64::MAX as f64) * 2.0 - 1.0;
        }
    }
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter()
        .map(|x| if norm > 0.0 { (x / norm) as f32 } else { 0.0 })
        .collect()
}

/// Standard base64 (with padding) of `bytes`.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> shift) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The token id lists of an embeddings `input`: a string, a list of strings, a list of token
/// ids or a list of lists of token ids; or one chat conversation (`messages`, or `input` as a
/// list of messages), rendered without a generation prompt as vLLM's embeddings chat requests
/// are.
fn embedding_inputs(m: &Map<String, Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let is_message = |v: &Value| v.get("role").is_some_and(Value::is_string);
    let conversation = match (m.get("messages"), m.get("input")) {
        (Some(msgs @ Value::Array(_)), _) => Some(msgs),
        (_, Some(input @ Value::Array(items)))
            if !items.is_empty() && items.iter().all(is_message) =>
        {
            Some(input)
        }
        _ => None,
    };
    if let Some(messages) = conversation {
        let body = json!({"messages": messages, "add_generation_prompt": false});
        return Ok(vec![openai::parse_tokenize(body.to_string().as_bytes())?]);
    }
    let wrong = |v: &Value| {
        bad(
            format!(
                "input: expected a string, a list of strings, a list of token ids or a list of \
                 lists of token ids, got {}",
                type_name(v)
            ),
            Some("input"),
        )
    };
    match m.get("input") {
        None | Some(Value::Null) => Err(bad("input: Field required", Some("input"))),
        Some(Value::String(s)) => Ok(vec![openai::encode_text(s)?]),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(bad("input: must not be an empty list", Some("input")))
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            Ok(vec![openai::token_ids(items, "input")?])
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => openai::encode_text(s),
                Value::Array(ids) if ids.iter().all(Value::is_number) => {
                    openai::token_ids(ids, "input")
                }
                other => Err(wrong(other)),
            })
            .collect(),
        Some(other) => Err(wrong(other)),
    }
}

/// `POST /v1/embeddings`.
pub fn embeddings(
    body: &[u8],
    served: &Served,
    random: u128,
    created: u64,
) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    let model = model_name(&m, served)?;
    let dims = match m.get("dimensions") {
        None | Some(Value::Null) => EMBED_DIMS,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(d @ 1..=8) => d as usize,
            _ => {
                return Err(bad(
                    format!(
                        "dimensions: the simulated model's embeddings have {EMBED_DIMS} \
                         dimensions; ask for 1 to {EMBED_DIMS}, got {n}"
                    ),
                    Some("dimensions"),
                ))
            }
        },
        Some(v) => {
            return Err(bad(
                format!("dimensions: expected an integer, got {}", type_name(v)),
                Some("dimensions"),
            ))
        }
    };
    let base64_wanted = match m.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(v) => {
            return Err(bad(
                format!("encoding_format: kvlb replica answers \"float\" or \"base64\", got {v}"),
                Some("encoding_format"),
            ))
        }
    };
    let inputs = embedding_inputs(&m)?;
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, ids)| {
            let v = embed(ids, dims);
            let embedding = if base64_wanted {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64(&bytes))
            } else {
                Value::Array(v.iter().map(|&x| json!(f64::from(x))).collect())
            };
            json!({"index": i, "object": "embedding", "embedding": embedding})
        })
        .collect();
    Ok(
        json!({"id": format!("embd-{random:032x}"), "object": "list", "created": created,
        "model": model, "data": data, "usage": usage(tokens)})
        .to_string(),
    )
}

/// One score input (a text) of a score or rerank request, as token ids.
fn score_text(v: &Value, what: &'static str, model: &str) -> Result<(Vec<u32>, String), ApiError> {
    match v {
        Value::String(s) => Ok((openai::encode_text(s)?, s.clone())),
        Value::Object(o) if o.contains_key("content") => Err(bad(
            format!("MultiModalParam is not supported for {model}"),
            Some(what),
        )),
        other => Err(bad(
            format!(
                "{what}: expected a string or a list of strings, got {}",
                type_name(other)
            ),
            Some(what),
        )),
    }
}

/// A score input that may be one text or a list of them.
fn score_list(
    v: &Value,
    what: &'static str,
    model: &str,
) -> Result<Vec<(Vec<u32>, String)>, ApiError> {
    match v {
        Value::Array(items) => items.iter().map(|i| score_text(i, what, model)).collect(),
        one => Ok(vec![score_text(one, what, model)?]),
    }
}

/// The relevance of `doc` to `query`: the share of the query's distinct tokens the document
/// holds, plus a deterministic tie-breaker, in 0..1.
pub fn relevance(query: &[u32], doc: &[u32]) -> f64 {
    let mut distinct: Vec<u32> = query.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let overlap = if distinct.is_empty() {
        0.0
    } else {
        distinct.iter().filter(|t| doc.contains(t)).count() as f64 / distinct.len() as f64
    };
    let mut key: Vec<u8> = Vec::with_capacity((query.len() + doc.len() + 1) * 4);
    for id in query.iter().chain([u32::MAX].iter()).chain(doc) {
        key.extend_from_slice(&id.to_le_bytes());
    }
    let tie = xxh3_64_with_seed(&key, 7) as f64 / u64::MAX as f64;
    0.98 * overlap + 0.02 * tie
}

/// vLLM's `_validate_score_input_lens`: one query against every document, or pairwise.
fn check_lens(n1: usize, n2: usize) -> Result<(), ApiError> {
    if n1 > 1 && n1 != n2 {
        return Err(bad("Input lengths must be either 1:1, 1:N or N:N", None));
    }
    if n1 == 0 {
        return Err(bad("At least one text element must be given", None));
    }
    if n2 == 0 {
        return Err(bad("At least one text_pair element must be given", None));
    }
    Ok(())
}

/// `POST /score` and `/v1/score`: `queries` with `documents` or `items`, `data_1` with
/// `data_2`, or `text_1` with `text_2`.
pub fn score(body: &[u8], served: &Served, random: u128, created: u64) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    let model = model_name(&m, served)?;
    let present = |k: &str| m.get(k).is_some_and(|v| !v.is_null());
    let pair = [
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ]
    .into_iter()
    .find(|(a, b)| present(a) && present(b))
    .ok_or_else(|| {
        bad(
            "score: give queries and documents (or items), data_1 and data_2, or text_1 and \
             text_2",
            None,
        )
    })?;
    let first = score_list(&m[pair.0], "data_1", &model)?;
    let second = score_list(&m[pair.1], "data_2", &model)?;
    check_lens(first.len(), second.len())?;
    let mut tokens = 0;
    let data: Vec<Value> = second
        .iter()
        .enumerate()
        .map(|(i, (doc, _))| {
            let (query, _) = if first.len() == 1 {
                &first[0]
            } else {
                &first[i]
            };
            tokens += query.len() + doc.len();
            json!({"index": i, "object": "score", "score": relevance(query, doc)})
        })
        .collect();
    Ok(
        json!({"id": format!("score-{random:032x}"), "object": "list", "created": created,
        "model": model, "data": data, "usage": usage(tokens)})
        .to_string(),
    )
}

/// `POST /rerank`, `/v1/rerank` and `/v2/rerank`: the documents by relevance to the query,
/// the best first, the first `top_n` (all for 0).
pub fn rerank(body: &[u8], served: &Served, random: u128) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    let model = model_name(&m, served)?;
    let query = match m.get("query") {
        None | Some(Value::Null) => return Err(bad("query: Field required", Some("query"))),
        Some(q) => score_text(q, "query", &model)?,
    };
    let documents = match m.get("documents") {
        None | Some(Value::Null) => {
            return Err(bad("documents: Field required", Some("documents")))
        }
        Some(d) => score_list(d, "documents", &model)?,
    };
    let top_n = match m.get("top_n") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) => n.as_u64().ok_or_else(|| {
            bad(
                format!("top_n: expected an integer of at least 0, got {n}"),
                Some("top_n"),
            )
        })? as usize,
        Some(v) => {
            return Err(bad(
                format!("top_n: expected an integer, got {}", type_name(v)),
                Some("top_n"),
            ))
        }
    };
    check_lens(1, documents.len())?;
    let mut tokens = 0;
    let mut results: Vec<(usize, f64, &str)> = documents
        .iter()
        .enumerate()
        .map(|(i, (doc, text))| {
            tokens += query.0.len() + doc.len();
            (i, relevance(&query.0, doc), text.as_str())
        })
        .collect();
    results.sort_by(|a, b| b.1.total_cmp(&a.1));
    if top_n > 0 {
        results.truncate(top_n);
    }
    let results: Vec<Value> = results
        .into_iter()
        .map(|(i, s, text)| {
            json!({"index": i, "document": {"text": text, "multi_modal": null}, "relevance_score": s})
        })
        .collect();
    Ok(json!({"id": format!("score-{random:032x}"), "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})
    .to_string())
}

/// `POST /detokenize`: the text of `tokens` (the `--tokenizer` tokenizer's decode, special
/// tokens kept, else the simulated tokenizer's words).
pub fn detokenize(body: &[u8], served: &Served) -> Result<String, ApiError> {
    let m = openai::parse_object(body)?;
    model_name(&m, served)?;
    let list = match m.get("tokens") {
        Some(Value::Array(list)) => list,
        None | Some(Value::Null) => return Err(bad("tokens: Field required", Some("tokens"))),
        Some(v) => {
            return Err(bad(
                format!("tokens: expected a list of token ids, got {}", type_name(v)),
                Some("tokens"),
            ))
        }
    };
    let prompt = match HF_TOKENIZER.get() {
        Some(t) => {
            let vocab = crate::tokenize::agent::vocab_size(t) as u64;
            let mut ids = Vec::with_capacity(list.len());
            for v in list {
                match v.as_u64() {
                    Some(id) if id < vocab => ids.push(id as u32),
                    _ => {
                        return Err(bad(
                            format!("tokens: token id {v} is out of vocabulary (0..{vocab})"),
                            Some("tokens"),
                        ))
                    }
                }
            }
            crate::tokenize::agent::detokenize(t, &ids)
                .map_err(|e| bad(e.to_string(), Some("tokens")))?
        }
        None => {
            let ids = openai::token_ids(list, "tokens")?;
            let mut text = String::new();
            for id in ids {
                tokenizer::decode_token(id, &mut text);
            }
            text
        }
    };
    Ok(json!({"prompt": prompt}).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served() -> Served {
        Served::new("sim/m", vec!["sim/m".into()], false, &[], 1.0)
    }

    #[test]
    fn embeddings_are_unit_vectors_in_vllm_shape() {
        let out: Value = serde_json::from_str(
            &embeddings(
                br#"{"input": ["hello world", "hello"], "model": "sim/m"}"#,
                &served(),
                1,
                5,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(
            (out["object"].as_str(), out["data"][1]["index"].as_u64()),
            (Some("list"), Some(1))
        );
        assert_eq!(out["data"][0]["object"], "embedding");
        let v: Vec<f64> = out["data"][0]["embedding"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(v.len(), EMBED_DIMS);
        assert!((v.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-5);
        assert!(out["id"].as_str().unwrap().starts_with("embd-"));
        assert_eq!(out["usage"]["prompt_tokens"], out["usage"]["total_tokens"]);
        // Same input, same vector; token ids work too; base64 is float32 little-endian.
        assert_eq!(embed(&[1, 2, 3], 8), embed(&[1, 2, 3], 8));
        let b: Value = serde_json::from_str(
            &embeddings(
                br#"{"input": [1, 2, 3], "encoding_format": "base64", "dimensions": 4}"#,
                &served(),
                1,
                5,
            )
            .unwrap(),
        )
        .unwrap();
        let floats: Vec<u8> = embed(&[1, 2, 3], 4)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(b["data"][0]["embedding"], base64(&floats));
        assert_eq!(base64(b"any carnal pleas"), "YW55IGNhcm5hbCBwbGVhcw==");
        for bad in [
            &br#"{"input": []}"#[..],
            br#"{"input": 3}"#,
            br#"{"input": "x", "dimensions": 9}"#,
            br#"{"input": "x", "encoding_format": "bytes"}"#,
            br#"{"input": "x", "model": "other"}"#,
            b"[1]",
        ] {
            assert!(
                embeddings(bad, &served(), 1, 5).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn rerank_sorts_by_relevance_and_score_pairs() {
        let out: Value = serde_json::from_str(
            &rerank(br#"{"query": "cache prefix routing", "documents": ["the weather today", "prefix cache routing for LLMs", "cache"], "top_n": 2}"#, &served(), 9).unwrap(),
        )
        .unwrap();
        let results = out["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        assert_eq!(results[0]["index"], 1);
        assert_eq!(
            results[0]["document"],
            json!({"text": "prefix cache routing for LLMs", "multi_modal": null})
        );
        assert!(results[0]["relevance_score"].as_f64() > results[1]["relevance_score"].as_f64());
        assert!(out["id"].as_str().unwrap().starts_with("score-"));
        let s: Value = serde_json::from_str(
            &score(
                br#"{"text_1": "a b", "text_2": ["a b", "c d"]}"#,
                &served(),
                9,
                1,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(s["data"][0]["object"], "score");
        assert!(s["data"][0]["score"].as_f64() > s["data"][1]["score"].as_f64());
        let e = score(
            br#"{"queries": ["a", "b"], "documents": ["a", "b", "c"]}"#,
            &served(),
            9,
            1,
        )
        .unwrap_err();
        assert_eq!(e.message, "Input lengths must be either 1:1, 1:N or N:N");
        let e = rerank(br#"{"query": "a", "documents": []}"#, &served(), 9).unwrap_err();
        assert_eq!(e.message, "At least one text_pair element must be given");
        assert!(rerank(
            br#"{"query": {"content": []}, "documents": ["x"]}"#,
            &served(),
            9
        )
        .is_err());
    }

    #[test]
    fn detokenize_simulated() {
        let out: Value =
            serde_json::from_str(&detokenize(br#"{"tokens": [0, 1]}"#, &served()).unwrap())
                .unwrap();
        assert_eq!(out["prompt"], " the of");
        assert!(detokenize(br#"{"tokens": [-1]}"#, &served()).is_err());
        assert!(detokenize(br#"{"tokens": "x"}"#, &served()).is_err());
    }
}
