"""The text codec of a vision-language model: prompts with images encoded by the model's
processor (chat template, image placeholders expanded to their patch count, pixels), and
each prompt's M-RoPE positions from the model's ``get_rope_index``.

Why pixels are not kept: a prompt's token ids, image grids and positions are small and
computed once when the data loads (every row checked then, as for text); its pixel
values (patches x 1,176 fp32 for Qwen2.5-VL, megabytes per image) are made again by the
processor when a step draws the prompt, with the step's prompts cached
(``pixel_cache`` entries), so memory does not grow with the dataset.
"""

from __future__ import annotations

import collections

import torch

from portarl.assets.tokenizer import TextCodec
from portarl.vision.inputs import VisionBatch, VisionPrompt


def _rope_index(model):
    """The model's ``get_rope_index`` (on ``model.model``, below any peft or FSDP wrapper)."""
    from portarl.assets.lora import base_model

    inner = getattr(base_model(model), "model", None)
    fn = getattr(inner, "get_rope_index", None)
    if fn is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no get_rope_index: portarl trains vision-language "
                         "models with M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
    return fn


class VisionCodec(TextCodec):
    """:class:`~portarl.assets.tokenizer.TextCodec` over a processor's tokenizer, plus
    :meth:`encode_example` (prompt and images) and :meth:`pixel_values`."""

    def __init__(self, processor, model, *, chat_template: str = "auto", system_prompt: str | None = None,
                 pixel_cache: int = 256):
        tokenizer = processor.tokenizer
        if getattr(tokenizer, "chat_template", None) is None and getattr(processor, "chat_template", None):
            tokenizer.chat_template = processor.chat_template  # the template saved with the processor
        super().__init__(tokenizer, chat_template=chat_template, system_prompt=system_prompt)
        self.processor = processor
        self.rope_index = None if model is None else _rope_index(model)  # None: token counts only (portarl plan)
        self.image_token_id = int(processor.image_token_id)
        video = getattr(processor, "video_token_id", None)
        self.unsampleable = tuple(int(t) for t in (self.image_token_id, video) if t is not None)
        self.merge_area = int(getattr(processor.image_processor, "merge_size", 2)) ** 2
        self.prompts: dict[int, VisionPrompt] = {}  # by id(example)
        self._pixels: collections.OrderedDict = collections.OrderedDict()
        self.pixel_cache = pixel_cache

    def _process(self, example):
        from portarl.vision.images import open_image

        if not self.uses_template(example.prompt) and getattr(example, 'images', ()):
            raise ValueError("a prompt with images needs a chat template (its image parts mark where they go)")
        text = self.render_text(self.messages(example.prompt), add_generation_prompt=True) \
            if self.uses_template(example.prompt) else example.prompt
        images = [open_image(src) for src in getattr(example, 'images', ())] or None
        return self.processor(text=[text], images=images, return_tensors="pt")

    def encode_example(self, example) -> list[int]:
        """``example``'s prompt ids (image placeholders expanded), its :class:`VisionPrompt`
        remembered for :meth:`prompt_of`."""
        enc = self._process(example)
        ids = enc["input_ids"][0]
        grid = enc.get("image_grid_thw")
        if grid is not None:
            kinds = enc.get("mm_token_type_ids")
            if kinds is None:
                kinds = (enc["input_ids"] == self.image_token_id).int()
            if self.rope_index is None:
                raise ValueError("encoding a prompt with images for training needs the model (its get_rope_index)")
            rope, _ = self.rope_index(enc["input_ids"], mm_token_type_ids=kinds, image_grid_thw=grid,
                                      attention_mask=enc["attention_mask"])
            rope = rope[:, 0].to(torch.long).cpu()
        else:
            rope = torch.arange(ids.numel(), dtype=torch.long).expand(3, -1).clone()
        self.prompts[id(example)] = VisionPrompt(rope, None if grid is None else grid.cpu())
        self._remember(example, enc.get("pixel_values"))
        return [int(i) for i in ids.tolist()]

    def prompt_size(self, example) -> tuple[int, int, int]:
        """``(tokens, image tokens, pixel rows)`` of ``example``'s prompt as
        :meth:`encode_example` encodes it (image placeholders expanded), from the processor
        alone: no model (``portarl plan`` counts prompts before any weights load), nothing
        remembered. Pixel rows: the patches its images make (``pixel_values`` rows)."""
        enc = self._process(example)
        ids = enc["input_ids"][0]
        pixels = enc.get("pixel_values")
        return int(ids.numel()), int((ids == self.image_token_id).sum()), 0 if pixels is None else int(pixels.shape[0])

    def encode_prompt(self, prompt) -> list[int]:
        if not isinstance(prompt, str) and any(not isinstance(m["content"], str) and
                                               any(part.get("type") == "image" for part in m["content"]) for m in prompt):
            raise ValueError("a prompt with image parts is encoded with its images (encode_example), not alone")
        return super().encode_prompt(prompt)

    def _remember(self, example, pixels) -> None:
        self._pixels[id(example)] = pixels
        self._pixels.move_to_end(id(example))
        while len(self._pixels) > self.pixel_cache:
            self._pixels.popitem(last=False)

    def prompt_of(self, example) -> VisionPrompt:
        vp = self.prompts.get(id(example))
        if vp is None:
            self.encode_example(example)
            vp = self.prompts[id(example)]
        return vp

    def pixel_values(self, example) -> torch.Tensor | None:
        """The pixel values of ``example``'s images ([rows, patch features], fp32), or None."""
        if not getattr(example, 'images', ()):
            return None
        if id(example) in self._pixels:
            self._pixels.move_to_end(id(example))
            return self._pixels[id(example)]
        pixels = self._process(example)["pixel_values"]
        self._remember(example, pixels)
        return pixels

    def batch_vision(self, examples: list, group_size: int) -> VisionBatch:
        """The :class:`~portarl.vision.inputs.VisionBatch` of ``examples`` each sampled
        ``group_size`` times (row i is example i // group_size)."""
        rows = [ex for ex in examples for _ in range(group_size)]
        sources = {id(ex): tuple(getattr(ex, "images", ())) for ex in examples}
        return VisionBatch([self.prompt_of(ex) for ex in rows], [self.pixel_values(ex) for ex in rows],
                           self.image_token_id, self.merge_area, self.unsampleable, [sources[id(ex)] for ex in rows])


def codec_for(tokenizer, model=None, **options) -> TextCodec:
    """The codec of ``tokenizer``: a :class:`VisionCodec` for a vision-language model's
    processor (``model``: its M-RoPE positions come from the model; None: token counts
    only), else :func:`portarl.assets.tokenizer.as_codec`. ``options``: ``chat_template``,
    ``system_prompt``."""
    from portarl.assets.tokenizer import as_codec

    if hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):
        return VisionCodec(tokenizer, model, **options)
    return as_codec(tokenizer, **options)
