"""Helpers every ``portarl`` subcommand module shares (no torch at import: ``--help`` stays fast)."""

from __future__ import annotations

import argparse
import sys


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _int_at_least(low: int, why: str = ""):
    """An argparse type: an integer >= ``low`` (``why`` is added to the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{why}, got {value}")
        return value

    return parse


def _missing_train_extra(command: str) -> bool:
    """True (after logging the one-line install hint) when ``command`` needs the ``train``
    extra and it is not installed."""
    from portarl.cli.config import UsageError, require_train_extra

    try:
        require_train_extra(command)
    except UsageError as err:
        _log(f"portarl {command}: {err}")
        return True
    return False
