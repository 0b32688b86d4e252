"""Mixture-of-experts models (issue 48). ``models``: the tiny Qwen3-MoE and Qwen2-MoE
(built from a config); ``routing``: the routers of a model, the experts a forward chose
(recorded) and a forward that uses given experts (replayed: routing replay, R3)."""
