//! `kvlb serve` settings: flags, the TOML file, their errors and their layering.

#![forbid(unsafe_code)]

use super::*;

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(String::from).collect()
}

#[test]
fn tokenizer_and_chat_template_load_from_flags_and_file() {
    let dir = std::env::temp_dir().join(format!("kvlb-config-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    crate::tokenize::fixture::write_chatml(&dir).unwrap();
    let tok = dir.join("tokenizer.json").display().to_string();
    let c = from_args(&args(&format!("--listen 127.0.0.1:0 --tokenizer {tok}"))).unwrap();
    assert!(c.token_mode.as_ref().unwrap().0.has_chat_template());
    let file = dir.join("kvlb.toml");
    std::fs::write(
        &file,
        format!(
            "listen = [\"127.0.0.1:0\"]\ntokenizer = {tok:?}\nchat_template = {:?}\n",
            dir.join("tokenizer_config.json").display().to_string()
        ),
    )
    .unwrap();
    let c = from_args(&args(&format!("--config {}", file.display()))).unwrap();
    assert!(c.token_mode.is_some());
    let e = from_args(&args("--listen 127.0.0.1:0 --chat-template x.json"))
        .unwrap_err()
        .unwrap();
    assert!(
        e.0.contains("chat_template") && e.0.contains("needs tokenizer"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flags() {
    let c = from_args(&args("--listen 127.0.0.1:0 --replica http://127.0.0.1:8000 --replica http://127.0.0.1:8001/ --policy least_loaded --workers 2 --cores 0-1 --client-timeout 500ms --max-body-bytes 8MiB")).unwrap();
    assert_eq!(c.replicas.len(), 2);
    assert_eq!(c.replicas[1].url, "http://127.0.0.1:8001/");
    assert_eq!(c.replicas[1].addr, "127.0.0.1:8001".parse().unwrap());
    assert_eq!(c.policy, PolicyName::LeastLoaded);
    assert_eq!(c.timeouts.client, Duration::from_millis(500));
    assert_eq!(c.limits.max_body_bytes, 8 << 20);
    assert_eq!(c.cores, Some(vec![0, 1]));
}

#[test]
fn errors_name_key_and_value() {
    let e = from_args(&args("--listen 127.0.0.1:0 --policy fastest"))
        .unwrap_err()
        .unwrap();
    assert!(e.0.contains("--policy") && e.0.contains("fastest"), "{e}");
    let e = from_args(&args("--listen 127.0.0.1:0 --replica ftp://x"))
        .unwrap_err()
        .unwrap();
    assert!(e.0.contains("--replica") && e.0.contains("ftp://x"), "{e}");
    let e = from_args(&args("--listen nowhere")).unwrap_err().unwrap();
    assert!(e.0.contains("nowhere"), "{e}");
    let e = from_args(&args("--listen 127.0.0.1:0 --cores 3-1"))
        .unwrap_err()
        .unwrap();
    assert!(e.0.contains("--cores") && e.0.contains("3-1"), "{e}");
    let e = from_args(&args("--listen 127.0.0.1:0 --client-timeout forever"))
        .unwrap_err()
        .unwrap();
    assert!(
        e.0.contains("--client-timeout") && e.0.contains("forever"),
        "{e}"
    );
}

#[test]
fn replica_kv_events() {
    let c = from_args(&args("--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557,kv_replay=tcp://localhost:5558,kv_capacity_tokens=1000 --metrics-interval 250ms --telemetry-stale-after 5s")).unwrap();
    let r = &c.replicas[0];
    assert_eq!(r.kv_events.as_deref(), Some("tcp://127.0.0.1:5557"));
    assert_eq!(r.kv_replay.as_deref(), Some("tcp://localhost:5558"));
    assert_eq!(r.kv_capacity_tokens, 1000);
    assert_eq!(c.telemetry.metrics_interval, Duration::from_millis(250));
    assert_eq!(c.telemetry.stale_after, Duration::from_secs(5));
    assert!(r.scrape_metrics());
    let c = from_args(&args(
        "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000 --replica http://127.0.0.1:8001,metrics=on",
    ))
    .unwrap();
    assert!(!c.replicas[0].scrape_metrics() && c.replicas[1].scrape_metrics());
    let e = from_args(&args(
        "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,metrics=sometimes",
    ))
    .unwrap_err()
    .unwrap();
    assert!(e.0.contains("metrics") && e.0.contains("sometimes"), "{e}");
    for bad_value in [
        "ipc:///tmp/x",
        "tcp://127.0.0.1",
        "tcp://:5557",
        "tcp://h:0",
        "tcp://h:99999",
    ] {
        let e = from_args(&args(&format!(
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_events={bad_value}"
        )))
        .unwrap_err()
        .unwrap();
        assert!(e.0.contains("kv_events") && e.0.contains(bad_value), "{e}");
    }
    let e = from_args(&args(
        "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_replay=tcp://h:1",
    ))
    .unwrap_err()
    .unwrap();
    assert!(
        e.0.contains("kv_replay") && e.0.contains("tcp://h:1"),
        "{e}"
    );
    // An option given twice is refused, not the last one kept.
    let e = from_args(&args(
        "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,kv_events=tcp://h:5557,kv_events=tcp://h:5558",
    ))
    .unwrap_err()
    .unwrap();
    assert!(e.0.contains("\"kv_events\" given twice"), "{e}");

    let mut c = ServeConfig::default();
    apply_toml(&mut c, "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_events = \"tcp://127.0.0.1:5557\"\nkv_replay = \"tcp://127.0.0.1:5558\"\nkv_capacity_tokens = 2048\n").unwrap();
    assert_eq!(
        c.replicas[0].kv_events.as_deref(),
        Some("tcp://127.0.0.1:5557")
    );
    assert_eq!(
        c.replicas[0].kv_replay.as_deref(),
        Some("tcp://127.0.0.1:5558")
    );
    assert_eq!(c.replicas[0].kv_capacity_tokens, 2048);
    apply_toml(
        &mut c,
        "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nmetrics = true\n",
    )
    .unwrap();
    assert!(c.replicas[0].scrape_metrics());
    let e = apply_toml(
        &mut c,
        "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_events = \"udp://x:1\"\n",
    )
    .unwrap_err();
    assert!(
        e.0.contains("replica[0].kv_events") && e.0.contains("udp://x:1"),
        "{e}"
    );
    let e = apply_toml(
        &mut c,
        "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_events = 5\n",
    )
    .unwrap_err();
    assert!(e.0.contains("replica[0].kv_events"), "{e}");
}

#[test]
fn every_policy_name_parses() {
    for name in PolicyName::NAMES.split(", ") {
        let p = PolicyName::parse(name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(p.as_str(), name);
    }
}

#[test]
fn example_file_is_valid() {
    let mut c = ServeConfig::default();
    apply_toml(&mut c, include_str!("../../systemd/kvlb.toml")).unwrap();
    assert_eq!(c.replicas.len(), 2);
    assert_eq!(c.listen.len(), 1);
}

#[test]
fn listener_modes() {
    let c = from_args(&args(
        "--listen 127.0.0.1:0 --listen 127.0.0.1:1 --mode l4 --l4-forwarding sockmap",
    ))
    .unwrap();
    assert_eq!(c.listen_modes, vec![ListenerMode::L4, ListenerMode::L4]);
    assert_eq!(c.l4_forwarding, L4Forwarding::Sockmap);
    let c = from_args(&args("--listen 127.0.0.1:0")).unwrap();
    assert_eq!(c.listener_mode(0), ListenerMode::L7);
    assert_eq!(c.l4_forwarding, L4Forwarding::Splice);
    let e = from_args(&args("--listen 127.0.0.1:0 --mode l5"))
        .unwrap_err()
        .unwrap();
    assert!(e.0.contains("--mode") && e.0.contains("l5"), "{e}");
    let e = from_args(&args("--listen 127.0.0.1:0 --l4-forwarding zerocopy"))
        .unwrap_err()
        .unwrap();
    assert!(
        e.0.contains("--l4-forwarding") && e.0.contains("zerocopy"),
        "{e}"
    );
    assert!(from_args(&args("--mode l4")).is_err());

    let mut c = ServeConfig::default();
    apply_toml(
        &mut c,
        "listen = [\"127.0.0.1:8000\"]\nl4_forwarding = \"sockmap\"\n[[listener]]\naddress = \"127.0.0.1:8001\"\nmode = \"l4\"\n[[listener]]\naddress = \"127.0.0.1:8002\"\n",
    )
    .unwrap();
    assert_eq!(c.listen.len(), 3);
    assert_eq!(
        c.listen_modes,
        vec![ListenerMode::L7, ListenerMode::L4, ListenerMode::L7]
    );
    assert_eq!(c.listen[1], "127.0.0.1:8001".parse().unwrap());
    assert_eq!(c.l4_forwarding, L4Forwarding::Sockmap);
    let e = apply_toml(
        &mut c,
        "[[listener]]\naddress = \"127.0.0.1:1\"\nmode = \"l3\"\n",
    )
    .unwrap_err();
    assert!(
        e.0.contains("listener[0].mode") && e.0.contains("l3"),
        "{e}"
    );
    let e = apply_toml(&mut c, "l4_forwarding = \"dma\"").unwrap_err();
    assert!(e.0.contains("l4_forwarding") && e.0.contains("dma"), "{e}");
    let e = apply_toml(&mut c, "[[listener]]\nmode = \"l4\"\n").unwrap_err();
    assert!(
        e.0.contains("listener[0]") && e.0.contains("address"),
        "{e}"
    );
    let e = apply_toml(
        &mut c,
        "[[listener]]\naddress = \"127.0.0.1:1\"\nport = 3\n",
    )
    .unwrap_err();
    assert!(e.0.contains("listener[0].port"), "{e}");
    // Flags replace the file's listeners, with their own mode.
    let dir = std::env::temp_dir().join(format!("kvlb-cfg-modes-{}", std::process::id()));
    std::fs::write(
        &dir,
        "[[listener]]\naddress = \"127.0.0.1:8001\"\nmode = \"l4\"\n",
    )
    .unwrap();
    let c = from_args(&args(&format!("--config {}", dir.display()))).unwrap();
    assert_eq!(c.listener_mode(0), ListenerMode::L4);
    let c = from_args(&args(&format!(
        "--config {} --listen 127.0.0.1:0",
        dir.display()
    )))
    .unwrap();
    assert_eq!(c.listener_mode(0), ListenerMode::L7);
    let _ = std::fs::remove_file(&dir);
}

#[test]
fn toml_file() {
    let mut c = ServeConfig::default();
    apply_toml(&mut c, "listen = [\"127.0.0.1:0\"]\npolicy = \"power_of_two\"\nclient_timeout = \"5s\"\nworkers = 1\n[[replica]]\nurl = \"http://127.0.0.1:9000\"\n[[replica]]\nurl = \"http://localhost:9001\"\n").unwrap();
    assert_eq!(c.policy, PolicyName::PowerOfTwo);
    assert_eq!(c.replicas.len(), 2);
    assert_eq!(c.workers, 1);
    let e = apply_toml(&mut c, "policy = \"x\"").unwrap_err();
    assert!(e.0.contains("policy") && e.0.contains("\"x\""), "{e}");
    let e = apply_toml(&mut c, "[[replica]]\nurl = \"http://a:b:c\"").unwrap_err();
    assert!(e.0.contains("replica[0].url"), "{e}");
    let e = apply_toml(&mut c, "bogus = 1").unwrap_err();
    assert!(e.0.contains("bogus"), "{e}");
}

#[test]
fn cost_model_settings() {
    let mut c = ServeConfig::default();
    apply_toml(
        &mut c,
        "[cost_model]\nforeign_request_tokens = 2048\nprefill_s_per_token = 0.00006\ndecode_step_s = 0.004\n",
    )
    .unwrap();
    let p = c.cost_model.policy_config();
    let d = crate::select::CacheAwareConfig::default();
    assert_eq!(p.foreign_request_tokens, 2048);
    // Twice as slow a prefill: every prefill term doubles; half the decode step: every
    // decode term halves; the token counts stay.
    assert_eq!(p.model.prefill.b, 0.00006);
    assert!((p.model.prefill.a - 2.0 * d.model.prefill.a).abs() < 1e-12);
    assert!((p.model.prefill.c - 2.0 * d.model.prefill.c).abs() < 1e-18);
    assert_eq!(p.model.decode.base, 0.004);
    assert!((p.model.decode.per_seq - 0.5 * d.model.decode.per_seq).abs() < 1e-12);
    assert_eq!(p.model.prefill.chunk_tokens, d.model.prefill.chunk_tokens);
    // The fixed parameters keep their defaults.
    assert_eq!(p.recompute_weight, d.recompute_weight);
    assert_eq!(p.kv_evict_from, d.kv_evict_from);
    // The defaults are the policy's own.
    assert_eq!(ServeConfig::default().cost_model.policy_config(), d);
    let e = apply_toml(&mut c, "[cost_model]\nprefill_s_per_token = -1\n").unwrap_err();
    assert!(
        e.0.contains("prefill_s_per_token") && e.0.contains("-1"),
        "{e}"
    );
    // A parameter that is fixed is not a setting.
    let e = apply_toml(&mut c, "[cost_model]\nrecompute_weight = 3\n").unwrap_err();
    assert!(e.0.contains("recompute_weight"), "{e}");
    let base = "--listen 127.0.0.1:0 --replica http://127.0.0.1:9000";
    let c = from_args(&args(&format!(
        "{base} --decode-step-s 0.01 --splice-responses-from 4MiB"
    )))
    .unwrap();
    assert_eq!(c.cost_model.decode_step_s, 0.01);
    assert_eq!(c.splice_responses_from, 4 << 20);
    let c = from_args(&args(&format!("{base} --splice-responses-from off"))).unwrap();
    assert_eq!(c.splice_responses_from, 0);
    assert!(from_args(&args(&format!("{base} --splice-responses-from lots"))).is_err());
}

#[test]
fn offload_tier_keys() {
    let mut c = ServeConfig::default();
    assert_eq!(c.cost_model.offload_load_cost, 0.25);
    apply_toml(
        &mut c,
        "[cost_model]\noffload_load_cost = 0.5\n[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_capacity_tokens = 1000\n[[replica]]\nurl = \"http://127.0.0.1:9001\"\nkv_capacity_tokens = 1000\nkv_offload_capacity_tokens = 3000\n",
    )
    .unwrap();
    assert_eq!(c.cost_model.policy_config().offload_load_cost, 0.5);
    assert_eq!(c.replicas[0].kv_offload_capacity_tokens, None);
    assert_eq!(c.replicas[0].offload_capacity_tokens(), 8000);
    assert_eq!(c.replicas[1].offload_capacity_tokens(), 3000);
    for bad in ["1.5", "-0.1", "\"cheap\""] {
        let e = apply_toml(
            &mut c,
            &format!("[cost_model]\noffload_load_cost = {bad}\n"),
        )
        .unwrap_err();
        assert!(e.0.contains("cost_model.offload_load_cost"), "{e}");
    }
    let e = apply_toml(
        &mut c,
        "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nkv_offload_capacity_tokens = 0\n",
    )
    .unwrap_err();
    assert!(e.0.contains("replica[0].kv_offload_capacity_tokens"), "{e}");
    let base = "--listen 127.0.0.1:0 --replica http://127.0.0.1:9000,kv_offload_capacity_tokens=";
    let c = from_args(&args(&format!("{base}4096 --offload-load-cost 1"))).unwrap();
    assert_eq!(c.replicas[0].offload_capacity_tokens(), 4096);
    assert_eq!(c.cost_model.offload_load_cost, 1.0);
    let e = from_args(&args(&format!("{base}lots")))
        .unwrap_err()
        .unwrap();
    assert!(e.0.contains("kv_offload_capacity_tokens"), "{e}");
    let e = from_args(&args(&format!("{base}1 --offload-load-cost 2")))
        .unwrap_err()
        .unwrap();
    assert!(e.0.contains("--offload-load-cost"), "{e}");
}

/// The example shipped for systemd parses and means what its comments say.
#[test]
fn systemd_example_parses() {
    let mut c = ServeConfig::default();
    apply_toml(&mut c, include_str!("../../systemd/kvlb.toml")).unwrap();
    assert_eq!(c.policy, PolicyName::CacheAware);
    assert_eq!(c.replicas.len(), 2);
    assert!(c.replicas[0].kv_events.is_some());
    assert_eq!(c.health.retries, 1);
}

/// Every file key is a flag or a documented file-only key, and every flag a file key or one of
/// the two flags without one (`--config`, `--mode`): a setting cannot exist in one place only
/// by accident.
#[test]
fn flags_and_file_keys_are_one_declaration() {
    use clap::{Args, CommandFactory};
    let file_only: Vec<&str> = settings::FILE_ONLY.iter().map(|(k, _)| *k).collect();
    let cmd = ServeSettings::command();
    let flags: Vec<String> = cmd
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .filter(|id| id != "help")
        .collect();
    let cost_cmd = settings::CostSettings::augment_args(clap::Command::new("cost"));
    let cost: Vec<String> = cost_cmd
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    let keys = settings::serde_fields::<ServeSettings>();
    let cost_keys = settings::serde_fields::<settings::CostSettings>();
    assert!(
        keys.len() > 40 && cost_keys.len() >= 4,
        "{keys:?} {cost_keys:?}"
    );
    for k in keys {
        assert!(
            *k == "cost_model" || file_only.contains(k) || flags.iter().any(|f| f == k),
            "file key {k} has no flag and is not documented as file-only"
        );
    }
    for k in cost_keys {
        assert!(cost.iter().any(|f| f == k), "[cost_model] {k} has no flag");
    }
    for f in &flags {
        assert!(
            keys.contains(&f.as_str())
                || cost_keys.contains(&f.as_str())
                || settings::FLAG_ONLY.contains(&f.as_str()),
            "flag --{f} has no file key"
        );
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == f.as_str())
            .unwrap();
        assert!(
            arg.get_help().is_some_and(|h| h.to_string().len() > 10),
            "flag --{f} has no help"
        );
    }
    for k in &file_only {
        assert!(
            keys.contains(k),
            "FILE_ONLY names {k}, which the file does not read"
        );
    }
    // A [[model]] table's keys are its declaration's (cost_model: an inline [cost_model]).
    let table: Vec<String> = settings::ModelTable::augment_args(clap::Command::new("model"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    let table_keys = settings::serde_fields::<settings::ModelTable>();
    assert!(table_keys.len() >= 5, "{table_keys:?}");
    for k in table_keys {
        assert!(
            *k == "cost_model" || table.iter().any(|f| f == k),
            "[[model]] key {k} has no declaration"
        );
    }
}

/// A "(default: X)" in a flag's help is the default: giving X changes nothing.
#[test]
fn defaults_in_the_help_are_the_defaults() {
    use clap::CommandFactory;
    let base = from_args(&args("--listen 127.0.0.1:0")).unwrap();
    let mut checked = 0;
    for a in ServeSettings::command().get_arguments() {
        let Some(long) = a.get_long() else { continue };
        let help = a.get_long_help().or(a.get_help()).unwrap().to_string();
        let Some(at) = help.find("(default: ") else {
            continue;
        };
        let value = help[at + 10..].split([')', ',']).next().unwrap();
        if value.contains(' ') {
            continue; // a description, not a value
        }
        let given = from_args(&[
            "--listen".to_string(),
            "127.0.0.1:0".to_string(),
            format!("--{long}={value}"),
        ])
        .unwrap_or_else(|e| panic!("--{long}={value}: {e:?}"));
        assert_eq!(
            given, base,
            "--{long}: the help says the default is {value}"
        );
        checked += 1;
    }
    assert!(checked >= 40, "{checked} defaults checked");
}

/// The file, the environment and the flags layer in that order.
#[test]
fn flags_win_over_the_file() {
    let dir = std::env::temp_dir().join(format!("kvlb-cfg-layers-{}", std::process::id()));
    std::fs::write(
        &dir,
        "listen = \"127.0.0.1:0\"\npolicy = \"random\"\nworkers = 3\n[cost_model]\ndecode_step_s = 0.01\n",
    )
    .unwrap();
    let c = from_args(&args(&format!(
        "--config {} --policy round_robin --decode-step-s 0.02",
        dir.display()
    )))
    .unwrap();
    assert_eq!(c.policy, PolicyName::RoundRobin);
    assert_eq!(c.workers, 3);
    assert_eq!(c.cost_model.decode_step_s, 0.02);
    // A flag given twice: the last wins.
    let c = from_args(&args(
        "--listen 127.0.0.1:0 --policy random --policy round_robin",
    ))
    .unwrap();
    assert_eq!(c.policy, PolicyName::RoundRobin);
    let _ = std::fs::remove_file(&dir);
}

/// docs/configuration.md holds the reference generated from the declaration, unchanged.
#[test]
fn reference_is_current() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let begin = doc.find("<!-- BEGIN settings").expect("BEGIN marker");
    let begin = begin + doc[begin..].find("-->\n").unwrap() + 4;
    let end = doc.find("<!-- END settings -->").expect("END marker");
    let want = reference_markdown();
    if doc[begin..end] != want {
        if std::env::var_os("KVLB_BLESS").is_some() {
            std::fs::write(path, format!("{}{want}{}", &doc[..begin], &doc[end..])).unwrap();
            return;
        }
        panic!("docs/configuration.md is out of date: KVLB_BLESS=1 cargo test --release --lib reference_is_current rewrites it");
    }
}

/// The replica options are declared once (`values::replica_options!`): the flag's options and
/// the file's keys read the same values into the same replica, and the help and the reference
/// list every one.
#[test]
fn replica_options_flag_file_help_and_reference_agree() {
    let samples = [
        ("kv_capacity_tokens", "1000"),
        ("kv_offload_capacity_tokens", "3000"),
        ("kv_events", "tcp://127.0.0.1:5557"),
        ("kv_replay", "tcp://127.0.0.1:5558"),
        ("metrics", "on"),
        ("max_in_flight", "7"),
        ("dp_size", "2"),
        ("models", "big|small"),
        ("role", "prefill"),
        ("bootstrap_port", "8998"),
    ];
    let help = replica_flag_help();
    let reference = reference_markdown();
    for o in REPLICA_OPTIONS {
        let (_, v) = samples
            .iter()
            .find(|(k, _)| *k == o.name)
            .unwrap_or_else(|| panic!("no sample value for replica option {}", o.name));
        // Replay needs an event stream to fill.
        let (with_flag, with_key) = match o.name {
            "kv_replay" => (
                ",kv_events=tcp://127.0.0.1:5557",
                "kv_events = \"tcp://127.0.0.1:5557\"\n",
            ),
            // A bootstrap server is a prefill replica's.
            "bootstrap_port" => (",role=prefill", "role = \"prefill\"\n"),
            _ => ("", ""),
        };
        let flag = parse_replica_flag(
            "",
            &format!("http://127.0.0.1:9000,{}={v}{with_flag}", o.name),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", o.name));
        let mut c = ServeConfig::default();
        apply_toml(
            &mut c,
            &format!(
                "[[replica]]\nurl = \"http://127.0.0.1:9000\"\n{} = \"{v}\"\n{with_key}",
                o.name
            ),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", o.name));
        let file = c.replicas[0].clone();
        assert_eq!(c.replicas, flag.ranks(), "{}", o.name);
        assert_ne!(
            file,
            parse_replica_url("", "http://127.0.0.1:9000").unwrap(),
            "{}",
            o.name
        );
        assert!(help.contains(&format!("{}={}", o.name, o.value)), "{help}");
        assert!(
            reference.contains(&format!("`[[replica]]` `{}`", o.name)),
            "reference lacks {}",
            o.name
        );
    }
    let e = parse_replica_flag("", "http://127.0.0.1:9000,kv_capacity=5").unwrap_err();
    assert!(
        e.0.contains("unknown replica option \"kv_capacity\"") && e.0.contains("dp_size"),
        "{e}"
    );
}

/// `dp_size=N`: N replicas, one per rank, named URL#r, events on the ports + r, capacity and
/// limits each rank's; bad values name the option.
#[test]
fn dp_size_expands_into_ranks() {
    let c = from_args(&args("--listen 127.0.0.1:0 --replica http://127.0.0.1:8000/,kv_events=tcp://h:5557,kv_replay=tcp://h:5600,dp_size=3,kv_capacity_tokens=1000,max_in_flight=4")).unwrap();
    assert_eq!(c.replicas.len(), 3);
    for (r, rep) in c.replicas.iter().enumerate() {
        assert_eq!(rep.url, format!("http://127.0.0.1:8000#{r}"));
        assert_eq!(rep.dp_rank, Some(r as u32));
        assert_eq!(
            rep.kv_events.as_deref(),
            Some(format!("tcp://h:{}", 5557 + r).as_str())
        );
        assert_eq!(
            rep.kv_replay.as_deref(),
            Some(format!("tcp://h:{}", 5600 + r).as_str())
        );
        assert_eq!(rep.kv_capacity_tokens, 1000);
        assert_eq!(rep.max_in_flight, Some(4));
        assert_eq!(rep.addr, "127.0.0.1:8000".parse().unwrap());
        assert_eq!(rep.base_url(), "http://127.0.0.1:8000");
    }
    let mut f = ServeConfig::default();
    apply_toml(
        &mut f,
        "[[replica]]\nurl = \"http://127.0.0.1:8000\"\ndp_size = 2\n",
    )
    .unwrap();
    assert_eq!(f.replicas.len(), 2);
    assert_eq!(f.replicas[1].url, "http://127.0.0.1:8000#1");
    assert_eq!(f.replicas[1].kv_events, None);

    for (bad, want) in [
        (
            "dp_size=0",
            "dp_size = \"0\": expected a whole number from 1 to 64",
        ),
        (
            "dp_size=65",
            "dp_size = \"65\": expected a whole number from 1 to 64",
        ),
        ("dp_size=two", "dp_size = \"two\""),
        (
            "role=primary",
            "role = \"primary\": expected prefill, decode or both",
        ),
        (
            "bootstrap_port=8998",
            "bootstrap_port = \"8998\": only a replica of role=prefill has a bootstrap server",
        ),
        (
            "role=prefill,bootstrap_port=0",
            "bootstrap_port = \"0\": expected a whole number from 1 to 65535",
        ),
        (
            "kv_events=tcp://h:65535,dp_size=2",
            "dp_size = \"2\": rank 1 would publish on kv_events port + 1, past 65535",
        ),
        (
            "kv_events=tcp://h:5557,kv_replay=tcp://h:65534,dp_size=4",
            "kv_replay port + 3, past 65535",
        ),
    ] {
        let e = from_args(&args(&format!(
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,{bad}"
        )))
        .unwrap_err()
        .unwrap();
        assert!(
            e.0.contains(want) && e.0.contains("--replica"),
            "{bad}: {e}"
        );
    }
    let e = apply_toml(
        &mut f,
        "[[replica]]\nurl = \"http://127.0.0.1:8000\"\ndp_size = 0\n",
    )
    .unwrap_err();
    assert!(e.0.contains("replica[0].dp_size"), "{e}");
    // The URL once as a data-parallel replica and once more: the same engine twice.
    for again in ["http://127.0.0.1:8000", "http://127.0.0.1:8000,dp_size=3"] {
        let e = from_args(&args(&format!(
            "--listen 127.0.0.1:0 --replica http://127.0.0.1:8000,dp_size=2 --replica {again}"
        )))
        .unwrap_err()
        .unwrap();
        assert!(e.0.contains("listed twice"), "{again}: {e}");
    }
}

/// `models`: a list in the file, NAME|NAME in the flag, the same replica either way; empty or
/// padded names are refused, naming the option.
#[test]
fn replica_models_list_or_flag() {
    let mut c = ServeConfig::default();
    apply_toml(
        &mut c,
        "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nmodels = [\"Qwen/Qwen3-8B\", \"sql:v1\"]\n",
    )
    .unwrap();
    let flag = parse_replica_flag("", "http://127.0.0.1:9000,models=Qwen/Qwen3-8B|sql:v1").unwrap();
    assert_eq!(c.replicas, vec![flag.clone()]);
    assert_eq!(
        flag.models.as_deref(),
        Some(&["Qwen/Qwen3-8B".to_string(), "sql:v1".to_string()][..])
    );
    for bad in ["models=", "models=a||b", "models= a"] {
        let e =
            parse_replica_flag("--replica", &format!("http://127.0.0.1:9000,{bad}")).unwrap_err();
        assert!(e.0.contains("models"), "{bad}: {e}");
    }
    let mut c = ServeConfig::default();
    let e = apply_toml(
        &mut c,
        "[[replica]]\nurl = \"http://127.0.0.1:9000\"\nmodels = []\n",
    )
    .unwrap_err();
    assert!(e.0.contains("models"), "{e}");
}

/// `[[model]]` tables: keys left out take the global settings (the flags' included); a name
/// in two tables, a table without a name, an unknown key are refused.
#[test]
fn model_tables_inherit_the_global_settings_and_are_checked() {
    let dir = std::env::temp_dir().join(format!("kvlb-config-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvlb.toml");
    let load = |text: &str, flags: &str| {
        std::fs::write(&file, format!("listen = [\"127.0.0.1:0\"]\n{text}")).unwrap();
        from_args(&args(&format!("--config {} {flags}", file.display())))
    };
    let c = load(
        "max_in_flight = 8\n[cost_model]\ndecode_step_s = 0.02\n\
         [[model]]\nname = [\"big\", \"big-alias\"]\npolicy = \"least_loaded\"\n\
         upstream_timeout = \"10m\"\ncost_model = { prefill_s_per_token = 0.0001 }\n\
         [[model]]\nname = \"small\"\nmax_in_flight = 0\n",
        "--policy round_robin",
    )
    .unwrap();
    assert_eq!(c.models.len(), 2);
    let big = &c.models[0];
    assert_eq!(big.names, ["big", "big-alias"]);
    assert_eq!(big.policy, PolicyName::LeastLoaded);
    assert_eq!(big.upstream_timeout, Duration::from_secs(600));
    assert_eq!(big.max_in_flight, 8);
    assert_eq!(big.cost_model.prefill_s_per_token, 0.0001);
    assert_eq!(big.cost_model.decode_step_s, 0.02);
    let small = &c.models[1];
    assert_eq!(small.policy, PolicyName::RoundRobin, "the flag's policy");
    assert_eq!(small.max_in_flight, 0);
    assert_eq!(small.cost_model, c.cost_model);
    assert_eq!(small.upstream_timeout, c.timeouts.upstream);
    // By table number, as a ModelClass gives it (0: none).
    assert_eq!(c.max_in_flight_of(0), 8);
    assert_eq!(c.max_in_flight_of(2), 0);
    assert_eq!(c.max_in_flight_of(9), 8);
    assert_eq!(c.upstream_timeout_of(1), Duration::from_secs(600));
    for (text, want) in [
        (
            "[[model]]\nname = \"a\"\n[[model]]\nname = [\"b\", \"a\"]\n",
            "named by two [[model]] tables",
        ),
        ("[[model]]\nname = []\n", "names its model"),
        ("[[model]]\npolicy = \"random\"\n", "name"),
        (
            "[[model]]\nname = \"a\"\nmax_inflight = 3\n",
            "max_inflight",
        ),
        (
            "[[model]]\nname = \"a\"\ncost_model = { prefil_s_per_token = 1 }\n",
            "prefil_s_per_token",
        ),
        ("[[model]]\nname = \"a\"\npolicy = \"fastest\"\n", "policy"),
    ] {
        let e = load(text, "").unwrap_err().unwrap();
        assert!(e.0.contains(want), "{text}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
