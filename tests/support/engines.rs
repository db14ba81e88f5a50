//! The engines' own KV event code against kvlb: tests/py/engines/driver.py runs vLLM 0.33.0's
//! and SGLang 0.5.23's real Python files (fetched by tests/py/engines/fetch.py) behind small
//! import shims, publishing over real ZeroMQ, or decoding a publisher's messages with vLLM's own
//! msgspec classes.
//!
//! The engine sources are $KVLB_ENGINE_SRC when it holds them (tests/run.sh exports it), else
//! this runs fetch.py once per test binary. A failed fetch fails the test (never a skip), with
//! fetch.py's message. The Python side needs pyzmq, msgspec and pydantic: $KVLB_PYTHON, else
//! .venv/bin/python at the repository root, else python3.

use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Longest wait for one line from the driver (its start includes importing the engine code).
const LINE_WITHIN: Duration = Duration::from_secs(30);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn driver_dir() -> PathBuf {
    repo().join("tests/py/engines")
}

/// The test interpreter, checked once for the modules the engine code imports.
pub fn python() -> PathBuf {
    static PY: OnceLock<PathBuf> = OnceLock::new();
    PY.get_or_init(|| {
        let py: PathBuf = match std::env::var_os("KVLB_PYTHON") {
            Some(p) => p.into(),
            None if repo().join(".venv/bin/python").exists() => repo().join(".venv/bin/python"),
            None => "python3".into(),
        };
        let out = Command::new(&py)
            .args(["-c", "import zmq, msgspec, pydantic"])
            .output();
        if !matches!(&out, Ok(o) if o.status.success()) {
            let why = match out {
                Ok(o) => String::from_utf8_lossy(&o.stderr).into_owned(),
                Err(e) => e.to_string(),
            };
            panic!(
                "{} cannot import zmq, msgspec and pydantic ({}). Run `bash tests/run.sh` once \
                 (it creates .venv from tests/py/requirements.txt), or point KVLB_PYTHON at an \
                 interpreter that has them.",
                py.display(),
                why.trim()
            );
        }
        py
    })
    .clone()
}

fn holds_sources(dir: &Path) -> bool {
    dir.join("vllm-0.33.0/.kvlb-stamp.json").exists()
        && dir.join("sglang-0.5.23/.kvlb-stamp.json").exists()
}

/// The directory of the extracted engine sources: $KVLB_ENGINE_SRC, else fetch.py's answer.
pub fn engine_src() -> PathBuf {
    static SRC: OnceLock<PathBuf> = OnceLock::new();
    SRC.get_or_init(|| {
        if let Some(dir) = std::env::var_os("KVLB_ENGINE_SRC").map(PathBuf::from) {
            if holds_sources(&dir) {
                return dir;
            }
        }
        let fetch = driver_dir().join("fetch.py");
        let out = Command::new(python())
            .arg(&fetch)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", fetch.display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{} failed ({}): the engine tests need the pinned vLLM and SGLang wheels, fetched \
             once from PyPI into the cache (KVLB_ENGINE_CACHE, else \
             $XDG_CACHE_HOME/kvlb/engines, else ~/.cache/kvlb/engines).\n{stdout}{stderr}",
            fetch.display(),
            out.status
        );
        let dir = PathBuf::from(stdout.trim().lines().last().unwrap_or_default());
        assert!(
            holds_sources(&dir),
            "{} answered {dir:?}, which does not hold the engine sources.\n{stderr}",
            fetch.display()
        );
        dir
    })
    .clone()
}

/// Which engine's code publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
}

