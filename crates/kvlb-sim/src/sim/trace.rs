//! Request traces for the simulator: what arrives when, with which prompt prefix structure.
//!
//! Every request, whatever its source, becomes a `TraceRequest`: an arrival time, prompt and
//! output lengths, and block ids, one per `TRACE_BLOCK_TOKENS` tokens of the prompt (the last
//! one may be partial). An id names its block AND everything before it, as in Mooncake traces:
//! two requests sharing their first k ids share a `k * 512`-token prefix. The prompt's tokens
//! are derived from the ids (`prompt_tokens`): block id k always yields the same 512 tokens, so
//! equal ids give equal tokens and the engine's own prefix cache sees exactly the sharing the
//! trace describes.
//!
//! Sources:
//! * Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`);
//! * Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`): no sharing, every
//!   request gets ids of its own;
//! * `gen:shared-prefix`: groups of requests behind long system prompts, unique tails;
//! * `gen:agent-sessions`: multi-turn sessions behind one shared preamble, each turn's prompt
//!   the previous prompt plus its answer plus a new message.
//!
//! A Mooncake line may also name its `model` (an extension: the published traces do not);
//! `ModelMix` gives the rows that name none a model by weight, per session.
//!
//! Generators are deterministic for a seed. Malformed files give an error naming the line.

#![forbid(unsafe_code)]

use crate::engine::tokenizer::FIRST_SPECIAL;
use crate::select::Rng;
use serde::Deserialize;

/// Prompt tokens one trace block id covers.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// Where generated and Azure ids start, far above any Mooncake id.
const GENERATED_ID_BASE: u64 = 1 << 48;

#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Seconds from the start of the trace.
    pub arrival_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// One id per `TRACE_BLOCK_TOKENS` prompt tokens, `ceil(prompt_tokens / 512)` of them.
    pub block_ids: Vec<u64>,
    /// The model it asks for: a Mooncake line's own `model` key, or one `ModelMix::assign`
    /// gave it (None: whatever the caller's default is).
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The file name or generator it came from.
    pub name: String,
    /// In arrival order.
    pub requests: Vec<TraceRequest>,
}

/// splitmix64 finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The prefix block hash a data plane would compute for trace block `id` (ids already name
/// their whole prefix, so mixing each one is enough to make it a chained hash).
pub fn view_block(id: u64) -> u64 {
    mix(id ^ 0x6b76_6c62_5f62_6c6b)
}

/// Append the prompt of `req` (deterministic text token ids) to `out`.
pub fn prompt_tokens(req: &TraceRequest, out: &mut Vec<u32>) {
    let mut left = req.prompt_tokens;
    for &id in &req.block_ids {
        let n = left.min(TRACE_BLOCK_TOKENS);
        let seed = mix(id);
        for j in 0..n {
            out.push((mix(seed ^ j as u64) % FIRST_SPECIAL as u64) as u32);
        }
        left -= n;
    }
}

/// Letters of prompt-text words: 32 of them, so a word takes 20 bits of a hash.
const WORD_LETTERS: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// Append the prompt of `req` as text (for replaying a trace over HTTP): block id k always
/// gives the same words, one per token, each a space and four letters, which the simulated
/// engine's tokenizer reads as exactly one token (a piece starts at whitespace and holds up to
/// five bytes). Equal ids give equal text, so a balancer matching characters, one matching
/// tokens and the engine's prefix cache all see the sharing the trace describes.
pub fn prompt_text(req: &TraceRequest, out: &mut String) {
    let mut left = req.prompt_tokens;
    out.reserve(5 * left as usize);
    for &id in &req.block_ids {
        let n = left.min(TRACE_BLOCK_TOKENS);
        let seed = mix(id ^ 0x7465_7874);
        for j in 0..n {
            let h = mix(seed ^ j as u64);
            out.push(' ');
            for k in 0..4 {
                out.push(WORD_LETTERS[((h >> (5 * k)) & 31) as usize] as char);
            }
        }
        left -= n;
    }
}

