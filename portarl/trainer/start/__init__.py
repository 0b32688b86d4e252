"""The run's start, before the first step: ``preflight`` checks the config against the data and
the user's code before any model loads, ``build`` turns a config into the data, the policy and a
trainer, ``setup`` places the model (devices, precision, LoRA, FSDP2) and checks the distributed
settings."""
