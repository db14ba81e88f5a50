//! Command-line flags of `kvlb replica` -> a validated `ReplicaFlags`. Pure: no I/O, so every
//! bad flag is tested here. Errors name the flag and the value that was wrong.

use crate::engine::EngineConfig;
use crate::kv_events::EventFormat;
use std::net::SocketAddr;

/// Everything `kvlb replica` was asked to run.
#[derive(Debug, Clone)]
pub struct ReplicaFlags {
    /// Address of replica 0; replica i listens on port + i (or its own ephemeral port when 0).
    pub listen: SocketAddr,
    /// PUB endpoint of replica 0 ("tcp://HOST:PORT"); shifted by i like the listen port.
    pub kv_events: Option<SocketAddr>,
    /// Replay ROUTER endpoint of replica 0; needs `kv_events`.
    pub kv_replay: Option<SocketAddr>,
    pub kv_events_format: EventFormat,
    pub kv_events_topic: String,
    pub count: u32,
    /// Engine seconds per wall second.
    pub time_scale: f64,
    pub model: String,
    pub seed: u64,
    pub engine: EngineConfig,
    /// `--tokenizer PATH`: a Hugging Face tokenizer.json for text prompts (default: the
    /// simulated tokenizer).
    pub tokenizer: Option<String>,
    /// `--chat-template PATH`: tokenizer_config.json or a .jinja template (default: beside
    /// the tokenizer).
    pub chat_template: Option<String>,
}

