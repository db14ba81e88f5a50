"""Stand-in for sglang.srt.environ: mem_cache/utils.py imports `envs` for functions the engine
tests do not call."""

from types import SimpleNamespace

envs = SimpleNamespace()
