"""The ``portarl`` command line: :func:`main` (the console script and ``python -m portarl``)
and one module per group of subcommands.

- :mod:`.main`: the parser, the exit codes, and how a command starts and ends (the
  supervising parent of ``train`` / ``sft`` / ``eval``: :mod:`portarl.runtime.supervisor`);
- :mod:`.train`: ``train`` and ``sft``, and every check they share before training;
- :mod:`.config`: reading a config file and ``--set``; :mod:`.common`: what every command shares;
- :mod:`.plan`: ``plan``; :mod:`.bench`: ``bench``; :mod:`.episodes`: ``episodes``.

Nothing here imports torch at module level: ``portarl --help`` answers at once.
"""

from portarl.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
