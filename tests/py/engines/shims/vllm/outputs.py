"""Stand-in for vllm.outputs (the real module imports torch and the engine's metrics): the one
name the chat completion protocol imports, a field type of its response models, as in vLLM."""

from dataclasses import dataclass


@dataclass
class WeightVersionSpan:
    """Output tokens `[start, end)` were sampled by weights labelled `version`."""

    version: str
    start: int
    end: int
