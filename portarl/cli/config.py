"""What ``portarl train``, ``sft`` and ``plan`` read from the user and check before anything
runs: the ``train`` extra, the config (file, ``--set``, command-line overrides) and the model
directory. A mistake is a :class:`UsageError`: one line on stderr, exit 2, no traceback.
Below :mod:`portarl.cli.train`, :mod:`portarl.cli.plan` and :mod:`portarl.cli.common`, which
all use it.

Nothing here imports torch or transformers at module level: ``portarl --help`` stays fast.
"""

from __future__ import annotations

import sys

#: Modules of the ``train`` extra, as imported (the package name differs for yaml).
TRAIN_EXTRA_MODULES = ("yaml", "transformers", "safetensors", "tqdm")

#: A model directory needs one of these weight files ...
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: ... and one of these tokenizer files (portarl's character tokenizer, or a Hugging Face
#: one). Without them an empty tokenizer loads and the first error comes at rollout time.
_TOKENIZER_FILES = ("portarl_char_tokenizer.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")


class UsageError(Exception):
    """A user mistake: printed as ``portarl <command>: <message>``, exit 2."""


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def require_train_extra(command: str) -> None:
    """A plain ``pip install portarl`` has the ops, not the trainer: say which extra to add."""
    missing = []
    for name in TRAIN_EXTRA_MODULES:
        try:
            __import__(name)
        except ImportError:
            missing.append("pyyaml" if name == "yaml" else name)
    if missing:
        raise UsageError(f"needs the training extra: pip install 'portarl[train]' (missing: {', '.join(missing)})")


def _yaml_error(path, err) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"config file {path}: YAML syntax error at{where}: {problem}"


def load_config(args, command: str):
    from portarl.runtime.startup_signals import deferred

    with deferred():  # torch's native modules initialise here: a signal waits for the import's end
        import yaml

        from portarl.trainer.config import ConfigError, TrainConfig

    overrides = list(args.set or [])
    if args.steps is not None:
        if args.steps <= 0:
            raise UsageError(f"--steps must be an integer > 0, got {args.steps}")
        if command == "train":
            overrides.append(f"train.steps={args.steps}")
    if args.device:
        overrides.append(f"device={args.device}")
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    try:
        return TrainConfig.load(args.config, overrides)
    except ConfigError as err:
        raise UsageError(f"config error: {err}") from None
    except yaml.YAMLError as err:
        raise UsageError(_yaml_error(args.config, err)) from None
    except (TypeError, ValueError) as err:  # a value of the wrong type that a check compared before testing it
        raise UsageError(f"config error: {err}") from None


def check_model_dir(path: str) -> None:
    """A local model directory must hold a config, weights and tokenizer files; a ``.gguf``
    file (or ``package:<pkg>/<file>.gguf``) must exist."""
    from portarl.assets.tokenizer import BUILTIN_MODELS

    if path in BUILTIN_MODELS:
        return
    from portarl.assets.models import resolve_model_path

    try:
        directory = resolve_model_path(path)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    if directory.suffix == ".gguf":
        if not directory.is_file():
            raise UsageError(f"model.path {path!r}: GGUF file {directory} does not exist")
        return
    if not directory.is_dir():
        raise UsageError(f"model.path {path!r} is neither 'tiny', 'tiny-chat', a directory nor a .gguf file")
    names = {p.name for p in directory.iterdir()}
    if "config.json" not in names:
        raise UsageError(f"model directory {directory} has no config.json (a Hugging Face model directory, "
                         "save_pretrained output, or 'tiny' / 'tiny-chat')")
    if not names & set(_WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        raise UsageError(f"model directory {directory} has no weights (model.safetensors or pytorch_model.bin)")
    if not names & set(_TOKENIZER_FILES):
        raise UsageError(f"model directory {directory} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:4])}, ...): "
                         "save the tokenizer next to the model (tokenizer.save_pretrained)")
