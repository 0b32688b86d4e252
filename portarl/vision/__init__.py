"""Vision-language models (issue 47): Qwen2-VL, Qwen2.5-VL and Qwen3-VL trained with the same
numerics as text models. ``models``: building, loading, freezing; ``compat``: transformers
without torchvision; ``inputs``: a prompt's pixels and M-RoPE positions through every batch
layout; ``images``: the images of a data row, checked when the data loads."""
