"""Field checks and parsing shared by the training-config sections: the error type, the
range checks every section's ``validate`` uses, exponent-notation coercion, and
``--set section.field=value`` overrides. Kept apart from :mod:`portarl.trainer.config`
(the sections themselves) so each reads on a screen.
"""

from __future__ import annotations

import dataclasses
import math

import yaml

from portarl.core.yaml_numbers import non_bool_field, number_from_yaml_string
from portarl.runtime.errors import ConfigError


def _check(cond: bool, field: str, message: str, value) -> None:
    if not cond:
        raise ConfigError(f"{field} {message}, got {value!r}")


def _coerce_numbers(obj, section: str) -> None:
    """Every field annotated ``int`` / ``float`` (optionally ``| None``): a string such as
    ``1e-3`` (YAML 1.1 reads exponent notation without a dot as a string) becomes the
    number; anything else that is not a finite number is an error naming the field. Range
    checks follow in each section's ``validate``. A field annotated ``bool`` must be true or
    false (YAML's yes / no / on / off included; not a string such as ``"maybe"``)."""
    if (bad := non_bool_field(obj)) is not None:
        raise ConfigError(f"{section}.{bad[0]} must be true or false, got {bad[1]!r}")
    for f in dataclasses.fields(obj):
        kind = str(f.type).replace(" ", "")
        base, _, rest = kind.partition("|")
        if base not in ("int", "float") or rest not in ("", "None"):
            continue
        v = getattr(obj, f.name)
        field = f"{section}.{f.name}"
        if v is None and rest == "None":
            continue
        if isinstance(v, str):
            v = number_from_yaml_string(v, integer=base == "int")
            if isinstance(v, str):
                raise ConfigError(f"{field} must be {'an integer' if base == 'int' else 'a finite number'}, got {v!r}")
            setattr(obj, f.name, v)
        if base == "float" and isinstance(v, int) and not isinstance(v, bool):
            continue
        ok = not isinstance(v, bool) and isinstance(v, int if base == "int" else float) and math.isfinite(v)
        _check(ok, field, "must be an integer" if base == "int" else "must be a finite number", v)


def _positive_int(obj, section: str, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        ok = isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
        _check(ok, f"{section}.{name}", "must be an integer " + (">= 0" if allow_zero else "> 0"), v)


def _number(obj, section: str, name: str, low: float | None = None, strict: bool = True, allow_none: bool = False):
    v = getattr(obj, name)
    if v is None and allow_none:
        return
    if isinstance(v, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
        try:
            v = float(v)
            setattr(obj, name, v)
        except ValueError:
            pass
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    _check(ok, f"{section}.{name}", "must be a finite number", v)
    if low is not None:
        _check(v > low if strict else v >= low, f"{section}.{name}", f"must be {'>' if strict else '>='} {low}", v)


def _mapping(name: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a mapping of fields, got {value!r}")
    return value


#: Fields that no longer exist but that configs saved by earlier versions hold (a
#: checkpoint's trainer state, a run's config.yaml): dropped on load so those checkpoints
#: still export and resume. Each only tuned a detector, never the training itself.
RETIRED_FIELDS = {"rollout": ("collapse_entropy",)}


def _build(section_cls, section: str, values: dict):
    known = {f.name for f in dataclasses.fields(section_cls)}
    values = {k: v for k, v in values.items() if k not in RETIRED_FIELDS.get(section, ())}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config field {section}.{unknown[0]}; {section} has: {', '.join(sorted(known))}")
    try:
        return section_cls(**values)
    except TypeError as err:
        raise ConfigError(f"{section}: {err}") from None


def apply_override(values: dict, item: str) -> None:
    """Apply ``section.field=value`` (value parsed as YAML) to a config mapping in place."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: use section.field=value")
    key, _, raw = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {item!r}: bad field name {key!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = values
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part} is not a section")
    node[parts[-1]] = value