/// The help text, with the engine's calibrated defaults.
pub fn help() -> String {
    let d = EngineConfig::default();
    format!(
        "usage: kvlb replica --listen ADDR [options]

Simulated GPU replicas that speak vLLM's interfaces (OpenAI HTTP API, /metrics, ZeroMQ KV events).

options:
  --listen ADDR                 HTTP address of replica 0 (e.g. 127.0.0.1:8000; port 0 = ephemeral)
  --count N                     serve N independent replicas on consecutive ports (default 1)
  --kv-events tcp://ADDR        publish KV cache events (ZeroMQ PUB) on ADDR, port shifted per replica
  --kv-replay tcp://ADDR        serve event replay (ZeroMQ ROUTER) on ADDR (needs --kv-events)
  --kv-events-format map|array|map-nil
                                event encoding: map (vLLM >= 0.24, default), array (older),
                                or map-nil (maps with nil keys written out, for decoders that
                                require every key, such as vllm-router's kv_aware)
  --kv-events-topic TOPIC       topic frame of every event message (default empty)
  --time-scale X                engine seconds per wall second (default 1; 100 = 100x faster)
  --model NAME                  served model name (default Qwen/Qwen3-8B)
  --seed N                      seed of response ids and of the engine's block hash ids (default 0)
  --max-model-len N             longest prompt + completion in tokens (default {})
  --kv-capacity-tokens N        KV cache capacity in tokens (default {})
  --block-size N                tokens per KV block (default {})
  --max-num-seqs N              most sequences running at once (default {})
  --max-num-batched-tokens N    tokens scheduled per engine step (default {})
  --prefill-a-s X               prefill step seconds: a + b*new + c*new*context (default {:e})
  --prefill-b-s X               (default {:e})
  --prefill-c-s X               (default {:e})
  --decode-base-s X             decode step seconds: base + per_seq*batch + per_ctx_token*context (default {:e})
  --decode-per-seq-s X          (default {:e})
  --decode-per-ctx-token-s X    (default {:e})
  --host-kv-capacity-tokens N   host-memory KV tier (CPU offloading) in tokens; 0 = none (default {})
  --host-load-s-per-token X     seconds per token to load KV back from the host tier (default {:e})
  --tokenizer PATH              Hugging Face tokenizer.json: text prompts get its ids, chat prompts
                                its chat template's (default: the simulated tokenizer)
  --chat-template PATH          tokenizer_config.json or .jinja (default: beside the tokenizer)
  -h, --help                    this text

On start it prints one line per replica to stderr, `kvlb replica: replica I on HOST:PORT`
(plus ` kv_events=tcp://.. kv_replay=tcp://..` when enabled), then `kvlb replica: ready`.
Replica i listens on port + i (likewise the event ports); port 0 gives each its own.
With a host KV tier every computed block is also kept in host memory (KV events with medium
CPU) and a prefix the GPU evicted is loaded back instead of recomputed.
/metrics reports vllm:time_to_first_token_seconds in engine seconds (wall seconds * time scale).",
        d.max_model_len,
        d.kv_capacity_tokens,
        d.block_size,
        d.max_num_seqs,
        d.max_num_batched_tokens,
        d.prefill_a_s,
        d.prefill_b_s,
        d.prefill_c_s,
        d.decode_base_s,
        d.decode_per_seq_s,
        d.decode_per_ctx_token_s,
        d.host_kv_capacity_tokens,
        d.host_load_s_per_token
    )
}

/// Engine fields and the flags that set them, to name the flag in validation errors.
const ENGINE_FLAGS: [(&str, &str); 13] = [
    ("host_kv_capacity_tokens", "--host-kv-capacity-tokens"),
    ("host_load_s_per_token", "--host-load-s-per-token"),
    ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("kv_capacity_tokens", "--kv-capacity-tokens"),
    ("max_model_len", "--max-model-len"),
    ("max_num_seqs", "--max-num-seqs"),
    ("block_size", "--block-size"),
    ("prefill_a_s", "--prefill-a-s"),
    ("prefill_b_s", "--prefill-b-s"),
    ("prefill_c_s", "--prefill-c-s"),
    ("decode_base_s", "--decode-base-s"),
    ("decode_per_seq_s", "--decode-per-seq-s"),
    ("decode_per_ctx_token_s", "--decode-per-ctx-token-s"),
];

/// What the command line asked for.
#[derive(Debug)]
pub enum Parsed {
    Run(Box<ReplicaFlags>),
    Help,
}

/// Parse `args` (without the `replica` word). `--flag value` and `--flag=value` both work.
pub fn parse(args: &[String]) -> Result<Parsed, String> {
    let mut listen: Option<SocketAddr> = None;
    let mut kv_events = None;
    let mut kv_replay = None;
    let mut flags = ReplicaFlags {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        kv_events: None,
        kv_replay: None,
        kv_events_format: EventFormat::Map,
        kv_events_topic: String::new(),
        count: 1,
        time_scale: 1.0,
        model: "Qwen/Qwen3-8B".to_string(),
        seed: 0,
        engine: EngineConfig::default(),
        tokenizer: None,
        chat_template: None,
    };
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        if arg == "-h" || arg == "--help" {
            return Ok(Parsed::Help);
        }
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        if !name.starts_with("--") {
            return Err(format!(
                "unexpected argument {arg:?} (flags start with --; see --help)"
            ));
        }
        let value = match inline {
            Some(v) => v,
            None => {
                if i >= args.len() {
                    return Err(format!("flag {name} needs a value (see --help)"));
                }
                i += 1;
                args[i - 1].clone()
            }
        };
        let e = &mut flags.engine;
        match name {
            "--listen" => listen = Some(socket_addr(name, &value)?),
            "--kv-events" => kv_events = Some(tcp_endpoint(name, &value)?),
            "--kv-replay" => kv_replay = Some(tcp_endpoint(name, &value)?),
            "--kv-events-format" => {
                flags.kv_events_format = match value.as_str() {
                    "map" => EventFormat::Map,
                    "array" => EventFormat::Array,
                    "map-nil" => EventFormat::MapNil,
                    _ => {
                        return Err(format!(
                            "bad value for {name}: {value:?} (expected map, array or map-nil)"
                        ))
                    }
                }
            }
            "--kv-events-topic" => flags.kv_events_topic = value,
            "--count" => flags.count = int_in(name, &value, 1, 1024)? as u32,
            "--time-scale" => flags.time_scale = positive_f64(name, &value)?,
            "--model" => {
                if value.is_empty() {
                    return Err(format!(
                        "bad value for {name}: {value:?} (expected a model name)"
                    ));
                }
                flags.model = value
            }
            "--tokenizer" => flags.tokenizer = Some(value),
            "--chat-template" => flags.chat_template = Some(value),
            "--seed" => flags.seed = int_in(name, &value, 0, u64::MAX)?,
            "--max-model-len" => e.max_model_len = int_in(name, &value, 1, u32::MAX as u64)? as u32,
            "--kv-capacity-tokens" => e.kv_capacity_tokens = int_in(name, &value, 1, u64::MAX)?,
            "--block-size" => e.block_size = int_in(name, &value, 1, 1 << 16)? as u32,
            "--max-num-seqs" => e.max_num_seqs = int_in(name, &value, 1, u32::MAX as u64)? as u32,
            "--max-num-batched-tokens" => {
                e.max_num_batched_tokens = int_in(name, &value, 1, u32::MAX as u64)? as u32
            }
            "--prefill-a-s" => e.prefill_a_s = nonneg_f64(name, &value)?,
            "--prefill-b-s" => e.prefill_b_s = nonneg_f64(name, &value)?,
            "--prefill-c-s" => e.prefill_c_s = nonneg_f64(name, &value)?,
            "--decode-base-s" => e.decode_base_s = nonneg_f64(name, &value)?,
            "--decode-per-seq-s" => e.decode_per_seq_s = nonneg_f64(name, &value)?,
            "--decode-per-ctx-token-s" => e.decode_per_ctx_token_s = nonneg_f64(name, &value)?,
            "--host-kv-capacity-tokens" => {
                e.host_kv_capacity_tokens = int_in(name, &value, 0, u64::MAX)?
            }
            "--host-load-s-per-token" => e.host_load_s_per_token = nonneg_f64(name, &value)?,
            _ => return Err(format!("unknown flag {name} (see --help)")),
        }
    }
    flags.listen = listen.ok_or_else(|| "missing --listen ADDR (see --help)".to_string())?;
    if flags.chat_template.is_some() && flags.tokenizer.is_none() {
        return Err("--chat-template needs --tokenizer".to_string());
    }
    if kv_replay.is_some() && kv_events.is_none() {
        return Err("--kv-replay needs --kv-events".to_string());
    }
    if flags.engine.kv_capacity_tokens < flags.engine.block_size as u64 {
        return Err(format!(
            "bad value for --kv-capacity-tokens: {} (less than one block of {} tokens)",
            flags.engine.kv_capacity_tokens, flags.engine.block_size
        ));
    }
    let host = flags.engine.host_kv_capacity_tokens;
    if host > 0 && host < flags.engine.block_size as u64 {
        return Err(format!(
            "bad value for --host-kv-capacity-tokens: {host} (less than one block of {} tokens; 0 turns the host tier off)",
            flags.engine.block_size
        ));
    }
    if let Err(e) = flags.engine.validate() {
        let named: Vec<&str> = ENGINE_FLAGS
            .iter()
            .filter(|(f, _)| names_field(&e, f))
            .map(|(_, flag)| *flag)
            .collect();
        return Err(format!("invalid engine flags ({}): {e}", named.join(", ")));
    }
    flags.kv_events = kv_events;
    flags.kv_replay = kv_replay;
    for (name, addr) in [
        ("--listen", Some(flags.listen)),
        ("--kv-events", kv_events),
        ("--kv-replay", kv_replay),
    ] {
        if let Some(a) = addr {
            if a.port() != 0 && a.port() as u32 + flags.count - 1 > 65_535 {
                return Err(format!(
                    "bad value for {name}: {a} (port + --count {} runs past 65535)",
                    flags.count
                ));
            }
        }
    }
    // Port runs of different sockets must not overlap (e.g. --kv-events :5557 --kv-replay :5558
    // with --count 2 would give replica 1 the replay port of replica 0).
    let runs = [
        ("--listen", Some(flags.listen)),
        ("--kv-events", kv_events),
        ("--kv-replay", kv_replay),
    ];
    for (i, (name_a, a)) in runs.iter().enumerate() {
        for (name_b, b) in runs.iter().skip(i + 1) {
            let (Some(a), Some(b)) = (a, b) else { continue };
            if a.port() == 0 || b.port() == 0 {
                continue;
            }
            let (pa, pb) = (a.port() as u32, b.port() as u32);
            if pa < pb + flags.count && pb < pa + flags.count {
                return Err(format!(
                    "bad value for {name_b}: {b} (ports {pb}..{} overlap {name_a} ports {pa}..{} with --count {})",
                    pb + flags.count - 1,
                    pa + flags.count - 1,
                    flags.count
                ));
            }
        }
    }
    Ok(Parsed::Run(Box::new(flags)))
}

