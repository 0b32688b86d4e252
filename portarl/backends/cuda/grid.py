"""How many programs a launch of portarl's Triton kernels gets: never more than
:data:`MAX_PROGRAMS`, whatever the rows or elements.

Every launchable kernel in :mod:`portarl.kernels` loops over its work items (rows, (row,
column block) pairs, output tiles, element blocks) as ``pid, pid + programs, ...``: a
persistent grid. Why a cap: triton-ascend maps a grid onto the NPU's physical cores and
refuses more than 65535 programs, and the row kernels used to launch one program per row
(a 1,000,000-row batch is 1,000,000 programs). On CUDA the same cap costs nothing: 65535
programs are hundreds per SM, each item is still computed by one program with the same
operations in the same order (bitwise the results of one program per item), and a batch
of up to 65535 rows launches exactly as before.

:data:`MAX_PROGRAMS` is read at every launch, so tests can lower it to run the loops
under the interpreter.
"""

from __future__ import annotations

#: Programs per launch, at most (Ascend's limit; a persistent loop covers the rest).
MAX_PROGRAMS = 65535


def programs(items: int) -> tuple[int]:
    """The 1-D grid for ``items`` work items: ``(min(items, MAX_PROGRAMS),)``, at least 1."""
    return (max(1, min(int(items), MAX_PROGRAMS)),)
