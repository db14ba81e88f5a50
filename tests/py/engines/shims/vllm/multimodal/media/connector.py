"""Stand-in for vllm.multimodal.media.connector (the real module loads the media decoders):
merge_media_io_kwargs, which renderers/params.py calls only when building chat params for the
engine, never in the request conversion."""


def merge_media_io_kwargs(*args, **kwargs):
    raise NotImplementedError("merge_media_io_kwargs is not available in the engine tests")
