"""A vision prompt's model inputs through every batch layout: pixels, image grids and
M-RoPE positions.

Qwen-VL models place a token in a 3-D rotary space (time, height, width): text tokens
at (i, i, i), an image's tokens on its grid, and the text after an image continues from
the largest position before it plus one, so a prompt of p tokens ends below p. A
completion token j of a sample therefore sits at ``next_position + j`` in all three rows,
where ``next_position`` is the prompt's largest position plus one (Qwen's "rope delta").
Positions built as 1-D ``0..n-1`` would give every token after an image a wrong angle:
verl #6040 and AReaL #217 are that bug.

portarl computes each prompt's positions once, with the model's own ``get_rope_index``
(:class:`VisionPrompt`), and lays them out like the token ids:

- padded batch ([B, P + T], prompts left-padded): ``position_ids`` [3, B, P + T], padding
  at position 1 (what transformers' ``get_rope_index`` puts there; masked anyway);
- padding-free rows (:mod:`portarl.trainer.phases.packing`, shared-prompt rows too): the
  padded positions gathered by the same flat source indices as the token ids
  (``Packed.source``), under the text row (each sequence's 0, 1, ... from which
  transformers builds the block-diagonal mask): [4, rows, width], transformers' packed
  format for Qwen-VL;
- pixels: each image's patches in the order its placeholder tokens appear in the
  forward's ``input_ids`` (padded: row order; packed: the order the prompts were packed,
  a shared prompt's images once).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class VisionPrompt:
    """One encoded prompt of a vision-language model: ``rope`` [3, p] its M-RoPE positions
    (long), ``image_grid_thw`` [n_images, 3] (long; None without images), and the count
    of pixel rows its images make (``image_grid_thw.prod(-1).sum()``)."""

    rope: torch.Tensor
    image_grid_thw: torch.Tensor | None

    @property
    def next_position(self) -> int:
        """Where the first completion token sits (all three rows): the largest prompt position plus one."""
        return int(self.rope.max()) + 1 if self.rope.numel() else 0

    @property
    def pixel_rows(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.prod(-1).sum())

    def positions(self, completion_length: int) -> torch.Tensor:
        """[3, p + completion_length]: the prompt's positions, then the completion's."""
        tail = torch.arange(self.next_position, self.next_position + completion_length, dtype=torch.long)
        return torch.cat([self.rope, tail.expand(3, completion_length)], dim=1)


def left_padded_positions(prompts: list[VisionPrompt], prompt_lens: list[int], completion_lens: list[int],
                          width_p: int, width_c: int) -> torch.Tensor:
    """[3, B, width_p + width_c] M-RoPE positions of a padded batch (prompts right-aligned
    to ``width_p``, completions after them), 1 on padding."""
    out = torch.ones(3, len(prompts), width_p + width_c, dtype=torch.long)
    for i, (vp, p, c) in enumerate(zip(prompts, prompt_lens, completion_lens)):
        if vp.rope.shape[1] != p:
            raise ValueError(f"row {i}: {p} prompt tokens but M-RoPE positions for {vp.rope.shape[1]}: the prompt "
                             "ids and its vision encoding disagree")
        out[:, i, width_p - p : width_p + c] = vp.positions(c)
    return out


@dataclasses.dataclass
class VisionRows:
    """The vision inputs of a :class:`~portarl.trainer.phases.sequences.TokenBatch`:
    ``rope`` [3, B, S] (the batch's columns), and per row its prompt's pixel values
    ([n, D] or None) and image grids ([k, 3] or None)."""

    rope: torch.Tensor
    pixels: list
    grids: list
    image_token_id: int
    #: Patches merged into one image token (Qwen's spatial_merge_size squared).
    merge_area: int = 4
    #: Per row, its prompt's identity (equal prompt tokens with other images differ):
    #: what shared-prompt packing groups rows by, beside the tokens.
    prompt_keys: list = dataclasses.field(default_factory=list)

    def rows(self, index) -> "VisionRows":
        if isinstance(index, slice):
            picked = list(range(len(self.pixels)))[index]
        else:
            picked = [int(i) for i in torch.as_tensor(index).tolist()]
        device_index = torch.tensor(picked, dtype=torch.long, device=self.rope.device)
        return VisionRows(self.rope.index_select(1, device_index), [self.pixels[i] for i in picked],
                          [self.grids[i] for i in picked], self.image_token_id, self.merge_area,
                          [self.prompt_keys[i] for i in picked])

    def columns(self, start: int, end: int) -> "VisionRows":
        return dataclasses.replace(self, rope=self.rope[:, :, start:end])

    def _images(self, order: list[int], device) -> dict:
        pixels = [self.pixels[i] for i in order if self.pixels[i] is not None]
        if not pixels:
            return {}
        grids = [self.grids[i] for i in order if self.grids[i] is not None]
        return {"pixel_values": torch.cat(pixels).to(device), "image_grid_thw": torch.cat(grids).to(device)}

    def padded_kwargs(self, input_ids: torch.Tensor) -> dict:
        """The model's vision inputs for the padded layout of these rows."""
        return {"position_ids": self.rope, **self._images(list(range(len(self.pixels))), input_ids.device)}

    def packed_kwargs(self, packed, width: int) -> dict:
        """The model's vision inputs for ``packed`` (a :class:`~portarl.trainer.phases.
        packing.Packed` of these rows, ``width`` columns each): 4-row positions, and the
        pixels of the prompts in the order their image tokens were packed."""
        source = packed.source
        flat = self.rope.reshape(3, -1)
        rope = flat.index_select(1, source).view(3, *packed.input_ids.shape)
        positions = torch.cat([packed.position_ids[None], rope], dim=0)
        image_at = packed.input_ids.reshape(-1) == self.image_token_id
        order = torch.unique_consecutive(source[image_at] // width).tolist() if bool(image_at.any()) else []
        images = self._images(order, packed.input_ids.device)
        expected = sum(int(self.grids[i].prod(-1).sum()) // self.merge_area for i in order if self.grids[i] is not None)
        found = int(image_at.sum())
        if found != expected:  # an image token outside a prompt (the tail filler) or a prompt packed twice
            raise ValueError(f"packed micro-batch holds {found} image tokens but its prompts' images make {expected}")
        return {"position_ids": positions, **images}


@dataclasses.dataclass
class VisionBatch:
    """The vision side of a list of prompts (one entry per sample), as the rollout and the
    batch builder take it (:meth:`portarl.vision.codec.VisionCodec.batch_vision` makes it):
    each prompt's :class:`VisionPrompt` and pixel values, the image placeholder token,
    patches per image token, and the placeholder tokens a completion must never contain
    (``unsampleable``: the forward would take a sampled ``<|image_pad|>`` for an image's
    slot, so the engines never draw them; log-probs stay those of the full distribution,
    as with top-k). ``images``: per row, its example's image sources
    (:class:`~portarl.vision.images.ImageSource`, one tuple shared by a group's rows), for
    an engine that runs the processor itself (vLLM's ``multi_modal_data``)."""

    prompts: list
    pixels: list
    image_token_id: int
    merge_area: int
    unsampleable: tuple = ()
    images: list = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, rows) -> "VisionBatch":
        rows = list(rows)
        return dataclasses.replace(self, prompts=[self.prompts[i] for i in rows], pixels=[self.pixels[i] for i in rows],
                                   images=[self.images[i] for i in rows] if self.images else [])

    def rows(self, prompt_lens: list[int], completion_lens: list[int], width_p: int, width_c: int,
             device) -> VisionRows:
        """The :class:`VisionRows` of a padded batch of these prompts."""
        rope = left_padded_positions(self.prompts, prompt_lens, completion_lens, width_p, width_c)
        grids = [vp.image_grid_thw for vp in self.prompts]
        return VisionRows(rope.to(device), list(self.pixels), grids, self.image_token_id, self.merge_area,
                          [id(vp) for vp in self.prompts])