/// Whether `message` names `field` as a whole word (kv_capacity_tokens is not named by
/// host_kv_capacity_tokens).
fn names_field(message: &str, field: &str) -> bool {
    message.match_indices(field).any(|(at, _)| {
        let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
        !message[..at].ends_with(word) && !message[at + field.len()..].starts_with(word)
    })
}

fn socket_addr(name: &str, value: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = value.parse::<SocketAddr>() {
        return Ok(a);
    }
    // "localhost:8000" and other host names: resolve once at start-up.
    use std::net::ToSocketAddrs;
    match value.to_socket_addrs() {
        Ok(mut it) => it
            .next()
            .ok_or_else(|| format!("bad value for {name}: {value:?} (no address)")),
        Err(_) => Err(format!(
            "bad value for {name}: {value:?} (expected HOST:PORT)"
        )),
    }
}

fn tcp_endpoint(name: &str, value: &str) -> Result<SocketAddr, String> {
    let Some(rest) = value.strip_prefix("tcp://") else {
        return Err(format!(
            "bad value for {name}: {value:?} (expected tcp://HOST:PORT)"
        ));
    };
    // vLLM configs say tcp://*:5557; bind all interfaces then.
    let rest = match rest.strip_prefix("*:") {
        Some(port) => format!("0.0.0.0:{port}"),
        None => rest.to_string(),
    };
    socket_addr(name, &rest)
        .map_err(|_| format!("bad value for {name}: {value:?} (expected tcp://HOST:PORT)"))
}