/// Load `spec`: a file path or `gen:shared-prefix` / `gen:agent-sessions`. Keeps the first
/// `limit` requests (in arrival order) when given.
pub fn load(spec: &str, limit: Option<usize>, seed: u64) -> Result<Trace, String> {
    let mut requests = match spec {
        "gen:shared-prefix" => shared_prefix(seed),
        "gen:agent-sessions" => agent_sessions(seed),
        s if s.starts_with("gen:") => {
            return Err(format!(
                "--trace {s:?}: unknown generator (gen:shared-prefix or gen:agent-sessions)"
            ))
        }
        path => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--trace {path:?}: cannot read: {e}"))?;
            parse(&text).map_err(|e| format!("--trace {path:?}: {e}"))?
        }
    };
    // Stable: equal times keep file order.
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    if let Some(first) = requests.first().map(|r| r.arrival_s) {
        for r in &mut requests {
            r.arrival_s -= first;
        }
    }
    if let Some(n) = limit {
        requests.truncate(n);
    }
    Ok(Trace {
        name: spec.to_string(),
        requests,
    })
}

/// Parse a trace file's text, recognising its format by its first line.
pub fn parse(text: &str) -> Result<Vec<TraceRequest>, String> {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    if first.trim_start().starts_with('{') {
        parse_mooncake(text)
    } else if first.contains("ContextTokens") {
        parse_azure(text)
    } else {
        Err(format!(
            "unknown format: expected Mooncake JSONL ({{\"timestamp\": ...}}) or an Azure CSV \
             (TIMESTAMP,ContextTokens,GeneratedTokens); first line {:?}",
            first.chars().take(80).collect::<String>()
        ))
    }
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    model: Option<String>,
}

fn tokens_u32(v: u64, what: &str, line: usize) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("line {line}: {what} {v} is too large"))
}

fn parse_mooncake(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let m: MooncakeLine = serde_json::from_str(line)
            .map_err(|e| format!("line {n}: not a Mooncake request: {e}"))?;
        if !(m.timestamp.is_finite() && m.timestamp >= 0.0) {
            return Err(format!("line {n}: timestamp {} is not a time", m.timestamp));
        }
        let prompt = tokens_u32(m.input_length, "input_length", n)?;
        let blocks = prompt.div_ceil(TRACE_BLOCK_TOKENS) as usize;
        if m.hash_ids.len() < blocks {
            return Err(format!(
                "line {n}: input_length {prompt} needs {blocks} hash_ids (one per {TRACE_BLOCK_TOKENS} tokens), got {}",
                m.hash_ids.len()
            ));
        }
        if m.model.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(format!("line {n}: model is empty"));
        }
        let mut ids = m.hash_ids;
        ids.truncate(blocks);
        out.push(TraceRequest {
            arrival_s: m.timestamp / 1000.0,
            prompt_tokens: prompt,
            output_tokens: tokens_u32(m.output_length, "output_length", n)?,
            block_ids: ids,
            model: m.model,
        });
    }
    Ok(out)
}

/// Seconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]`.
fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    if d.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    let mut t = time.split(':');
    let (hh, mm, ss) = (t.next()?, t.next()?, t.next()?);
    if t.next().is_some() {
        return None;
    }
    let (hh, mm, ss) = (
        hh.parse::<u32>().ok()?,
        mm.parse::<u32>().ok()?,
        ss.parse::<f64>().ok()?,
    );
    if hh > 23 || mm > 59 || !(0.0..61.0).contains(&ss) {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + (hh * 3600 + mm * 60) as f64 + ss)
}

fn parse_azure(text: &str) -> Result<Vec<TraceRequest>, String> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    let header: Vec<&str> = lines
        .next()
        .map(|(_, l)| l.split(',').map(str::trim).collect())
        .unwrap_or_default();
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .ok_or(format!("header has no {name} column: {header:?}"))
    };
    let (ct, cc, cg) = (
        col("TIMESTAMP")?,
        col("ContextTokens")?,
        col("GeneratedTokens")?,
    );
    for (i, line) in lines {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        let field = |c: usize| {
            fields.get(c).copied().ok_or(format!(
                "line {n}: {} fields, expected {}",
                fields.len(),
                header.len()
            ))
        };
        let t = parse_timestamp(field(ct)?).ok_or(format!(
            "line {n}: TIMESTAMP {:?} is not YYYY-MM-DD HH:MM:SS.f",
            field(ct)?
        ))?;
        let num = |c: usize, what: &str| -> Result<u32, String> {
            let v = field(c)?;
            v.parse::<u32>()
                .map_err(|_| format!("line {n}: {what} {v:?} is not a token count"))
        };
        let prompt = num(cc, "ContextTokens")?;
        let index = out.len() as u64;
        out.push(TraceRequest {
            arrival_s: t,
            prompt_tokens: prompt,
            output_tokens: num(cg, "GeneratedTokens")?,
            block_ids: unique_ids(index, prompt),
            model: None,
        });
    }
    Ok(out)
}

