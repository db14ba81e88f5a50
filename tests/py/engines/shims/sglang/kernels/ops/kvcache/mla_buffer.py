"""Stand-in for SGLang's MLA buffer kernels (triton/CUDA): mem_cache/utils.py re-exports them,
the KV event code never calls them."""


def _no_kernel(*args, **kwargs):
    raise NotImplementedError("MLA buffer kernels are not available in the engine tests")


get_mla_kv_buffer_kernel = _no_kernel
get_mla_kv_buffer_triton = _no_kernel
set_mla_kv_buffer_dcp_sharded_triton = _no_kernel
set_mla_kv_buffer_fp8_quant_kernel = _no_kernel
set_mla_kv_buffer_kernel = _no_kernel
set_mla_kv_buffer_triton = _no_kernel
set_mla_kv_buffer_triton_fp8_quant = _no_kernel
set_mla_kv_scale_buffer_kernel = _no_kernel
set_mla_kv_scale_buffer_triton = _no_kernel