fn int_in(name: &str, value: &str, min: u64, max: u64) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(v) if v >= min && v <= max => Ok(v),
        _ => Err(format!(
            "bad value for {name}: {value:?} (expected an integer in {min}..={max})"
        )),
    }
}

fn positive_f64(name: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "bad value for {name}: {value:?} (expected a number > 0)"
        )),
    }
}

fn nonneg_f64(name: &str, value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "bad value for {name}: {value:?} (expected a number >= 0)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<ReplicaFlags, String> {
        let v: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        match parse(&v)? {
            Parsed::Run(f) => Ok(*f),
            Parsed::Help => Err("help".into()),
        }
    }

    #[test]
    fn parses_every_flag_form() {
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--count=4",
            "--kv-events",
            "tcp://127.0.0.1:5557",
            "--kv-replay=tcp://127.0.0.1:6557",
            "--kv-events-format",
            "array",
            "--time-scale",
            "100",
            "--block-size",
            "32",
            "--prefill-b-s",
            "1e-5",
        ])
        .unwrap();
        assert_eq!(f.count, 4);
        assert_eq!(f.kv_events.unwrap().port(), 5557);
        assert_eq!(f.kv_replay.unwrap().port(), 6557);
        assert_eq!(f.kv_events_format, EventFormat::Array);
        assert_eq!(f.time_scale, 100.0);
        assert_eq!(f.engine.block_size, 32);
        assert_eq!(f.engine.prefill_b_s, 1e-5);
        assert_eq!(
            f.engine.host_kv_capacity_tokens, 0,
            "no host tier by default"
        );
        let f = run(&[
            "--listen",
            "127.0.0.1:0",
            "--host-kv-capacity-tokens",
            "3200000",
            "--host-load-s-per-token=2e-6",
        ])
        .unwrap();
        assert_eq!(f.engine.host_kv_capacity_tokens, 3_200_000);
        assert_eq!(f.engine.host_load_s_per_token, 2e-6);
        let f = run(&["--listen", "127.0.0.1:0", "--kv-events-format=map-nil"]).unwrap();
        assert_eq!(f.kv_events_format, EventFormat::MapNil);
        let f = run(&["--listen", "127.0.0.1:0", "--kv-events", "tcp://*:7000"]).unwrap();
        assert_eq!(f.kv_events.unwrap().to_string(), "0.0.0.0:7000");
    }

    #[test]
    fn errors_name_flag_and_value() {
        let e = run(&["--listen", "127.0.0.1:0", "--count", "zero"]).unwrap_err();
        assert!(e.contains("--count") && e.contains("zero"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--time-scale", "-1"]).unwrap_err();
        assert!(e.contains("--time-scale") && e.contains("-1"), "{e}");
        let e = run(&["--listen", "nowhere"]).unwrap_err();
        assert!(e.contains("--listen") && e.contains("nowhere"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--kv-events", "127.0.0.1:1"]).unwrap_err();
        assert!(e.contains("--kv-events"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--bogus", "1"]).unwrap_err();
        assert!(e.contains("--bogus"), "{e}");
        let e = run(&["--listen", "127.0.0.1:0", "--kv-events-format", "xml"]).unwrap_err();
        assert!(e.contains("xml"), "{e}");
        let e = run(&["--listen", "127.0.0.1:65535", "--count", "2"]).unwrap_err();
        assert!(e.contains("65535"), "{e}");
        assert!(run(&["--count", "2"]).unwrap_err().contains("--listen"));
        assert!(run(&["--listen"]).unwrap_err().contains("needs a value"));
        assert!(matches!(parse(&["--help".to_string()]), Ok(Parsed::Help)));
        let e = run(&[
            "--listen",
            "127.0.0.1:0",
            "--max-num-seqs",
            "512",
            "--max-num-batched-tokens",
            "100",
        ])
        .unwrap_err();
        assert!(
            e.contains("--max-num-batched-tokens") && e.contains("100"),
            "{e}"
        );
        assert!(help().contains("--decode-per-ctx-token-s"));
        assert!(help().contains("--host-kv-capacity-tokens"));
        let e = run(&["--listen", "127.0.0.1:0", "--host-kv-capacity-tokens", "8"]).unwrap_err();
        assert!(
            e.contains("--host-kv-capacity-tokens") && e.contains('8'),
            "{e}"
        );
        let e = run(&["--listen", "127.0.0.1:0", "--host-load-s-per-token", "-1"]).unwrap_err();
        assert!(e.contains("--host-load-s-per-token"), "{e}");
        let e = run(&[
            "--listen",
            "127.0.0.1:0",
            "--host-kv-capacity-tokens",
            "999999999999999",
        ])
        .unwrap_err();
        assert!(e.contains("--host-kv-capacity-tokens"), "{e}");
        assert!(!e.contains(" --kv-capacity-tokens"), "{e}");
        let e = run(&[
            "--listen",
            "127.0.0.1:8000",
            "--count",
            "2",
            "--kv-events",
            "tcp://127.0.0.1:5557",
            "--kv-replay",
            "tcp://127.0.0.1:5558",
        ])
        .unwrap_err();
        assert!(e.contains("--kv-replay") && e.contains("overlap"), "{e}");
        assert!(run(&[
            "--listen",
            "127.0.0.1:8000",
            "--count",
            "2",
            "--kv-events",
            "tcp://127.0.0.1:8002"
        ])
        .is_ok());
    }
}
