"""Stand-in for fastapi: anthropic/serving.py imports Request for the annotations of its HTTP
handlers; the request conversion never sees one."""


class Request:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("fastapi is not available in the engine tests")