/// Ids of a prompt shared with nobody (request `index` of a trace without prefix structure).
fn unique_ids(index: u64, prompt: u32) -> Vec<u64> {
    let base = GENERATED_ID_BASE + (index << 16);
    (0..prompt.div_ceil(TRACE_BLOCK_TOKENS) as u64)
        .map(|j| base + j)
        .collect()
}

/// `--models NAME=WEIGHT,...`: the models to give the trace rows that name none, each with a
/// share of the sessions in proportion to its weight.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelMix {
    /// Names and weights, in the order given.
    pub models: Vec<(String, f64)>,
}

impl std::str::FromStr for ModelMix {
    type Err = String;

    fn from_str(v: &str) -> Result<ModelMix, String> {
        let mut models: Vec<(String, f64)> = Vec::new();
        for item in v.split(',') {
            let (name, w) = item
                .trim()
                .rsplit_once('=')
                .ok_or(format!("{item:?}: expected NAME=WEIGHT"))?;
            let name = name.trim();
            if name.is_empty() {
                return Err(format!("{item:?}: empty model name"));
            }
            let w: f64 = w
                .trim()
                .parse()
                .ok()
                .filter(|w: &f64| w.is_finite() && *w > 0.0)
                .ok_or(format!("{item:?}: the weight is not a positive number"))?;
            if models.iter().any(|(n, _)| n == name) {
                return Err(format!("{name:?} given twice"));
            }
            models.push((name.to_string(), w));
        }
        Ok(ModelMix { models })
    }
}

impl ModelMix {
    /// The model for session key `key`: a hash of the key picks by weight, so a key always
    /// gets the same model, whatever else is in the trace.
    pub fn pick(&self, key: u64) -> &str {
        let total: f64 = self.models.iter().map(|m| m.1).sum();
        let mut u = (mix(key ^ 0x6d6f_6465_6c73) >> 11) as f64 / (1u64 << 53) as f64 * total;
        for (name, w) in &self.models {
            if u < *w {
                return name;
            }
            u -= w;
        }
        &self.models.last().expect("a mix has a model").0
    }

    /// Give every request of `requests` (a whole trace) that names no model one from the mix,
    /// per session: its key is the first block id past the prefix EVERY request of the trace
    /// shares (a common system prompt says nothing about the conversation), so requests of
    /// one conversation, which share that block, get one model and keep their prefix reuse.
    /// A request with no block past the common prefix is keyed by its last block.
    pub fn assign(&self, requests: &mut [TraceRequest]) {
        let common = common_prefix_blocks(requests);
        for r in requests.iter_mut().filter(|r| r.model.is_none()) {
            let key = r
                .block_ids
                .get(common)
                .or(r.block_ids.last())
                .copied()
                .unwrap_or(0);
            r.model = Some(self.pick(key).to_string());
        }
    }
}

/// How many leading block ids all requests (with any) have in common.
fn common_prefix_blocks(requests: &[TraceRequest]) -> usize {
    let mut with_ids = requests.iter().filter(|r| !r.block_ids.is_empty());
    let Some(first) = with_ids.next() else {
        return 0;
    };
    let mut n = first.block_ids.len();
    for r in with_ids {
        n = n.min(
            first.block_ids[..n]
                .iter()
                .zip(&r.block_ids)
                .take_while(|(a, b)| a == b)
                .count(),
        );
        if n == 0 {
            break;
        }
    }
    n
}

fn uniform(rng: &mut Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn between(rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as u32
}

fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - uniform(rng)).ln()
}

/// A prompt of `tokens` tokens: the first `stem.len()` blocks from `stem` (when the prompt
/// reaches that far), the rest from `own_base + block index`.
fn ids_of(stem: &[u64], own_base: u64, tokens: u32) -> Vec<u64> {
    (0..tokens.div_ceil(TRACE_BLOCK_TOKENS) as usize)
        .map(|j| stem.get(j).copied().unwrap_or(own_base + j as u64))
        .collect()
}

