"""Stand-in for vllm.entrypoints.serve.utils.request_logger: RequestLogger, named in
anthropic/serving.py's constructor annotations."""


class RequestLogger:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("RequestLogger is not available in the engine tests")
