"""Stand-in for vllm/inputs/__init__.py (the real package loads the multimodal inputs): the
prompt TypedDicts renderers/params.py and the multimodal dict types chat_message.py name in
their annotations."""

from typing import Any

from typing_extensions import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Any]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Any]


class EmbedsPrompt(TypedDict):
    prompt_embeds: Any


MultiModalDataDict = dict[str, Any]
MultiModalUUIDDict = dict[str, Any]
