"""Stand-in for vllm.entrypoints.openai.chat_completion.serving (the real module needs the
engine, the renderers and the tool and reasoning parsers): OpenAIServingChat, the base class of
AnthropicServingMessages. The Messages conversion (to_chat_completion_request and the
classmethods it calls) is defined on AnthropicServingMessages itself and uses nothing of the
base; instances, which serve requests, are refused."""


class OpenAIServingChat:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("OpenAIServingChat is not available in the engine tests")