/// `gen:shared-prefix`: 3,000 requests at 10 per second (Poisson) over 64 groups (Zipf-like
/// popularity). Each group has a system prompt of 4k..16k tokens (whole blocks, 640k tokens
/// in all: more than one replica's KV cache, less than four); each request adds a unique tail
/// of 200..2,000 tokens and asks for 50..400 output tokens.
pub fn shared_prefix(seed: u64) -> Vec<TraceRequest> {
    const GROUPS: usize = 64;
    const REQUESTS: usize = 3000;
    const RATE: f64 = 10.0;
    let mut rng = Rng::new(mix(seed ^ 0x5348_4152_4544));
    let system_blocks: Vec<u32> = (0..GROUPS).map(|_| between(&mut rng, 8, 32)).collect();
    let weights: Vec<f64> = (0..GROUPS).map(|g| 1.0 / (g as f64 + 1.0)).collect();
    let total: f64 = weights.iter().sum();
    let mut t = 0.0;
    let mut out = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        t += exponential(&mut rng, 1.0 / RATE);
        let mut u = uniform(&mut rng) * total;
        let mut g = 0;
        while g + 1 < GROUPS && u >= weights[g] {
            u -= weights[g];
            g += 1;
        }
        let system_base = GENERATED_ID_BASE + ((1 << 40) | ((g as u64) << 16));
        let stem: Vec<u64> = (0..system_blocks[g] as u64)
            .map(|j| system_base + j)
            .collect();
        let tail = between(&mut rng, 200, 2000);
        let prompt = system_blocks[g] * TRACE_BLOCK_TOKENS + tail;
        let own_base = GENERATED_ID_BASE + ((2 << 40) | ((i as u64) << 16));
        out.push(TraceRequest {
            arrival_s: t,
            prompt_tokens: prompt,
            output_tokens: between(&mut rng, 50, 400),
            block_ids: ids_of(&stem, own_base, prompt),
            model: None,
        });
    }
    out
}

/// `gen:agent-sessions`: 320 sessions starting at one per second (Poisson), 3..10 turns each,
/// 8 s between a session's turns on average. Every session starts with the same 2,048-token
/// preamble (tool schemas), then its task (1k..4k tokens); each later turn's prompt is the
/// previous prompt, its answer (50..500 tokens) and a new tool result or message (200..3,000
/// tokens), so a session's history is shared by all its later turns.
pub fn agent_sessions(seed: u64) -> Vec<TraceRequest> {
    const SESSIONS: u64 = 320;
    const PREAMBLE_BLOCKS: u64 = 4;
    const MAX_PROMPT: u32 = 100_000;
    let mut rng = Rng::new(mix(seed ^ 0x4147_454e_5453));
    let preamble: Vec<u64> = (0..PREAMBLE_BLOCKS)
        .map(|j| GENERATED_ID_BASE + (3 << 40) + j)
        .collect();
    let mut out = Vec::new();
    let mut start = 0.0;
    for s in 0..SESSIONS {
        start += exponential(&mut rng, 1.0);
        let own_base = GENERATED_ID_BASE + ((4 << 40) | (s << 20));
        let turns = between(&mut rng, 3, 10);
        let mut prompt =
            PREAMBLE_BLOCKS as u32 * TRACE_BLOCK_TOKENS + between(&mut rng, 1000, 4000);
        let mut t = start;
        for _ in 0..turns {
            let output = between(&mut rng, 50, 500);
            out.push(TraceRequest {
                arrival_s: t,
                prompt_tokens: prompt,
                output_tokens: output,
                block_ids: ids_of(&preamble, own_base, prompt),
                model: None,
            });
            prompt += output + between(&mut rng, 200, 3000);
            if prompt > MAX_PROMPT {
                break;
            }
            t += 1.0 + exponential(&mut rng, 7.0);
        }
    }
    out
}