/// A driver.py process, killed and reaped on drop (also when a test panics).
pub struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
    what: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    fn spawn(args: &[String]) -> Driver {
        let script = driver_dir().join("driver.py");
        let mut child = Command::new(python())
            .arg(&script)
            .args(args)
            .env("KVLB_ENGINE_SRC", engine_src())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", script.display()));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { return };
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Driver {
            stdin: child.stdin.take(),
            child,
            lines,
            stderr,
            what: format!("driver.py {}", args.join(" ")),
        }
    }

    /// Everything the driver wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The next JSON line, or a panic that says the driver died or went quiet.
    pub fn next_json(&mut self) -> Value {
        match self.lines.recv_timeout(LINE_WITHIN) {
            Ok(line) => serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("{} printed {line:?}, not JSON: {e}", self.what)),
            Err(_) => {
                // Let the stderr thread catch up with a dying process.
                std::thread::sleep(Duration::from_millis(200));
                panic!(
                    "no output from {} within {LINE_WITHIN:?} (exit status {:?}); stderr:\n{}",
                    self.what,
                    self.child.try_wait().ok().flatten(),
                    self.stderr()
                )
            }
        }
    }

    /// The next line within `limit`, if any.
    pub fn try_next_json(&mut self, limit: Duration) -> Option<Value> {
        let line = self.lines.recv_timeout(limit).ok()?;
        Some(
            serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("{} printed {line:?}, not JSON: {e}", self.what)),
        )
    }

    fn ready(&mut self) -> Value {
        let hello = self.next_json();
        assert_eq!(
            hello["ready"],
            true,
            "{} said {hello}; stderr:\n{}",
            self.what,
            self.stderr()
        );
        hello
    }
}

/// An engine's real ZmqEventPublisher (PUB and replay ROUTER on 127.0.0.1), fed batches
/// described in JSON (see driver.py).
pub struct EnginePublisher {
    pub driver: Driver,
    pub engine: Engine,
    /// `tcp://127.0.0.1:PORT` of the PUB socket.
    pub endpoint: String,
    /// `tcp://127.0.0.1:PORT` of the replay ROUTER.
    pub replay: String,
}

impl EnginePublisher {
    /// vLLM's publisher, block hashes as ints (vLLM's default).
    pub fn vllm() -> EnginePublisher {
        EnginePublisher::start(Engine::Vllm, &[])
    }

    /// SGLang's publisher and KVCacheEventRecorder with `page_size`.
    pub fn sglang(page_size: u32) -> EnginePublisher {
        EnginePublisher::start(Engine::Sglang, &["--page-size", &page_size.to_string()])
    }

    pub fn start(engine: Engine, extra: &[&str]) -> EnginePublisher {
        let name = match engine {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        };
        let mut args: Vec<String> = vec!["publish".into(), "--engine".into(), name.into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut driver = Driver::spawn(&args);
        let hello = driver.ready();
        let field = |k: &str| {
            hello[k]
                .as_str()
                .unwrap_or_else(|| panic!("no {k} in {hello}"))
                .to_string()
        };
        EnginePublisher {
            endpoint: field("endpoint"),
            replay: field("replay"),
            engine,
            driver,
        }
    }

    /// `--replica` spec for kvlb: `http://HTTP,kv_events=ENDPOINT,kv_replay=REPLAY`.
    pub fn replica_spec(&self, http: std::net::SocketAddr) -> String {
        format!(
            "http://{http},kv_events={},kv_replay={}",
            self.endpoint, self.replay
        )
    }

    /// Publishes one batch of `events` (driver.py's JSON descriptions) through the engine's
    /// publisher; returns the summary of what the engine code produced.
    pub fn publish(&mut self, events: Value) -> Value {
        let cmd = serde_json::json!({"op": "publish", "events": events});
        let stdin = self.driver.stdin.as_mut().unwrap();
        writeln!(stdin, "{cmd}").unwrap();
        stdin.flush().unwrap();
        let reply = self.driver.next_json();
        assert_eq!(
            reply["ok"],
            true,
            "{:?} engine code refused {cmd}: {reply}; stderr:\n{}",
            self.engine,
            self.driver.stderr()
        );
        reply["events"].clone()
    }
}

/// A SUB on `endpoint` decoding every message with vLLM's own
/// `msgspec.msgpack.Decoder(KVEventBatch)`.
pub struct VllmDecoder {
    pub driver: Driver,
}

impl VllmDecoder {
    /// Connected (ZeroMQ handshake done) when this returns.
    pub fn connect(endpoint: &str) -> VllmDecoder {
        let mut driver = Driver::spawn(&[
            "decode".to_string(),
            "--endpoint".to_string(),
            endpoint.to_string(),
        ]);
        driver.ready();
        VllmDecoder { driver }
    }

    /// The next message: `{"seq": N, "batch": {...}}` or `{"seq": N, "error": "..."}`.
    pub fn next(&mut self, limit: Duration) -> Option<Value> {
        self.driver.try_next_json(limit)
    }
}
