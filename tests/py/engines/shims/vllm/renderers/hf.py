"""Stand-in for vllm.renderers.hf (the real module loads transformers): HfRenderer and
resolve_chat_template, which anthropic/serving.py uses to decide, when the server starts, whether
inline system messages are merged. The conversion takes that decision as its
merge_inline_system argument instead."""


class HfRenderer:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("HfRenderer is not available in the engine tests")


def resolve_chat_template(*args, **kwargs):
    raise NotImplementedError("resolve_chat_template is not available in the engine tests")
