"""Stand-in for vllm/renderers/__init__.py, which imports every renderer (tokenizers, torch,
multimodal processors): only what renderers/params.py defines, from the real params.py. The
package's path spans every vllm/renderers directory on sys.path, so the real params.py and
chat_utils modules the tests extract are found."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .params import (  # noqa: E402
    ChatParams,
    ReasoningEffort,
    TokenizeParams,
    map_reasoning_effort,
    merge_kwargs,
)

__all__ = [
    "ChatParams",
    "ReasoningEffort",
    "TokenizeParams",
    "map_reasoning_effort",
    "merge_kwargs",
]
