"""Stand-in for vllm/multimodal/media/__init__.py (the real package loads the image, audio and
video decoders): the media connector registry the chat content parser names. Media are never
fetched in the engine tests: the item tracker stand-in (renderers/chat_utils/item_tracker.py)
counts media parts without loading them."""

from .connector import merge_media_io_kwargs  # noqa: F401


class MediaConnector:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("MediaConnector is not available in the engine tests")


class _Registry:
    def load(self, *args, **kwargs):
        raise NotImplementedError("media connectors are not available in the engine tests")


MEDIA_CONNECTOR_REGISTRY = _Registry()
