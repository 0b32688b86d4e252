"""``portarl episodes RUN``: the samples a run logged (``samples.jsonl``), turn by turn,
as the trainer scored them.

    portarl episodes RUN [--step N] [--sample K] [--ids] [--tokens]

Each sample is printed as the runs of its token ids by who wrote them (``segments``,
:mod:`portarl.trainer.run.samples`): the prompt exactly as the model saw it (chat
template, tools' description, the environment's ``reset()`` text), each model turn, each
appended tool result or observation, with its token count and loss mask (1: the loss covers
it), and its text, special tokens kept. Then what came after the model's last turn and was
never appended (``unread``), and the totals. ``--ids`` adds each run's token ids;
``--tokens`` prints one token a line (position, id, loss mask, its text), decoded with the
tokenizer saved in the run's newest checkpoint, which must decode every run back to its
recorded text (so the pieces are this run's).

Reads JSON only (no torch): quick on a laptop with a copy of the run directory. Exit 2 with
one line on stderr when the run, the step or the sample is not there.
"""

from __future__ import annotations

import json
from pathlib import Path

from portarl.cli.common import _int_at_least, _log


class EpisodesError(ValueError):
    """What the command cannot show, said in one line."""


def add_parser(commands) -> None:
    """The ``episodes`` subcommand, on the top-level parser's ``commands``."""
    p = commands.add_parser(
        "episodes", help="a run's logged samples turn by turn: token ids, who wrote them, the loss mask",
        description="Print the samples a run logged (samples.jsonl) as the trainer scored them: the prompt "
                    "exactly as the model saw it, each model turn, tool result and observation, with token counts, "
                    "the loss mask and the text (special tokens kept).")
    p.add_argument("run", help="the run's output directory (holding samples.jsonl)")
    p.add_argument("--step", type=_int_at_least(1), default=None, help="the step (default: the last one logged)")
    p.add_argument("--sample", type=_int_at_least(0), default=None,
                   help="the sample index within the step (default: every sample logged at that step)")
    p.add_argument("--ids", action="store_true", help="also print each run's token ids")
    p.add_argument("--tokens", action="store_true",
                   help="one token a line: position, id, loss mask, text (decoded with the tokenizer of the run's "
                        "newest checkpoint)")
    p.set_defaults(func=cmd_episodes)


def cmd_episodes(args) -> int:
    try:
        rows, skipped = read_rows(Path(args.run))
        chosen = choose(rows, args.step, args.sample)
        decode_one = token_decoder(Path(args.run), chosen) if args.tokens else None
    except EpisodesError as err:
        _log(f"portarl episodes: {err}")
        return 2
    if skipped:
        _log(f"portarl episodes: skipped {skipped} line(s) of samples.jsonl that are not JSON (a write cut short?)")
    print("\n\n".join(format_row(row, ids=args.ids, decode_one=decode_one) for row in chosen))
    return 0


def read_rows(run: Path) -> tuple[list[dict], int]:
    """The rows of ``run/samples.jsonl`` and how many lines were not JSON objects."""
    path = run / "samples.jsonl"
    if not run.is_dir():
        raise EpisodesError(f"RUN {run} is not a directory (pass a run's output directory)")
    if not path.is_file():
        raise EpisodesError(f"{path} does not exist: the run logged no samples (logging.samples_every=0, or it "
                            "stopped before its first step)")
    rows, skipped = [], 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
            elif line.strip():
                skipped += 1
    if not rows:
        raise EpisodesError(f"{path} holds no samples")
    return rows, skipped


def choose(rows: list[dict], step: int | None, sample: int | None) -> list[dict]:
    """The rows of ``step`` (None: the last step logged), only ``sample`` when given. A later
    row of the same step and sample (a resumed run that logged the step again) wins."""
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if step is None else step
    at = {r.get("sample"): r for r in rows if r["step"] == step}
    if not at:
        raise EpisodesError(f"--step {step}: no samples logged at that step; logged steps: {_spans(steps)} "
                            "(logging.samples_every)")
    if sample is None:
        return [at[k] for k in sorted(at, key=lambda k: (k is None, k))]
    if sample not in at:
        logged = ", ".join(str(k) for k in sorted(k for k in at if k is not None))
        raise EpisodesError(f"--sample {sample}: not logged at step {step}; logged samples: {logged} "
                            "(logging.samples_count)")
    return [at[sample]]


