"""What the trainer scored beside what ``samples.jsonl`` says it scored: the token batches
the scoring phase built (captured as they are built), and the check that a logged row's
``segments`` are exactly its batch row, ids and loss mask, token for token."""

from __future__ import annotations


def capture_scored_batches(monkeypatch) -> list:
    """Every batch :func:`portarl.trainer.phases.scoring.score` builds from now on, in order
    (before dropped groups are masked out: the per-token loss mask)."""
    import portarl.trainer.phases.scoring as scoring

    batches, real = [], scoring.build_batch

    def build(*args, **kwargs):
        batches.append(real(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(scoring, "build_batch", build)
    return batches


def segment_mismatch(row: dict, batch, decode) -> str | None:
    """Why ``row["segments"]`` are not row ``row["sample"]`` of ``batch`` (None: they are):
    the ids joined must be the row's prompt and completion ids, the loss masks the batch's
    mask, ``model`` exactly the runs in the loss, each text its ids decoded, and ``prompt``
    the prompt run's text."""
    i, segments = row["sample"], row["segments"]
    roles = [s["role"] for s in segments]
    if roles[0] != "prompt" or "prompt" in roles[1:]:
        return f"roles {roles}: the prompt must come first, once"
    scored = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
    ids = [t for s in segments for t in s["ids"]]
    if ids != scored:
        return f"the segments hold {len(ids)} ids, the batch row {len(scored)}, or other ones"
    loss = []
    for s in segments[1:]:
        mask = s["loss_mask"]
        loss += mask if isinstance(mask, list) else [mask] * len(s["ids"])
        if (s["role"] == "model") != (mask == 1):
            return f"a {s['role']} run has loss mask {mask}"
    if segments[0]["loss_mask"] != 0:
        return "the prompt is in the loss"
    scored_loss = [int(m) for m in batch.mask[i].tolist()]
    if loss != scored_loss[: len(loss)] or any(scored_loss[len(loss):]):
        return f"loss mask {loss} but the batch's is {scored_loss}"
    for s in segments:
        if s["text"] != decode(s["ids"]):
            return f"a {s['role']} run's text is not its ids decoded"
    if row["prompt"] != segments[0]["text"]:
        return "prompt is not the prompt as the model saw it"
    return None
