"""Stand-in for vllm.renderers.inputs.preprocess (the real module loads the multimodal inputs):
extract_prompt_components, which anthropic/serving.py calls only when probing a renderer."""


def extract_prompt_components(*args, **kwargs):
    raise NotImplementedError("extract_prompt_components is not available in the engine tests")
