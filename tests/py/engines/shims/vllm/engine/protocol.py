"""Stand-in for vllm.engine.protocol (the real module pulls in the engine): EngineClient, which
anthropic/serving.py names in its constructor's annotations."""


class EngineClient:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("EngineClient is not available in the engine tests")
