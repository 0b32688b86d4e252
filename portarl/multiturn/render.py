"""What is appended to a conversation after a model turn, as token ids, through the chat
template: tool results and environment observations.

Token truth: the model's own turn is never rendered again. The ids appended after it are
the template's text *after* an assistant message's content, up to and including the next
generation prompt: rendering ``[user, assistant(MARKER), *new_messages]`` with
``add_generation_prompt=True`` and taking everything after ``MARKER`` gives, for ChatML,
``<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``. When the model
ended its turn with the template's end-of-turn token, that leading token is already in the
trajectory (the model produced it) and is dropped from the appended ids
(:meth:`Renderer.continuation_ids`). The model's tokens stay exactly the ids the engine
sampled, whatever the tokenizer would make of their text.

Tools in the prompt: a template that declares ``tools`` gets the schemas through
``apply_chat_template(tools=...)`` and renders tool results as ``tool`` messages; one that
does not (SmolLM2's plain ChatML) gets them from portarl, Hermes style: a system message
listing the schemas in ``<tools></tools>`` and asking for ``<tool_call>`` JSON, and the
results come back as a user message of ``<tool_response>`` blocks (Qwen2.5's own
rendering of tool results), so the format is learnable from the prompt alone.
"""

from __future__ import annotations

import json
import re

from portarl.assets.tokenizer import no_template_fix

MARKER = "PORTARL_ASSISTANT_CONTENT_MARKER"

_TOOLS_VAR = re.compile(r"\btools\b")


def declares_tools(template: str | None) -> bool:
    """Whether a chat template's source uses the ``tools`` variable."""
    return bool(template) and bool(_TOOLS_VAR.search(template))


def tool_system_text(schemas: list[dict]) -> str:
    """The Hermes / Qwen2.5 tool instructions with the tools' JSON schemas."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_result_messages(results: list[tuple[str, str]], template_tools: bool) -> list[dict]:
    """``(tool name, content)`` pairs as the messages that carry them back to the model."""
    if template_tools:
        return [{"role": "tool", "name": name, "content": content} for name, content in results]
    body = "\n".join(f"<tool_response>\n{content}\n</tool_response>" for _, content in results)
    return [{"role": "user", "content": body}]


class Renderer:
    """Token ids of messages appended after a model turn (see the module docstring)."""

    def __init__(self, codec):
        if codec.template is None:
            raise ValueError("tools and environments need a chat template to render tool results and observations; "
                             f"the tokenizer has none: {no_template_fix(codec.tokenizer)}")
        self.codec = codec
        self.end_of_turn_id = codec.end_of_turn_id
        self.continuation_text([{"role": "user", "content": "probe"}])  # a template that cannot: refused now

    def continuation_text(self, messages: list[dict]) -> str:
        base = self.codec.messages([{"role": "user", "content": "question"}, {"role": "assistant", "content": MARKER}])
        text = self.codec.render_text(base + list(messages), add_generation_prompt=True)
        if text.count(MARKER) != 1:
            raise ValueError("the chat template does not render an assistant message's content verbatim, so portarl "
                             "cannot tell what follows a model turn; use another template (data.chat_template)")
        return text[text.index(MARKER) + len(MARKER):]

    def continuation_ids(self, messages: list[dict], last_model_token: int | None) -> list[int]:
        """Ids to append after a model turn ending in ``last_model_token``: the template's
        rest of that turn (unless the model wrote it), ``messages``, the next generation prompt."""
        ids = self.codec.encode_continuation(self.continuation_text(messages))
        if ids and last_model_token is not None and ids[0] == last_model_token == self.end_of_turn_id:
            ids = ids[1:]
        return ids


__all__ = ["MARKER", "Renderer", "declares_tools", "tool_result_messages", "tool_system_text"]
