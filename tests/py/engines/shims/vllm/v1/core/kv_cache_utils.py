"""Stand-in for vllm.v1.core.kv_cache_utils: only the type kv_events.py imports (the real module
pulls in the whole engine)."""

from typing import TypeAlias

# As in vLLM 0.33: bytes (sha256 digests) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (the
# default), the digest's low 64 bits as an int.
ExternalBlockHash: TypeAlias = bytes | int
