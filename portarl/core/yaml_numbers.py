"""YAML values both config layers (:class:`portarl.core.GRPOConfig` and the trainer's
sections) check the same way.

YAML 1.1 (PyYAML) reads ``1e-3`` or ``5e-4`` (no dot) as the *string* "1e-3": both layers
read such strings as the number they spell (:func:`number_from_yaml_string`), then
range-check it. A field annotated ``bool`` must hold true or false (YAML's yes / no / on /
off are read as such), not a string such as "maybe" (:func:`non_bool_field`).
"""

from __future__ import annotations

import dataclasses


def number_from_yaml_string(value, integer: bool = False):
    """The number a string such as ``"1e-3"`` spells (``integer``: a whole value as ``int``);
    anything else, a string that spells no number included, comes back unchanged for the
    caller's type check to name."""
    if not isinstance(value, str):
        return value
    try:
        parsed = float(value)
    except ValueError:
        return value
    return int(parsed) if integer and parsed.is_integer() else parsed


def non_bool_field(obj) -> tuple[str, object] | None:
    """``(name, value)`` of the first field of dataclass ``obj`` annotated ``bool`` whose
    value is not a bool, or None."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if str(f.type).replace(" ", "") == "bool" and not isinstance(value, bool):
            return f.name, value
    return None
