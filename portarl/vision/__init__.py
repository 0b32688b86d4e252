"""Vision-language models (issue 47): Qwen2-VL, Qwen2.5-VL and Qwen3-VL trained with the same
numerics as text models. ``images``: the images of a data row (TRL's format), checked when
the data loads; ``models``: building, loading, freezing; ``compat``: transformers without
torchvision; ``codec``: prompts with images encoded by the processor; ``inputs``: a prompt's
pixels and M-RoPE positions through every batch layout. Exports nothing: the heavy parts
import transformers and Pillow only when used."""
