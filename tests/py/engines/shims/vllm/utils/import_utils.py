"""Stand-in for vllm.utils.import_utils: LazyLoader, which renderers/params.py uses to load torch
on first use (the real module needs the `regex` package). Loading is refused: the request
conversion never touches torch."""

from types import ModuleType


class LazyLoader(ModuleType):
    def __init__(self, local_name, parent_module_globals, name):
        super().__init__(str(name))
        self._local_name = local_name

    def __getattr__(self, attr):
        raise ImportError(f"{self._local_name} is not available in the engine tests")
