"""The agent side of a run, built once from the config: the tools and their schemas, the
environment factories, the tool-call parser, the renderer of appended messages and the
executor that runs tools and environments (in this process or a child one).

The same :func:`make_agent` serves the trainer (colocated mode) and the asynchronous rollout
worker (``rollout.mode: async``: the episodes, and so the tools, run on the worker's side).
"""

from __future__ import annotations

import dataclasses

from portarl.multiturn.environment import load_factories
from portarl.multiturn.observations import ObservationCap
from portarl.multiturn.parsing import detect_format, make_parser
from portarl.multiturn.render import Renderer, declares_tools, tool_system_text
from portarl.multiturn.settings import is_multiturn
from portarl.multiturn.tools import load_tools


@dataclasses.dataclass
class Agent:
    codec: object
    tools: dict                 # name -> Tool
    factories: dict             # environment name (None: the single one) -> factory
    parse: object               # text -> ParsedReply
    renderer: Renderer
    executor: object            # LocalExecutor or ProcessExecutor: run(op, *args) -> CallOutcome
    template_tools: bool        # the chat template renders tools and tool messages itself
    max_turns: int
    max_episode_tokens: int | None
    tool_format: str
    observations: ObservationCap    # rollout.max_tool_tokens: every tool result and observation cut to it

    def close(self) -> None:
        """Stop the executor's process or forget its environments (every exit path)."""
        self.executor.close()


def configure_codec(codec, tools: dict, fmt: str) -> bool:
    """Put the tools where the prompt shows them; returns whether the template renders them."""
    if not tools:
        return False
    schemas = [t.schema for t in tools.values()]
    if declares_tools(codec.template):
        codec.tools = schemas
        return True
    if fmt not in ("auto", "hermes"):
        raise ValueError(f"rollout.tool_format={fmt!r}: the chat template declares no tools, so portarl describes them "
                         "itself in the system message, in the hermes format; set rollout.tool_format=hermes (or auto) "
                         "or use a template that declares tools (data.chat_template)")
    codec.tool_system = tool_system_text(schemas)
    return False


def make_agent(cfg, codec, search_dirs=()) -> Agent | None:
    """The run's :class:`Agent`, or None when the config has neither tools nor an environment.
    Sets the codec's tools (so every prompt is encoded with them)."""
    if not is_multiturn(cfg):
        return None
    r = cfg.rollout
    tools = load_tools(cfg.tools, search_dirs)
    factories = load_factories(cfg.environment, search_dirs)
    template_tools = configure_codec(codec, tools, r.tool_format)
    fmt = detect_format(codec.template, template_tools) if r.tool_format == "auto" else r.tool_format
    renderer = Renderer(codec)
    if r.tool_isolation == "process":
        from portarl.multiturn.sandbox import ProcessExecutor

        executor = ProcessExecutor(cfg.tools, cfg.environment, search_dirs, r.tool_timeout_s)
    else:
        from portarl.multiturn.operations import LocalExecutor

        executor = LocalExecutor(tools, factories, r.tool_timeout_s)
    return Agent(codec, tools, factories, make_parser(fmt, codec.tokenizer), renderer, executor, template_tools,
                 r.max_turns, r.max_episode_tokens, fmt, ObservationCap(codec, r.max_tool_tokens, r.tool_truncate_side))


__all__ = ["Agent", "configure_codec", "make_agent"]
