"""Tool calls in a model's reply, in the format its chat template declares.

Formats (``rollout.tool_format``; ``auto`` picks from the chat template's source):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more
  (Qwen2 / Qwen2.5 / Qwen3, Hermes, SmolLM3 templates; transformers' fallback response
  template for the Qwen2 / Qwen3 families). Also what portarl renders itself for a
  template that declares no tools (SmolLM2's plain ChatML): :mod:`.render`.
- ``qwen_xml``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``
  (Qwen3.5 / Qwen3-Coder; transformers' ``qwen3_5`` response template). A value that is
  valid JSON is decoded, else kept as text.
- ``llama3_json``: the whole reply is ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>`` (Llama 3.1 / 3.2 templates).
- ``template``: the tokenizer's own ``response_template`` through transformers'
  ``parse_response`` (transformers >= 5.13), for any other format a tokenizer declares.

A reply that tries to call a tool and fails (an unclosed tag, JSON that does not parse, no
tool name, arguments that are not an object) gives a *malformed* entry with the reason:
the episode answers it with an error message and counts it (``agent/malformed_calls``).
"""

from __future__ import annotations

import dataclasses
import json
import re

FORMATS = ("auto", "hermes", "qwen_xml", "llama3_json", "template")


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclasses.dataclass
class ParsedReply:
    content: str                       # the reply without its tool calls
    calls: list[ToolCall]
    malformed: list[str]               # one reason per call that could not be read

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


def _call_from_object(obj, keys=("arguments", "parameters")) -> ToolCall | str:
    """A ToolCall from ``{"name": ..., "arguments": {...}}``, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "the tool call has no \"name\""
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _collect(items, calls, malformed):
    for item in items:
        got = _call_from_object(item)
        (calls if isinstance(got, ToolCall) else malformed).append(got)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> ParsedReply:
    calls, malformed = [], []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except ValueError as err:
            malformed.append(f"the text inside <tool_call> is not valid JSON ({err.msg} at char {err.pos})")
            continue
        _collect(obj if isinstance(obj, list) else [obj], calls, malformed)
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        malformed.append("<tool_call> is not closed by </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    elif "</tool_call>" in rest:
        malformed.append("</tool_call> without an opening <tool_call>")
    return ParsedReply(rest.strip(), calls, malformed)


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\s*(.*?)\s*</parameter>", re.S)


def _xml_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_qwen_xml(text: str) -> ParsedReply:
    calls = [ToolCall(name.strip(), {k.strip(): _xml_value(v) for k, v in _XML_PARAM.findall(body)})
             for name, body in _XML_CALL.findall(text)]
    rest = _XML_CALL.sub("", text)
    malformed = ["a <tool_call> is not of the form <tool_call><function=NAME>...</function></tool_call>"] \
        if "<tool_call>" in rest or "<function=" in rest else []
    return ParsedReply(rest.split("<tool_call>")[0].strip(), calls, malformed)


def parse_llama3_json(text: str) -> ParsedReply:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not (tagged or body.startswith('{"name"')):
        return ParsedReply(text.strip(), [], [])
    try:
        obj = json.loads(body)
    except ValueError as err:
        return ParsedReply("", [], [f"the tool call is not valid JSON ({err.msg} at char {err.pos})"])
    calls, malformed = [], []
    _collect(obj if isinstance(obj, list) else [obj], calls, malformed)
    return ParsedReply("", calls, malformed)


def template_parser(tokenizer):
    """``parse(text) -> ParsedReply`` with the tokenizer's own ``response_template``."""
    if getattr(tokenizer, "response_template", None) is None:
        raise ValueError("rollout.tool_format=template: the tokenizer has no response_template")

    def parse(text: str) -> ParsedReply:
        try:
            message = tokenizer.parse_response(text, prefix="")
        except Exception as err:  # noqa: BLE001 - a reply the parser cannot read is a malformed call
            return ParsedReply(text.strip(), [], [f"the reply does not parse ({type(err).__name__}: {err})"])
        calls, malformed = [], []
        _collect([c.get("function", c) if isinstance(c, dict) else c for c in message.get("tool_calls") or []],
                 calls, malformed)
        return ParsedReply(str(message.get("content") or "").strip(), calls, malformed)

    return parse


PARSERS = {"hermes": parse_hermes, "qwen_xml": parse_qwen_xml, "llama3_json": parse_llama3_json}


def detect_format(template: str | None, declares_tools: bool) -> str:
    """The tool-call format a chat template's source declares; ``hermes`` when it declares
    no tools (portarl then renders the tools itself, in that format)."""
    if not declares_tools:
        return "hermes"
    if "<function=" in template:
        return "qwen_xml"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    raise ValueError("the chat template declares tools in a format portarl does not know: set rollout.tool_format "
                     f"to one of {', '.join(f for f in FORMATS if f != 'auto')} (template: the tokenizer's own "
                     "response_template)")


def make_parser(fmt: str, tokenizer=None):
    if fmt == "template":
        return template_parser(tokenizer)
    if fmt not in PARSERS:
        raise ValueError(f"rollout.tool_format={fmt!r} must be one of {', '.join(FORMATS)}")
    return PARSERS[fmt]


__all__ = ["FORMATS", "ParsedReply", "ToolCall", "detect_format", "make_parser", "parse_hermes", "parse_llama3_json",
           "parse_qwen_xml"]
