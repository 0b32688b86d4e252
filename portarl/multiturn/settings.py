"""The multi-turn settings of a training config (``tools``, ``environment``, ``rollout.max_turns``
and the other ``rollout.*`` episode fields) checked with the rest of the config: what they
must look like, and what multi-turn episodes cannot be combined with yet."""

from __future__ import annotations

from portarl.runtime.errors import ConfigError


def is_multiturn(cfg) -> bool:
    return bool(cfg.tools) or cfg.environment is not None


def check_agent_config(cfg) -> None:
    if not isinstance(cfg.tools, list) or not all(isinstance(t, str) and t.count(":") == 1 for t in cfg.tools):
        raise ConfigError(f"tools must be a list of 'module:function' strings, got {cfg.tools!r}")
    env = cfg.environment
    if env is not None and not (isinstance(env, str) or (isinstance(env, dict) and env and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()))):
        raise ConfigError(f"environment must be 'module:factory' or a mapping of names to 'module:factory', got {env!r}")
    wants_env_reward = any(spec.name == "environment" for spec in cfg.rewards)
    if wants_env_reward and env is None:
        raise ConfigError("rewards: the built-in reward 'environment' needs an environment (set environment: "
                          "module:factory)")
    if not is_multiturn(cfg):
        return
    if cfg.rollout.dynamic_sampling:
        raise ConfigError("rollout.dynamic_sampling with tools or an environment is not implemented yet (its extra "
                          "rounds generate single turns): set rollout.dynamic_sampling=false")
    if cfg.shaping.overlong_buffer:
        raise ConfigError("shaping.overlong_buffer with tools or an environment: an episode's length is not bounded by "
                          "rollout.max_new_tokens (it spans turns and tool outputs); set shaping.overlong_buffer=0")
    if cfg.data.chat_template == "none":
        raise ConfigError("tools and environments need a chat template (data.chat_template is 'none')")


__all__ = ["check_agent_config", "is_multiturn"]
