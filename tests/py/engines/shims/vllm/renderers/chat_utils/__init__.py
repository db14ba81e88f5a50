"""Stand-in for vllm/renderers/chat_utils/__init__.py: the same names, from the real modules
(types.py, tool_call.py, chat_message.py, content_parser.py) except the multimodal item
tracker, whose stand-in (item_tracker.py here) counts media parts instead of loading them with
the model's processor. chat_template.py (template files and the model registry) is left out."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from .chat_message import (  # noqa: E402
    has_non_text_content,
    parse_chat_message_content,
    parse_chat_message_content_parts,
    parse_chat_messages,
    parse_chat_messages_async,
)
from .content_parser import PROMPT_EMBEDS_PLACEHOLDER_TOKEN  # noqa: E402
from .item_tracker import (  # noqa: E402
    AsyncMultiModalItemTracker,
    BaseMultiModalItemTracker,
    MultiModalItemTracker,
)
from .tool_call import get_tool_call_id_type, make_tool_call_id  # noqa: E402
from .types import *  # noqa: E402,F403
from .types import __all__ as all_types  # noqa: E402

__all__ = [
    *all_types,
    "get_tool_call_id_type",
    "make_tool_call_id",
    "BaseMultiModalItemTracker",
    "MultiModalItemTracker",
    "AsyncMultiModalItemTracker",
    "has_non_text_content",
    "parse_chat_message_content",
    "parse_chat_message_content_parts",
    "parse_chat_messages",
    "parse_chat_messages_async",
    "PROMPT_EMBEDS_PLACEHOLDER_TOKEN",
]
