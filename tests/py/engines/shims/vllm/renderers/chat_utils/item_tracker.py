"""Stand-in for vllm.renderers.chat_utils.item_tracker (the real one loads the model's
multimodal processor and registry, and fetches media through the media connector).

vLLM's real chat parser (chat_message.py: parse_chat_messages) runs on top of it. Text, tool
calls, reasoning and tool references are parsed by the real code; a media part (image, audio,
video) is counted here, not fetched, and stands for the placeholder `<image>` (`<audio>`,
`<video>`) where a model's processor would give its own: in the string content format that is
what the conversation's text holds for it. Both sides of a comparison get the same placeholders.
"""

from collections import defaultdict

from .content_parser import BaseMultiModalContentParser


class _ContentParser(BaseMultiModalContentParser):
    def __init__(self, tracker):
        super().__init__()
        self._tracker = tracker

    @property
    def model_config(self):
        return self._tracker.model_config

    def _item(self, modality, value, uuid):
        self._add_placeholder(modality, self._tracker.add(modality, (value, uuid)))

    def parse_image(self, image_url, uuid=None):
        self._item("image", image_url, uuid)

    def parse_image_embeds(self, image_embeds, uuid=None):
        raise NotImplementedError("image embeds are not available in the engine tests")

    def parse_image_pil(self, image_pil, uuid=None):
        self._item("image", image_pil, uuid)

    def parse_audio(self, audio_url, uuid=None):
        self._item("audio", audio_url, uuid)

    def parse_input_audio(self, input_audio, uuid=None):
        self._item("audio", input_audio, uuid)

    def parse_audio_embeds(self, audio_embeds, uuid=None):
        raise NotImplementedError("audio embeds are not available in the engine tests")

    def parse_prompt_embeds(self, data):
        raise NotImplementedError("prompt embeds are not available in the engine tests")

    def parse_video(self, video_url, uuid=None):
        self._item("video", video_url, uuid)

    def parse_video_embeds(self, video_embeds, uuid=None, audio_embeds=None):
        raise NotImplementedError("video embeds are not available in the engine tests")


class BaseMultiModalItemTracker:
    def __init__(self, model_config, media_io_kwargs=None, **kwargs):
        self.model_config = model_config
        self.media_io_kwargs = media_io_kwargs
        self._items = defaultdict(list)

    def create_parser(self, mm_processor_kwargs=None):
        return _ContentParser(self)

    def get_num_items(self, modality):
        return len(self._items[modality])

    def add(self, modality, item):
        self._items[modality].append(item)
        return f"<{modality}>"

    def _resolved(self):
        if not self._items:
            return None, None
        data = {m: [value for value, _ in items] for m, items in self._items.items()}
        uuids = {m: [uuid for _, uuid in items] for m, items in self._items.items()}
        return data, uuids


class MultiModalItemTracker(BaseMultiModalItemTracker):
    def resolve_items(self):
        return self._resolved()


class AsyncMultiModalItemTracker(BaseMultiModalItemTracker):
    async def resolve_items(self):
        return self._resolved()