def _spans(values: list[int], shown: int = 12) -> str:
    text = ", ".join(str(v) for v in values[:shown])
    return text + (f", ... {values[-1]} ({len(values)} steps)" if len(values) > shown else "")


def format_row(row: dict, *, ids: bool = False, decode_one=None) -> str:
    """One sample as the command prints it (see the module docstring)."""
    head = f"step {row['step']}, sample {row.get('sample')}: finish {row.get('finish_reason')}"
    if "turns" in row:
        head += f", {row['turns']} turn(s)"
    head += f", reward {row.get('reward')}, advantage {row.get('advantage')}"
    lines = [head]
    segments = row.get("segments")
    if segments is None:
        lines.append("  (no token ids: this row was written before samples.jsonl carried segments)")
        lines += _block("prompt", row.get("prompt", ""))
        for m in row.get("conversation") or [{"role": "assistant", "content": row.get("completion", "")}]:
            lines += _block(f"{m.get('role')} ({m.get('tokens', '?')} tokens)", m.get("content") or "")
    else:
        position = 0
        for seg in segments:
            lines.append(f"  {seg['role']:<12} {len(seg['ids']):>6} tokens  loss {_loss_text(seg['loss_mask'])}")
            if ids:
                lines.append("    ids: " + " ".join(str(i) for i in seg["ids"]))
            if decode_one is None:
                lines += _block(None, seg["text"])
            else:
                masks = seg["loss_mask"] if isinstance(seg["loss_mask"], list) else [seg["loss_mask"]] * len(seg["ids"])
                for token, mask in zip(seg["ids"], masks):
                    lines.append(f"    {position:>6} {token:>8}  {mask}  {decode_one(token)!r}")
                    position += 1
        after = sum(len(s["ids"]) for s in segments[1:])
        trained = sum(_trained(s) for s in segments)
        lines.append(f"  {len(segments[0]['ids'])} prompt tokens, {after} after it, {trained} in the loss")
    for m in row.get("unread") or []:
        lines += _block(f"unread {m.get('role')} (after the model's last turn, never appended: the model did not "
                        "read it)", m.get("content") or "")
    return "\n".join(lines)


def _loss_text(mask) -> str:
    if isinstance(mask, list):
        return f"mixed ({sum(mask)} of {len(mask)})"
    return str(mask)


def _trained(seg: dict) -> int:
    mask = seg["loss_mask"]
    return sum(mask) if isinstance(mask, list) else mask * len(seg["ids"])


def _block(title: str | None, text: str) -> list[str]:
    """``text`` indented under ``title``, each of its lines marked (blank and trailing
    whitespace stay visible)."""
    lines = [f"  {title}"] if title is not None else []
    return lines + [f"    | {line}" for line in text.split("\n")]


def token_decoder(run: Path, rows: list[dict]):
    """``id -> text`` with the tokenizer of the run's newest checkpoint that has one, after
    checking that it decodes every segment of ``rows`` to its recorded text."""
    from portarl.assets.tokenizer import CHAR_TOKENIZER_FILE, load_tokenizer

    saved = [d for d in sorted((run / "checkpoints").glob("step-*"), reverse=True)
             if (d / CHAR_TOKENIZER_FILE).is_file() or (d / "tokenizer_config.json").is_file()]
    if not saved:
        raise EpisodesError(f"--tokens decodes each token with the run's tokenizer, saved with its checkpoints; "
                            f"{run / 'checkpoints'} has none (use --ids)")
    try:
        tokenizer = load_tokenizer(saved[0])
    except (OSError, ValueError, ImportError) as err:
        raise EpisodesError(f"--tokens: the tokenizer in {saved[0]} does not load ({err})") from None

    def decode(ids) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    def decodes_back(seg: dict) -> bool:
        try:
            return decode(seg["ids"]) == seg["text"]
        except Exception:  # ids outside its vocabulary: another tokenizer
            return False

    for row in rows:
        for k, seg in enumerate(row.get("segments") or []):
            if not decodes_back(seg):
                raise EpisodesError(f"--tokens: the tokenizer in {saved[0]} decodes segment {k} of step "
                                    f"{row['step']}, sample {row.get('sample')} to other text than the run recorded: "
                                    "not the tokenizer that run used (use --ids)")
    return lambda token: decode([token])


__all__ = ["EpisodesError", "add_parser", "choose", "cmd_episodes", "format_row", "read_rows", "token_decoder"]
