//! The names a replica serves, as vLLM's OpenAI server keeps them: the base model under each
//! `--served-model-name`, and the LoRA adapters loaded (`--lora-modules` at start,
//! `/v1/load_lora_adapter` at run time when `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is true). A
//! request naming anything else (but an adapter as SGLang's `base:adapter`) gets vLLM's 404; `/v1/models` lists them all, adapters with
//! their `parent`.

#![forbid(unsafe_code)]

use super::openai::ApiError;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Engine seconds a runtime adapter load takes (reading a small adapter's weights; scaled by
/// --time-scale like the engine's own time).
pub const LORA_LOAD_S: f64 = 0.05;

/// vLLM's parsing of `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: "1" or "true", in any case.
pub fn runtime_updates_allowed() -> bool {
    std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .map(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
        .unwrap_or(false)
}

pub struct Served {
    /// The model's path (`root` of its cards).
    path: String,
    names: Vec<String>,
    lora: bool,
    runtime_updates: bool,
    /// Loaded adapters: name, path, vLLM's integer id.
    adapters: Mutex<Vec<(String, String, u64)>>,
    next_id: AtomicU64,
    /// Adapters loaded through /v1/load_lora_adapter (`kvlb_replica_lora_loads_total`).
    pub runtime_loads: AtomicU64,
    /// Wall time a runtime load takes ([`LORA_LOAD_S`] at the replica's time scale).
    load_wall: std::time::Duration,
}

/// What a request's `model` names.
pub enum Named {
    Base,
    /// An adapter: its name, the salt its KV cache is kept apart by, and vLLM's integer id.
    Adapter(String, u64, u64),
}

fn bad(kind: &'static str, status: u16, message: String) -> ApiError {
    ApiError {
        status,
        kind,
        message,
        param: None,
    }
}

impl Served {
    pub fn new(
        path: &str,
        names: Vec<String>,
        lora: bool,
        modules: &[(String, String)],
        time_scale: f64,
    ) -> Served {
        let served = Served {
            path: path.to_string(),
            names,
            lora,
            runtime_updates: lora && runtime_updates_allowed(),
            adapters: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            runtime_loads: AtomicU64::new(0),
            load_wall: std::time::Duration::from_secs_f64(LORA_LOAD_S / time_scale),
        };
        for (name, path) in modules {
            served.add(name, path);
        }
        served
    }

    fn add(&self, name: &str, path: &str) {
        let id = self.next_id.fetch_add(1, Relaxed);
        self.adapters
            .lock()
            .unwrap()
            .push((name.to_string(), path.to_string(), id));
    }

    /// The name responses carry for a request of `named`.
    pub fn response_name(&self, named: &Named) -> String {
        match named {
            Named::Base => self.names[0].clone(),
            Named::Adapter(name, _, _) => name.clone(),
        }
    }

    /// Whether the runtime load and unload routes exist (vLLM adds them only then).
    pub fn runtime_updates(&self) -> bool {
        self.runtime_updates
    }

    /// What `model` names: a served name (or none) is the base; a loaded adapter; else
    /// vLLM's 404.
    pub fn check(&self, model: Option<&str>) -> Result<Named, ApiError> {
        let Some(model) = model.filter(|m| !m.is_empty()) else {
            return Ok(Named::Base);
        };
        if self.names.iter().any(|n| n == model) {
            return Ok(Named::Base);
        }
        // The adapter by its own name (vLLM), or as SGLang's `base:adapter`.
        let sglang = model
            .split_once(':')
            .filter(|(base, _)| self.names.iter().any(|n| n == base))
            .map(|(_, adapter)| adapter);
        if let Some((name, _, id)) = self
            .adapters
            .lock()
            .unwrap()
            .iter()
            .find(|(n, _, _)| n == model || Some(n.as_str()) == sglang)
        {
            let salt = xxhash_rust::xxh3::xxh3_64_with_seed(name.as_bytes(), *id);
            return Ok(Named::Adapter(name.clone(), salt, *id));
        }
        Err(ApiError {
            status: 404,
            kind: "NotFoundError",
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        })
    }

    /// The body of `GET /v1/models`.
    pub fn list_json(&self, created: u64, max_model_len: u32) -> String {
        let card = |id: &str, root: &str, parent: Value, len: Value| {
            json!({
                "id": id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": len,
                "permission": [{"id": format!("modelperm-{created:x}"), "object": "model_permission",
                    "created": created, "allow_create_engine": false, "allow_sampling": true,
                    "allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
                    "allow_fine_tuning": false, "organization": "*", "group": null, "is_blocking": false}]
            })
        };
        let mut data: Vec<Value> = self
            .names
            .iter()
            .map(|n| card(n, &self.path, Value::Null, json!(max_model_len)))
            .collect();
        for (name, path, _) in self.adapters.lock().unwrap().iter() {
            data.push(card(name, path, json!(self.names[0]), Value::Null));
        }
        json!({"object": "list", "data": data}).to_string()
    }

    /// `POST /v1/load_lora_adapter`: Ok(the success text) or vLLM's error.
    pub fn load(&self, body: &[u8]) -> Result<String, ApiError> {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))?;
        let name = v["lora_name"].as_str().unwrap_or("");
        let path = v["lora_path"].as_str().unwrap_or("");
        let inplace = v["load_inplace"].as_bool().unwrap_or(false);
        if name.is_empty() || path.is_empty() {
            return Err(bad(
                "InvalidUserInput",
                400,
                "Both 'lora_name' and 'lora_path' must be provided.".into(),
            ));
        }
        if self.names.iter().any(|n| n == name) {
            return Err(bad(
                "InvalidUserInput",
                400,
                format!("The lora adapter '{name}' conflicts with a served base model."),
            ));
        }
        std::thread::sleep(self.load_wall);
        let mut adapters = self.adapters.lock().unwrap();
        if let Some(i) = adapters.iter().position(|(n, _, _)| n == name) {
            if !inplace {
                return Err(bad(
                    "InvalidUserInput",
                    400,
                    format!("The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."),
                ));
            }
            adapters[i].1 = path.to_string();
        } else {
            let id = self.next_id.fetch_add(1, Relaxed);
            adapters.push((name.to_string(), path.to_string(), id));
        }
        self.runtime_loads.fetch_add(1, Relaxed);
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// `POST /v1/unload_lora_adapter`.
    pub fn unload(&self, body: &[u8]) -> Result<String, ApiError> {
        let v: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))?;
        let name = v["lora_name"].as_str().unwrap_or("");
        if name.is_empty() {
            return Err(bad(
                "InvalidUserInput",
                400,
                "'lora_name' needs to be provided to unload a LoRA adapter.".into(),
            ));
        }
        let mut adapters = self.adapters.lock().unwrap();
        match adapters.iter().position(|(n, _, _)| n == name) {
            Some(i) => {
                adapters.remove(i);
                Ok(format!(
                    "Success: LoRA adapter '{name}' removed successfully."
                ))
            }
            None => Err(bad(
                "NotFoundError",
                404,
                format!("The lora adapter '{name}' cannot be found."),
            )),
        }
    }

    /// Whether adapters may be served at all (`--enable-lora`).
    pub fn lora(&self) -> bool {
        self.lora
    }
}
