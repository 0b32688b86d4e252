"""The configuration reference (docs/configuration.md), generated from the config
dataclasses so it cannot drift from the code: every field of every section, its type,
its default (as the defaults are built: the ``loss`` section's are the trainer's, not
GRPOConfig's bare ones) and its ``#:`` comment, or the attribute docstring when there is
one.

    python tools/config_reference.py           # print the markdown
    python tools/config_reference.py --write   # put it into docs/configuration.md (make config-reference)
    python tools/config_reference.py --check   # exit 1 when docs/configuration.md differs from the code

The page holds it in full between the ``CONFIG_FIELDS`` markers, so it reads on GitHub as
on the built site; ``tests/test_docs_config.py`` fails when the committed text differs from
what the code generates (a field added, a default or a comment changed).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = ("<!-- CONFIG_FIELDS: generated from the config dataclasses by `python tools/config_reference.py --write` "
         "(make config-reference): edit the code, not this table -->")
END = "<!-- /CONFIG_FIELDS -->"


def _field_comments(cls) -> dict[str, str]:
    """``#:`` comment lines right above each field (Sphinx's attribute-comment style), and a
    string literal right below it (an attribute docstring)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    group = None
    field_re = re.compile(r"^\s{4}([A-Za-z_][A-Za-z0-9_]*)\s*:\s*[^=]+(=.*)?$")
    last = None
    for line in lines[1:]:
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = field_re.match(line)
        if m and not stripped.startswith(("def ", "@", "return")) and line.startswith("    ") and not line.startswith("     "):
            if pending:
                out[m.group(1)], group = " ".join(pending), m.group(1)
            elif last is not None and group is not None:  # one comment above a run of fields
                out[m.group(1)] = f"See `{group}`."
            else:
                out[m.group(1)] = ""
            pending, last = [], m.group(1)
            continue
        if not stripped:
            group = None
        if last and stripped.startswith(('"""', "'''")) and not out.get(last):
            out[last] = stripped.strip("\"' ")
        pending = [] if not stripped.startswith("#") else pending
        last = None if stripped and not stripped.startswith(('"""', "'''")) else last
    return out


def _type_name(tp) -> str:
    if isinstance(tp, str):
        return tp
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _default(obj, name):
    value = getattr(obj, name)
    if dataclasses.is_dataclass(value):
        return None
    return value


def _fmt(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    return f"`{value!r}`".replace("|", "\\|")


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_table(prefix: str, instance) -> tuple[list[str], list]:
    """One markdown table of the plain fields of ``instance``; its dataclass fields come back
    as ``(prefix, instance)`` to be tabled as sections of their own."""
    comments = {}
    for klass in reversed(type(instance).__mro__):
        if dataclasses.is_dataclass(klass):
            comments.update(_field_comments(klass))
    hints = typing.get_type_hints(type(instance))
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f"{prefix}{f.name}.", value))
            continue
        tp = _type_name(hints.get(f.name, f.type))
        meaning = re.sub(r"^See `([^`]+)`\.$", lambda m: f"See `{prefix}{m.group(1)}`.", comments.get(f.name, ""))
        rows.append(f"| `{prefix}{f.name}` | `{_escape(tp)}` | {_fmt(value) if not isinstance(value, list) else _list(value)} "
                    f"| {_escape(meaning)} |")
    return rows, nested


def _list(value) -> str:
    if value and dataclasses.is_dataclass(value[0]):
        return "<br>".join(_fmt(v.to_dict() if hasattr(v, "to_dict") else dataclasses.asdict(v)) for v in value)
    return _fmt(value)


def reference() -> str:
    from portarl.trainer.config import TrainConfig
    from portarl.trainer.config.lora import LoraSection

    config = TrainConfig()
    out = ["Every field of a `portarl train` / `portarl sft` config, by section (YAML: `section: {field: value}`; "
           "command line: `--set section.field=value`). Generated from the config dataclasses "
           "(`portarl/trainer/config/`, `portarl/core/config.py`) by `tools/config_reference.py`; the test "
           "suite fails when this page differs from the code.", ""]
    top, sections = section_table("", config)
    out += ["## Top level", "", *top, ""]
    lora = ("model.lora.", LoraSection())  # optional (null by default): its fields when set
    pending = [*sections, lora]
    while pending:  # a section's own sections (logging.wandb) follow it, each with a table of its own
        prefix, instance = pending.pop(0)
        rows, nested = section_table(prefix, instance)
        title = prefix.rstrip(".")
        note = " (null by default: LoRA off; set any field, e.g. `model.lora.r=8`, to turn it on)" if title == "model.lora" else ""
        out += [f"## `{title}`{note}", "", *rows, ""]
        pending[:0] = nested
    from portarl.assets.rewards import BUILTIN_REWARDS

    builtins = ", ".join(f"`{name}`" for name in BUILTIN_REWARDS)
    from portarl.trainer.config import RewardSpec

    rows, _ = section_table("rewards[].", RewardSpec())
    out += ["## `rewards`", "", f"A list of `{{name, weight}}`: `name` is a built-in reward ({builtins}; `environment` "
            "is the reward of an episode's environment: [agents](agents.md)) or `module:function` (looked up in the "
            "config file's directory, then the working directory); `{model: PATH, ...}`: a reward model; "
            "`{judge: URL, model: NAME, ...}`: a generative judge ([Reward models and judges]"
            "(models-and-data.md#reward-models-and-judges)). Unset fields are left out of config.yaml.", "", *rows, ""]
    return "\n".join(out)


def field_names() -> set[str]:
    """Every dotted field name the reference lists (the test checks it against the dataclasses)."""
    return set(re.findall(r"^\| `([^`]+)` \|", reference(), flags=re.M))


def committed(page: str) -> str | None:
    """The reference as ``page`` (docs/configuration.md's text) holds it, or None without markers."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        return None
    return page[start + len(BEGIN) : end].strip("\n")


def with_reference(page: str) -> str:
    """``page`` with the text between the markers replaced by :func:`reference`."""
    if committed(page) is None:
        raise ValueError(f"{PAGE} has no {BEGIN[:20]}... / {END} markers")
    start, end = page.find(BEGIN) + len(BEGIN), page.find(END)
    return page[:start] + "\n\n" + reference().strip("\n") + "\n\n" + page[end:]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        PAGE.write_text(with_reference(PAGE.read_text()))
        return 0
    if argv == ["--check"]:
        if committed(PAGE.read_text()) != reference().strip("\n"):
            print(f"{PAGE} differs from the config dataclasses: run python tools/config_reference.py --write",
                  file=sys.stderr)
            return 1
        return 0
    if argv:
        print("usage: python tools/config_reference.py [--write | --check]", file=sys.stderr)
        return 2
    print(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
