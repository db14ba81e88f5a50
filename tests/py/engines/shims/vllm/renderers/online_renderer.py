"""Stand-in for vllm.renderers.online_renderer (the real module needs the tokenizer, the engine
inputs and the Harmony renderer): OnlineRenderer, named in anthropic/serving.py's annotations.
The Responses conversion its render_responses runs (construct_tool_dicts,
construct_input_messages) is imported from the real responses/utils.py instead."""


class OnlineRenderer:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("OnlineRenderer is not available in the engine tests")
