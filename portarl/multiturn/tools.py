"""Tools: plain Python functions the model may call (``tools: ["mymodule:calculator"]``).

A tool's JSON schema (what the chat template or portarl's tool prompt shows the model) comes
from its type hints and its Google-style docstring through transformers'
``get_json_schema``, as TRL's ``tools=`` and ``apply_chat_template(tools=...)`` do: a tool
without a docstring, or with an argument the docstring does not describe, is refused when
the config loads, with the tool named. A call's arguments are bound to the function's
signature before it runs: a missing or unknown argument is the model's mistake, answered
with an error message (``agent/tool_errors``), not a crash.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from portarl.assets.rewards import _import


def load_object(spec: str, search_dirs, setting: str):
    """``"package.module:attr"`` imported as Python would, else from ``search_dirs`` (the
    working directory and the config file's directory, as for rewards)."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{setting}: {spec!r} must be 'module:name' (a Python module and a function in it)")
    module_name, _, attr = spec.partition(":")
    dirs = [str(Path(d).resolve()) for d in search_dirs]
    try:
        return getattr(_import(module_name, dirs), attr)
    except (ImportError, AttributeError) as err:
        where = f" (looked on sys.path and in {', '.join(dirs)})" if dirs else ""
        raise ValueError(f"{setting}: {spec!r} cannot be loaded: {err}{where}") from None


@dataclasses.dataclass
class Tool:
    name: str
    fn: object
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

    def bind_error(self, arguments: dict) -> str | None:
        """Why ``fn(**arguments)`` cannot be called (missing / unknown argument), or None."""
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as err:
            return str(err)
        except ValueError:  # no signature to check: the call decides
            return None
        return None


def tool_schema(fn, setting: str) -> dict:
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        raise ImportError("tools need transformers for their JSON schema (pip install 'portarl[train]')") from None
    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
        raise ValueError(f"{setting}: cannot build the JSON schema of {getattr(fn, '__name__', fn)!r}: {err} (a tool "
                         "needs type hints and a Google-style docstring with an 'Args:' line per argument)") from None


def load_tools(specs, search_dirs=(), with_schema: bool = True) -> dict[str, Tool]:
    """``{name: Tool}`` for ``specs`` (``module:function`` strings or callables), in order.
    ``with_schema=False`` (the tool process, which only calls them): named after the
    function, no schema built (no transformers import)."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs or []):
        setting = f"tools[{i}]"
        fn = spec if callable(spec) else load_object(spec, search_dirs, setting)
        if not callable(fn):
            raise ValueError(f"{setting}: {spec!r} is not callable")
        schema = tool_schema(fn, setting) if with_schema else {"function": {"name": fn.__name__}}
        name = schema["function"]["name"]
        if name in tools:
            raise ValueError(f"{setting}: a second tool named {name!r} (tool names must be distinct)")
        tools[name] = Tool(name, fn, schema)
    return tools


__all__ = ["Tool", "load_object", "load_tools", "tool_schema"]
