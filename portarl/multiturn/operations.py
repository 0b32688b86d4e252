"""The calls an episode makes into user code, on whichever side runs them: this process
(``rollout.tool_isolation: none``, :class:`LocalExecutor`) or a child process
(``process``, :mod:`portarl.multiturn.sandbox`). Both sides run the same
:class:`Operations`, so a tool or environment behaves the same in either mode; only JSON
values go in and out.
"""

from __future__ import annotations

from portarl.multiturn.calls import CallOutcome, call_with_limit
from portarl.multiturn.leftovers import Leftovers
from portarl.runtime.user_code import UserCodeGuard
from portarl.multiturn.environment import check_made, check_reward, normalize_step, setting_of


class Operations:
    """Tool calls and the environments of the episodes in flight (keyed by episode)."""

    def __init__(self, tools: dict, factories: dict):
        self.tools = {name: getattr(t, "fn", t) for name, t in tools.items()}
        self.factories = factories
        self.envs: dict[str, object] = {}

    def tool(self, name: str, arguments: dict):
        return self.tools[name](**arguments)

    def env_reset(self, key: str, env_name: str | None, row: dict):
        env = self.factories[env_name]()
        check_made(env, setting_of(env_name))
        self.envs[key] = env
        observation = env.reset(row)
        if observation is not None and not isinstance(observation, str):
            raise ValueError(f"reset() must return a string or None, got {type(observation).__name__}")
        return observation

    def env_step(self, key: str, message: str):
        return normalize_step(self.envs[key].step(message))

    def env_reward(self, key: str):
        get = getattr(self.envs[key], "get_reward", None)
        return check_reward(get()) if callable(get) else None

    def env_close(self, key: str):
        env = self.envs.pop(key, None)
        close = getattr(env, "close", None)
        if callable(close):
            close()


OPS = ("tool", "env_reset", "env_step", "env_reward", "env_close")


class LocalExecutor:
    """``run(op, *args) -> CallOutcome``: an operation in this process, time-limited by
    :func:`~portarl.multiturn.calls.call_with_limit` (one guard: the episodes call from
    one thread). The processes a call leaves running are ended at :meth:`close`
    (:class:`~portarl.multiturn.leftovers.Leftovers`)."""

    def __init__(self, tools: dict, factories: dict, timeout_s: float):
        self.ops = Operations(tools, factories)
        self.guard = UserCodeGuard(timeout_s, "rollout.tool_timeout_s")
        self.leftovers = Leftovers()

    def run(self, op: str, *args) -> CallOutcome:
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}")
        key = args[0] if op.startswith("env_") and op != "env_reset" else None
        if key is not None and key not in self.ops.envs:
            return CallOutcome(False, kind="lost", error="the environment is gone (an earlier call failed)")
        with self.leftovers.watch():
            return call_with_limit(self.guard, getattr(self.ops, op), args, what=self._what(op, args))

    def _what(self, op: str, args: tuple) -> str:
        """The call as the user wrote it: "tool 'search'", "environment 'CountEnv' step()"."""
        if op == "tool":
            return f"tool {args[0]!r}"
        env = self.ops.factories.get(args[1]) if op == "env_reset" else type(self.ops.envs.get(args[0]))
        name = getattr(env, "__qualname__", None) or getattr(env, "__name__", None) or "environment"
        return f"environment {name!r} {op[4:]}()"

    def forget(self, key: str) -> None:
        """Drop an episode's environment without calling it (it failed or hung)."""
        self.ops.envs.pop(key, None)

    def close(self) -> None:
        """Forget the environments, stop and join the guard's watchdog thread, and end the
        processes the calls left running."""
        self.ops.envs.clear()
        self.guard.close()
        self.leftovers.close()


__all__ = ["LocalExecutor", "OPS", "Operations"]
