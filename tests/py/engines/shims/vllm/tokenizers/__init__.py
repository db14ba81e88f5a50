"""Stand-in for vllm/tokenizers/__init__.py (the real package loads transformers): the
TokenizerLike protocol renderers/params.py names in its annotations."""

from typing import Any

TokenizerLike = Any
