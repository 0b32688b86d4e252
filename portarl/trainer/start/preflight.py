"""What ``portarl train`` checks of the user's own code, and of where the async rollout
workers run, after the config and the data load and before the model does.

Why: every mistake there used to surface late. A tool without a docstring, an environment
class without ``step()`` or a reward with the wrong signature was found only once the model
had loaded (35-100 s later than every other config error); a batched reward that cannot take
a multi-turn run's ``conversation`` column only after a whole rollout (exit 3); an
environment factory that returns None, or a per-row environment mapping over data without an
``environment`` column, not at all until the episodes failed (a run that exits 0 having
trained on nothing, or a traceback); ``rollout.worker_devices: [cuda:0]`` on a CPU-only torch
only in the worker's start-up. Here each is one line and exit 2
(:mod:`portarl.cli.train`), in this order: worker devices, tools, environments, the data's
rows against the environment mapping, rewards against the data's columns.

What runs user code: importing the modules the config names (as the trainer would anyway)
and, for an environment factory that is a *function* (not a class), one call of it (per
process: each rank under torchrun) with the user-code guard and ``rollout.tool_timeout_s``,
to see what it returns; the object is closed (its ``close()``) and dropped. A class is checked by reading its methods: nothing is made.
With ``rollout.tool_isolation: process`` no factory is called in the trainer's process (the
isolation exists to keep the environment's code out of it): there a factory function that
returns None fails every episode of the first step, which stops the run (exit 3, naming it).

API::

    from portarl.trainer.start.preflight import check_user_code, check_worker_devices

    check_worker_devices(config)          # ValueError naming rollout.worker_devices and the fix
    check_user_code(config, examples)     # ValueError, one line, naming the tool / environment / reward
"""

from __future__ import annotations

from portarl.runtime.user_code import UserCodeError


def check_worker_devices(config) -> None:
    """``rollout.worker_devices`` naming a device this torch cannot use (``cuda:0`` on a
    CPU-only build, a device index past those visible): the workers would fail at their
    start, after the trainer had built everything."""
    from portarl.backends.device import DeviceUnavailableError, resolve_device

    for device in config.rollout.worker_devices or ():
        try:
            resolve_device(str(device))
        except DeviceUnavailableError as err:
            raise ValueError(f"rollout.worker_devices: {err}; list devices this machine has, or remove "
                             "rollout.worker_devices (every worker then runs on the trainer's device)") from None


def check_user_code(config, examples: list) -> None:
    """Tools, environments and rewards of ``config`` against the training rows ``examples``
    (the module docstring); raises ValueError with one line."""
    from portarl.multiturn.settings import is_multiturn
    from portarl.assets.reward_runner import column_names

    dirs = config.code_search_dirs()
    columns = column_names(examples)
    try:
        if is_multiturn(config):
            from portarl.trainer.phases.episodes import episode_columns

            check_agent_code(config, examples, dirs)
            columns += [k for k in episode_columns(config.environment is not None) if k not in columns]
        check_rewards(config, examples, columns, dirs)
    except UserCodeError as err:  # a reward's signature (RewardError), as one line
        raise ValueError(str(err)) from None


def check_agent_code(config, examples: list, dirs) -> None:
    """The tools' JSON schemas, the environment factories (each probed once unless
    ``rollout.tool_isolation: process``) and, with a mapping, every row's ``environment``."""
    from portarl.multiturn.environment import check_rows, load_factories, probe_factory, setting_of
    from portarl.multiturn.tools import load_tools

    load_tools(config.tools, dirs)
    factories = load_factories(config.environment, dirs)
    if config.rollout.tool_isolation == "none":
        for name, factory in factories.items():
            spec = config.environment if name is None else config.environment[name]
            probe_factory(factory, f"{setting_of(name)}: {spec!r}", config.rollout.tool_timeout_s)
    check_rows(examples, list(factories))


def check_rewards(config, examples: list, columns: list[str], dirs) -> None:
    """Each reward resolves and takes its form's arguments; a batched one takes ``columns``
    (the data's, and a multi-turn run's ``conversation`` / ``env_reward``) as keywords; the
    rows hold an answer where a per-sample reward (or the SFT warm-up) needs one."""
    from portarl.assets.reward_runner import RewardRunner
    from portarl.trainer.start.setup import check_answers

    with RewardRunner(config.rewards, search_dirs=dirs, timeout_s=None, load=False) as runner:
        for rf in runner.functions:
            if rf.batched:
                rf.check_columns(columns)
        check_answers(examples, runner.needs_answer, config)


__all__ = ["check_agent_code", "check_rewards", "check_user_code", "check_worker_devices"]
