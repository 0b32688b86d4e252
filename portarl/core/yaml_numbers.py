"""Numbers written in exponent notation in YAML files.

YAML 1.1 (PyYAML) reads ``1e-3`` or ``5e-4`` (no dot) as the *string* "1e-3". Both config
layers (:class:`portarl.core.GRPOConfig` and the trainer's sections) read such strings as
the number they spell, with this one function, then range-check the number.
"""

from __future__ import annotations


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
