"""The KL reference policy, as a context: a frozen copy of the initial model, or with LoRA
the training model itself with its adapter disabled.

Why a context and not a model: with LoRA the reference *is* the base model, which the
training model already holds; ``peft``'s ``disable_adapter()`` switches the adapter off
for the duration, so no second copy of the weights is made (the point of LoRA on a large
model). Leaving the context switches it back on, also after an error.
"""

from __future__ import annotations

import contextlib

from portarl.lora import is_lora


@contextlib.contextmanager
def reference_model(trainer):
    """Yield the module whose log-probs are the reference's (``ref_logp``)."""
    if is_lora(trainer.model):
        with trainer.model.disable_adapter():
            yield trainer.model
        return
    if trainer.ref_model is None:
        trainer.ref_model = trainer._make_reference()
    yield trainer.ref_model
