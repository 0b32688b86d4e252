"""The Triton interpreter's ``range(tensor, ...)`` on NumPy 2.4 and later.

Under ``TRITON_INTERPRET=1`` a scalar of a kernel (``tl.program_id(0)``, a size argument) is a
one-element 1-d numpy array, and ``range()`` turns it into a Python int through the
``__index__`` the interpreter gives ``tl.tensor`` while a kernel runs. Triton up to 3.6 spells
that ``int(data)``: NumPy 2.4 removed the conversion of a 1-d array to a scalar, so every
persistent loop (``for r in range(tl.program_id(0), n, tl.num_programs(0))``) raises
``TypeError: only 0-dimensional arrays can be converted to Python scalars`` there (a GPU
image with triton 3.6 and NumPy 2.5 hits it in the CPU suite). Triton 3.9 reads
``int(data.squeeze())``. :func:`patch_interpreter_index` probes the installed interpreter's
``__index__`` and, only where it fails on a one-element array, wraps the interpreter's tensor
patching so that ``__index__`` reads the single element the way 3.9 does. Compiled kernels are
not touched: the interpreter alone runs through this code. No value changes: the same
integer, where the old spelling raised.
"""

from __future__ import annotations

import types
import warnings

#: Set by :func:`patch_interpreter_index`: whether this process's interpreter was patched.
PATCHED: bool = False


def _index(self):
    return int(self.handle.data.reshape(-1)[0]) if self.handle.data.size == 1 else int(self.handle.data)


def _index_breaks(interpreter) -> bool:
    import numpy as np

    probe = type("_Probe", (), {})
    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(probe, scope)
    try:
        one = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([3], dtype=np.int32)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # NumPy 2.0-2.3: a DeprecationWarning before the TypeError
            return probe.__index__(one) != 3
    except (TypeError, DeprecationWarning):
        return True
    finally:
        scope.restore()


def patch_interpreter_index() -> bool:
    """Make the interpreter's ``tl.tensor.__index__`` take a one-element 1-d array, where the
    installed triton's does not (see the module docstring). Returns whether it patched."""
    global PATCHED
    if PATCHED:
        return True
    try:
        from triton.runtime import interpreter
        original = interpreter._patch_lang_tensor
        interpreter._LangPatchScope  # noqa: B018 - the layout the probe needs (triton 3.4+)
    except (ImportError, AttributeError):
        return False
    if not _index_breaks(interpreter):
        return False

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored (last in, first out) with the rest

    interpreter._patch_lang_tensor = _patch_lang_tensor
    PATCHED = True
    return True


#: No kernels here (host-side support of the interpreter). See :data:`portarl.kernels.logprobs.AOT_VARIANTS`.
AOT_VARIANTS: list = []
