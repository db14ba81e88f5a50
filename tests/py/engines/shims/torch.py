"""Stand-in for torch: vLLM's chat content parser (renderers/chat_utils/content_parser.py)
imports it for the prompt-embeds tensors of content parts no conversion case has, and names
torch.Tensor in annotations. Any other use fails."""


class Tensor:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("torch is not available in the engine tests")


def __getattr__(name):
    raise AttributeError(f"torch.{name} is not available in the engine tests")
