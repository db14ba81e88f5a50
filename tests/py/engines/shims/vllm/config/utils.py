"""Stand-in for vllm.config.utils: the `config` decorator, as in vLLM a pydantic dataclass that
forbids extra fields, and `replace`, which the request protocols import for structured outputs
(the real module imports torch)."""

import dataclasses
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


def replace(dataclass_instance, /, **kwargs):
    """As in vLLM: a copy of the dataclass with `kwargs` changed, through its constructor."""
    cls = type(dataclass_instance)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {k: v for k, v in dataclass_instance.__dict__.items() if k in fields}
    values.update(kwargs)
    return cls(**values)
