"""Stand-in for vllm/config/__init__.py (the real one imports every config, with torch and
transformers). The request and protocol modules import ModelConfig only for the annotations of
methods the conversion does not call. The real config modules the tests extract
(config/kv_events.py) stay importable: this package's path spans every vllm/config directory on
sys.path."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)


class ModelConfig:
    """Never instantiated here."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("ModelConfig is not available in the engine tests")


SpeculativeConfig = ModelConfig
StructuredOutputsConfig = ModelConfig
VllmConfig = ModelConfig
