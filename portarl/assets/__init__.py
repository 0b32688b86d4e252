"""What a run is built from: the model and its tokenizer, LoRA adapters, the data, and the
rewards that score it.

- :mod:`.models`: a local Hugging Face directory, a ``.gguf`` file or a built-in tiny model
  (``tiny``, ``tiny-chat``), loaded and saved; :mod:`.tokenizer`: the tokenizers and the
  chat-template codec that turns a prompt into the ids the model reads;
- :mod:`.lora`: LoRA through peft (wrapping, merged weights, adapter files);
- :mod:`.data`: prompt / answer rows from JSONL, Parquet or the built-in arithmetic;
- :mod:`.rewards`: the built-in rewards and how a ``module:function`` is found;
  :mod:`.reward_runner`: every reward of a batch called through the user-code guard.

A checkpoint turned back into a model directory is the trainer's
(:mod:`portarl.trainer.checkpoint.export`): it reads the trainer's checkpoint files.
"""
