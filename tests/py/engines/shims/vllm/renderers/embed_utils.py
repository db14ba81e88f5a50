"""Stand-in for vllm.renderers.embed_utils (the real module decodes tensors with torch): the
prompt-embeds loaders the chat content parser imports, for content parts no conversion case
has."""


def safe_load_prompt_embeds(*args, **kwargs):
    raise NotImplementedError("prompt embeds are not available in the engine tests")


async def safe_load_prompt_embeds_async(*args, **kwargs):
    raise NotImplementedError("prompt embeds are not available in the engine tests")
