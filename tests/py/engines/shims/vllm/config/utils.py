"""Stand-in for vllm.config.utils: the `config` decorator, as in vLLM a pydantic dataclass that
forbids extra fields (the real module imports torch)."""

from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass


def config(cls=None, *, config: ConfigDict | None = None, **kwargs: Any):
    merged = ConfigDict(extra="forbid")
    if config is not None:
        merged.update(config)

    def decorator(cls):
        return dataclass(cls, config=merged, **kwargs)

    return decorator if cls is None else decorator(cls)
