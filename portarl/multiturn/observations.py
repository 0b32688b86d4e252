"""Bounded observations: each tool result and environment observation (the reset text
included) keeps at most ``rollout.max_tool_tokens`` tokens of its text, the rest replaced by
a visible marker line (``[... 9999488 characters truncated ...]``) that the model reads,
and the episode counts it (``agent/truncated_observations``).

Why: a tool that returns 10 MB of text would otherwise become a 2.5 M-token episode on a
2048-token model, which the update cannot hold. verl caps tool responses the same way
(``multi_turn.max_tool_response_length``, 256 *characters* by default, cut in the middle
with ``...(truncated)...``); Search-R1 caps observations at 500 tokens (``max_obs_length``).

Where (``rollout.tool_truncate_side``): ``middle`` keeps the start and the end (verl's
default: a traceback's last line and a listing's first lines both survive), ``end`` keeps
the start, ``start`` keeps the end. (verl names the side it keeps: its ``left`` is our
``end``, its ``right`` our ``start``.)

Tokenising 10 MB is itself slow (seconds, and gigabytes of offsets), so the cut looks at
windows of the text first: the first and last ``WINDOW_CHARS_PER_TOKEN * max_tool_tokens``
characters, tokenised alone, widened 4x while they hold too few tokens; only a text short
enough is tokenised whole. The kept text is cut from the original at its tokens' character
offsets (fast tokenizers), else decoded from its tokens. It is then rendered through the chat
template like any message, so its own tokens in the trajectory may differ from the
window's by a token or two at the cut.
"""

from __future__ import annotations

import dataclasses

SIDES = ("middle", "end", "start")
MARKER = "\n[... {removed} characters truncated ...]\n"
#: Initial window, in characters per kept token: English text averages about 4, code and
#: JSON fewer; a text whose tokens are longer gets a wider window (the loop in ``cut``).
WINDOW_CHARS_PER_TOKEN = 8


class _Tokens:
    """``text`` tokenised without special tokens; its first / last ``n`` tokens as text."""

    def __init__(self, codec, text: str):
        self.codec, self.text = codec, text
        tokenizer = codec.tokenizer
        if getattr(tokenizer, "is_fast", False):
            self.spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
            self.ids = None
        else:  # no offsets (slow or built-in tokenizers): the kept tokens decoded
            self.spans, self.ids = None, codec.encode_continuation(text)

    def __len__(self) -> int:
        return len(self.spans if self.spans is not None else self.ids)

    def first(self, n: int) -> str:
        if n == 0:
            return ""
        if self.spans is not None:
            return self.text[: max(end for _, end in self.spans[:n])]
        return self._decode(self.ids[:n]).rstrip("\ufffd")  # a byte-level token cut inside a character

    def last(self, n: int) -> str:
        if n == 0:
            return ""
        if self.spans is not None:
            return self.text[min(start for start, _ in self.spans[-n:]):]
        return self._decode(self.ids[-n:]).lstrip("\ufffd")

    def _decode(self, ids) -> str:
        return self.codec.tokenizer.decode(list(ids), skip_special_tokens=False)


@dataclasses.dataclass
class ObservationCap:
    """``rollout.max_tool_tokens`` and ``rollout.tool_truncate_side`` for ``codec``'s tokenizer."""

    codec: object
    max_tokens: int
    side: str = "middle"

    def _kept(self, limit: int) -> tuple[int, int]:
        """Tokens kept from the start and from the end."""
        if self.side == "end":
            return limit, 0
        if self.side == "start":
            return 0, limit
        return limit - limit // 2, limit // 2

    def cut(self, text: str, at_most: int | None = None) -> tuple[str, bool]:
        """``(text as the model sees it, whether it was cut)``; ``at_most``: a tighter limit
        than ``max_tokens`` for this text (the room left in its episode)."""
        limit = self.max_tokens if at_most is None else min(self.max_tokens, at_most)
        head_n, tail_n = self._kept(limit)
        window = WINDOW_CHARS_PER_TOKEN * limit + 64
        while 2 * window < len(text):
            # Disjoint windows, each with more tokens than it keeps: the text has more than
            # the limit, and the kept ones are known without tokenising the rest.
            head = _Tokens(self.codec, text[:window]) if head_n else None
            tail = _Tokens(self.codec, text[-window:]) if tail_n else None
            if (head is None or len(head) > head_n) and (tail is None or len(tail) > tail_n):
                return _joined(text, head.first(head_n) if head else "", tail.last(tail_n) if tail else ""), True
            window *= 4
        whole = _Tokens(self.codec, text)
        if len(whole) <= limit:
            return text, False
        return _joined(text, whole.first(head_n), whole.last(tail_n)), True


def _joined(text: str, head: str, tail: str) -> str:
    return head + MARKER.format(removed=max(0, len(text) - len(head) - len(tail))) + tail


__all__ = ["MARKER", "ObservationCap", "SIDES", "WINDOW_CHARS_PER_TOKEN"]
