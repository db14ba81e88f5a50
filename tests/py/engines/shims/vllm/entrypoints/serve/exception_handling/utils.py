"""Stand-in for vllm.entrypoints.serve.exception_handling.utils (the real module needs the
`regex` package): sanitize_message, which anthropic/serving.py calls only on streamed errors."""


def sanitize_message(message: str) -> str:
    raise NotImplementedError("sanitize_message is not available in the engine tests")