/// Five requests naming models "a", "b", "nobody" and none, for two replicas (the first
/// serving "a", the second "b" and "a"): the multi-model tests' fleet.
#[cfg(test)]
pub(crate) fn two_model_fixture() -> (Trace, Vec<Vec<String>>) {
    let named = |t: f64, id: u64, m: Option<&str>| TraceRequest {
        arrival_s: t,
        prompt_tokens: 300,
        output_tokens: 2,
        block_ids: vec![id],
        model: m.map(String::from),
    };
    let trace = Trace {
        name: "t".into(),
        requests: vec![
            named(0.0, 1, Some("a")),
            named(1.0, 2, Some("b")),
            named(2.0, 3, Some("nobody")),
            named(3.0, 4, None),
            named(4.0, 5, Some("b")),
        ],
    };
    let serving = vec![
        vec!["a".to_string()],
        vec!["b".to_string(), "a".to_string()],
    ];
    (trace, serving)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_become_requests() {
        let text = "{\"timestamp\": 1500, \"input_length\": 1000, \"output_length\": 7, \"hash_ids\": [0, 5]}\n\
                    \n{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0, 9]}\n";
        let t = parse(text).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].arrival_s, 1.5);
        assert_eq!(t[0].block_ids, vec![0, 5]);
        assert_eq!(t[1].block_ids, vec![0], "ids past the prompt are dropped");
        let mut a = vec![];
        prompt_tokens(&t[0], &mut a);
        let mut b = vec![];
        prompt_tokens(&t[1], &mut b);
        assert_eq!(a.len(), 1000);
        assert_eq!(b.len(), 512);
        assert_eq!(a[..512], b[..], "equal ids give equal tokens");
        assert!(a.iter().all(|&x| x < FIRST_SPECIAL));
    }

    #[test]
    fn prompt_text_is_one_token_per_word_and_shares_like_the_ids() {
        let a = TraceRequest {
            arrival_s: 0.0,
            prompt_tokens: 1000,
            output_tokens: 1,
            block_ids: vec![0, 5],
            model: None,
        };
        let b = TraceRequest {
            prompt_tokens: 700,
            block_ids: vec![0, 6],
            ..a.clone()
        };
        let (mut ta, mut tb) = (String::new(), String::new());
        prompt_text(&a, &mut ta);
        prompt_text(&b, &mut tb);
        assert_eq!(ta.len(), 5000);
        assert_eq!(crate::engine::tokenizer::count_tokens(&ta), 1000);
        assert_eq!(crate::engine::tokenizer::count_tokens(&tb), 700);
        let common = ta
            .bytes()
            .zip(tb.bytes())
            .take_while(|(x, y)| x == y)
            .count();
        assert!(
            (2560..2570).contains(&common),
            "first block shared: {common}"
        );
    }

    #[test]
    fn hostile_files_are_errors_naming_the_line() {
        let short = "{\"timestamp\": 0, \"input_length\": 1025, \"output_length\": 1, \"hash_ids\": [1, 2]}";
        assert!(parse(short)
            .unwrap_err()
            .contains("line 1: input_length 1025 needs 3"));
        let bad = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": -1";
        assert!(parse(bad).unwrap_err().starts_with("line 2:"));
        assert!(parse("hello").unwrap_err().contains("unknown format"));
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,10,x\n";
        assert!(parse(csv)
            .unwrap_err()
            .contains("line 2: GeneratedTokens \"x\""));
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46.5,10,1\n";
        assert!(parse(csv).unwrap_err().contains("line 2: TIMESTAMP"));
        let csv = "TIMESTAMP,ContextTokens\n";
        assert!(parse(csv).unwrap_err().contains("GeneratedTokens"));
        let huge = "{\"timestamp\": 0, \"input_length\": 99999999999, \"output_length\": 1, \"hash_ids\": []}";
        assert!(parse(huge).unwrap_err().contains("too large"));
    }

    #[test]
    fn azure_rows_share_nothing() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                   2023-11-16 18:15:46.6805900,1100,44\n\
                   2023-11-16 18:15:47.1805900,374,5\n";
        let t = parse(csv).unwrap();
        assert_eq!(t.len(), 2);
        assert!((t[1].arrival_s - t[0].arrival_s - 0.5).abs() < 1e-6);
        assert_eq!(t[0].block_ids.len(), 3);
        assert_eq!(t[1].block_ids.len(), 1);
        assert!(t[0].block_ids.iter().all(|id| !t[1].block_ids.contains(id)));
        assert_eq!(parse_timestamp("1970-01-02 00:00:01.5"), Some(86_401.5));
    }

    #[test]
    fn generators_are_deterministic_and_share_prefixes() {
        for spec in ["gen:shared-prefix", "gen:agent-sessions"] {
            let a = load(spec, None, 1).unwrap();
            assert_eq!(a, load(spec, None, 1).unwrap());
            assert_ne!(a, load(spec, None, 2).unwrap());
            assert!(a.requests.len() > 1000, "{spec}: {}", a.requests.len());
            assert!(a
                .requests
                .windows(2)
                .all(|w| w[0].arrival_s <= w[1].arrival_s));
            for r in &a.requests {
                assert_eq!(r.block_ids.len(), r.prompt_tokens.div_ceil(512) as usize);
            }
            assert_eq!(load(spec, Some(10), 1).unwrap().requests.len(), 10);
        }
        // A session's later turn extends its earlier one, token for token.
        let t = agent_sessions(1);
        let first = &t[0];
        let later = t[1..]
            .iter()
            .find(|r| r.block_ids[4] == first.block_ids[4])
            .expect("a second turn");
        let (mut a, mut b) = (vec![], vec![]);
        prompt_tokens(first, &mut a);
        prompt_tokens(later, &mut b);
        assert!(b.len() > a.len());
        assert_eq!(a[..], b[..a.len()]);
    }

    #[test]
    fn model_mixes_parse_and_give_a_session_one_model() {
        let m: ModelMix = "Qwen/Qwen3-8B=0.5, Qwen/Qwen3-0.6B=0.3,sql-lora=0.2"
            .parse()
            .unwrap();
        assert_eq!(m.models.len(), 3);
        assert_eq!(m.models[2], ("sql-lora".to_string(), 0.2));
        for (bad, says) in [
            ("a", "expected NAME=WEIGHT"),
            ("=1", "empty model name"),
            ("a=0", "not a positive number"),
            ("a=x", "not a positive number"),
            ("a=1,a=2", "given twice"),
            ("a=1,", "expected NAME=WEIGHT"),
        ] {
            let e = bad.parse::<ModelMix>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // Shares follow the weights.
        let mut n = [0usize; 3];
        for key in 0..30_000u64 {
            let pick = m.pick(key);
            n[m.models.iter().position(|(x, _)| x == pick).unwrap()] += 1;
        }
        for (i, want) in [0.5, 0.3, 0.2].iter().enumerate() {
            let got = n[i] as f64 / 30_000.0;
            assert!((got - want).abs() < 0.02, "{i}: {got} vs {want}");
        }
        // Every row starts with block 0 (a shared system prompt): the session is keyed by the
        // block after it, so a conversation's turns agree and the trace still spreads.
        let text = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 1, \"hash_ids\": [0, 7]}\n\
                    {\"timestamp\": 1, \"input_length\": 1536, \"output_length\": 1, \"hash_ids\": [0, 7, 8], \"model\": \"own\"}\n\
                    {\"timestamp\": 2, \"input_length\": 1536, \"output_length\": 1, \"hash_ids\": [0, 7, 9]}\n";
        let mut rows = parse(text).unwrap();
        assert_eq!(rows[1].model.as_deref(), Some("own"));
        for k in 0..200u64 {
            rows.push(TraceRequest {
                arrival_s: 3.0,
                prompt_tokens: 1024,
                output_tokens: 1,
                block_ids: vec![0, 100 + k],
                model: None,
            });
        }
        let again = rows.clone();
        m.assign(&mut rows);
        assert_eq!(
            rows[1].model.as_deref(),
            Some("own"),
            "a row's own model stays"
        );
        assert_eq!(rows[0].model, rows[2].model, "one session, one model");
        assert_eq!(rows[0].model.as_deref(), Some(m.pick(7)));
        let names: std::collections::HashSet<_> = rows.iter().map(|r| r.model.clone()).collect();
        assert_eq!(
            names.len(),
            4,
            "all three of the mix and the row's own: {names:?}"
        );
        let mut second = again;
        m.assign(&mut second);
        assert_eq!(rows, second, "reproducible");
        assert!(parse("{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1], \"model\": \" \"}")
            .unwrap_err()
            .contains("line 1: model is empty"));
    }
}
