"""Stand-in for sglang.srt.runtime_context: one scheduler, no parallelism (the real module needs
the whole server_args machinery)."""

from types import SimpleNamespace

_PARALLEL = SimpleNamespace(
    pp_rank=0,
    attn_tp_rank=0,
    attn_cp_rank=0,
    attn_dp_size=1,
    attn_dp_rank=0,
    dp_rank=None,
)


def get_parallel():
    return _PARALLEL
