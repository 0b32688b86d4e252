"""transformers 5.x without torchvision: Qwen-VL processors for images alone.

Why: every Qwen-VL processor names a video processor among its parts, and transformers'
video processors need torchvision; without it ``ProcessorMixin`` cannot even check the
part's class (``VIDEO_PROCESSOR_MAPPING`` is a placeholder), so neither building a
processor nor ``AutoProcessor.from_pretrained`` works, although images need only the
PIL image processor (which transformers falls back to). portarl trains on images, never
videos: :func:`images_only_processors` leaves ``video_processor`` out of the processor's
parts when torchvision is missing. A no-op where torchvision imports (GPU and NPU hosts
normally have it); the processor then keeps its video processor as transformers made it.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def video_processing_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or a build that does not match torch (its ops fail to load)
        return False
    return True


@functools.lru_cache(maxsize=1)
def images_only_processors() -> bool:
    """Make Qwen-VL processors buildable and loadable without torchvision (see the module
    docstring); True when the parts list was changed."""
    if video_processing_available():
        return False
    from transformers import processing_utils

    mixin = processing_utils.ProcessorMixin
    original = mixin.get_attributes.__func__

    def get_attributes(cls):
        return [name for name in original(cls) if name != "video_processor"]

    mixin.get_attributes = classmethod(get_attributes)
    if not hasattr(mixin, "video_processor"):
        mixin.video_processor = None  # read by Qwen processors' __call__ only for videos
    return True
