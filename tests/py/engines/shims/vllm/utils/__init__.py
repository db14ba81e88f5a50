"""Stand-in for vllm/utils/__init__.py: random_uuid as in vLLM (the real module imports torch
for helpers the request conversion never calls)."""

import uuid
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

MASK_64_BITS = (1 << 64) - 1


def random_uuid() -> str:
    return f"{uuid.uuid4().int & MASK_64_BITS:016x}"  # 16 hex chars
