"""Stand-in for vllm.sampling_params (the real module needs numpy, torch and the tokenizers):
the names the request protocols import. They type sampling fields (structured_outputs,
repetition_detection, thinking_token_budget) and build SamplingParams in methods the request
conversion never calls; the agent conversion cases set none of those fields, and a case that did
would fail loudly here rather than pass with other semantics."""

from enum import Enum
from typing import Any

from pydantic.dataclasses import dataclass


def _unavailable(name):
    raise NotImplementedError(f"{name} is not available in the engine tests")


@dataclass
class StructuredOutputsParams:
    def __post_init__(self):
        _unavailable("StructuredOutputsParams")


@dataclass
class RepetitionDetectionParams:
    def __post_init__(self):
        _unavailable("RepetitionDetectionParams")


class SamplingParams:
    def __init__(self, *args: Any, **kwargs: Any):
        _unavailable("SamplingParams")

    @classmethod
    def from_optional(cls, *args: Any, **kwargs: Any):
        _unavailable("SamplingParams")


class BeamSearchParams(SamplingParams):
    pass


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


ThinkingTokenBudget = int | None
