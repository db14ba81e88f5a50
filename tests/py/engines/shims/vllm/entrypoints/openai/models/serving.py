"""Stand-in for vllm.entrypoints.openai.models.serving (the real module needs the engine and
LoRA): OpenAIServingModels, named in anthropic/serving.py's constructor annotations."""


class OpenAIServingModels:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("OpenAIServingModels is not available in the engine tests")
