"""One GRPO step, phase by phase: the step's prompts and the rollout (:mod:`.rollout`, with
dynamic sampling and multi-turn episodes), scoring (rewards, shaping, old and reference
log-probs, advantages), the update (mini-batches, micro-batches, packing, the optimizer),
and the phases outside the GRPO step: evaluation and the SFT warm-up."""
