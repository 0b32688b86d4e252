"""``rollout.mode: async``: the trainer's side of the rollout pipeline (the worker's client,
the published weights, the batches in flight kept for ``--resume``)."""
