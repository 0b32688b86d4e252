"""The parts of multi-turn episodes on their own (issue 37): tool schemas, tool-call parsing
in each format, what is appended after a model turn, the codec's tool prompt, the
environment step contract, and the time-limited call."""

from __future__ import annotations

import json
import sys
import time

import pytest

from agent_tiny import SMOLLM2, WITH_TOOLS, agent_tokenizer, call_text
from agent_tools import divide, multiply
from portarl.multiturn.agent import configure_codec
from portarl.multiturn.calls import call_with_limit
from portarl.multiturn.environment import normalize_step
from portarl.multiturn.parsing import ToolCall, detect_format, parse_hermes, parse_llama3_json, parse_qwen_xml
from portarl.multiturn.render import Renderer, declares_tools
from portarl.multiturn.tools import load_tools
from portarl.assets.tokenizer import as_codec


def test_tool_schema_comes_from_type_hints_and_docstring():
    tools = load_tools(["agent_tools:multiply", divide])
    assert list(tools) == ["multiply", "divide"]
    fn = tools["multiply"].schema["function"]
    assert fn["description"] == "Multiply two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    assert tools["multiply"].bind_error({"a": 1, "b": 2}) is None
    assert "missing a required argument: 'b'" in tools["multiply"].bind_error({"a": 1})
    assert "unexpected keyword argument 'c'" in tools["multiply"].bind_error({"a": 1, "b": 2, "c": 3})

    def undocumented(x: int):
        return x

    with pytest.raises(ValueError, match=r"tools\[0\]: cannot build the JSON schema of 'undocumented'.*docstring"):
        load_tools([undocumented])
    with pytest.raises(ValueError, match=r"tools\[0\]: 'agent_tools:nothing' cannot be loaded"):
        load_tools(["agent_tools:nothing"])
    with pytest.raises(ValueError, match="a second tool named 'multiply'"):
        load_tools([multiply, "agent_tools:multiply"])


def test_hermes_calls_and_malformed_ones():
    got = parse_hermes(f"Let me compute.\n{call_text('multiply', a=12, b=34)}\n{call_text('divide', a=1, b=2)}")
    assert got.content == "Let me compute." and not got.malformed
    assert got.calls == [ToolCall("multiply", {"a": 12, "b": 34}), ToolCall("divide", {"a": 1, "b": 2})]
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').calls == [
        ToolCall("f", {"x": 1})]  # arguments written as a JSON string
    assert parse_hermes('<tool_call>[{"name": "f"}, {"name": "g", "parameters": {"y": 2}}]</tool_call>').calls == [
        ToolCall("f", {}), ToolCall("g", {"y": 2})]
    assert not parse_hermes("The answer is 408.").wants_tools
    for text, reason in [('<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
                         ('<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
                         ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
                         ('<tool_call>"f"</tool_call>', "must be a JSON object, got str"),
                         ('<tool_call>{"name": "f"', "not closed"),
                         ('{"name": "f"}</tool_call>', "without an opening")]:
        got = parse_hermes(text)
        assert got.wants_tools and not got.calls and reason in got.malformed[0], (text, got)


def test_qwen_xml_and_llama3_json_calls():
    text = "<tool_call>\n<function=multiply>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\nabc\n</parameter>\n" \
           "</function>\n</tool_call>"
    assert parse_qwen_xml(text).calls == [ToolCall("multiply", {"a": 12, "b": "abc"})]
    assert parse_qwen_xml("<tool_call>\n<function=f>\n").malformed
    assert parse_llama3_json('{"name": "multiply", "parameters": {"a": 1, "b": 2}}').calls == [
        ToolCall("multiply", {"a": 1, "b": 2})]
    assert parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {').malformed
    assert not parse_llama3_json("It is 3.").wants_tools


def test_the_format_follows_the_template():
    assert not declares_tools(SMOLLM2) and declares_tools(WITH_TOOLS)
    assert detect_format(SMOLLM2, False) == "hermes"
    assert detect_format("{% if tools %}<tool_call>{% endif %}", True) == "hermes"
    assert detect_format("{% if tools %}<tool_call><function={% endif %}", True) == "qwen_xml"
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}", True) == "llama3_json"
    with pytest.raises(ValueError, match="set rollout.tool_format"):
        detect_format("{% if tools %}[TOOL_CALLS]{% endif %}", True)


def test_a_template_without_tools_gets_them_in_the_system_message():
    codec = as_codec(agent_tokenizer(SMOLLM2))
    assert configure_codec(codec, load_tools([multiply]), "auto") is False
    text = codec.tokenizer.decode(codec.encode_prompt([{"role": "user", "content": "What is 12*34?"}]))
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "multiply"' in text
    assert text.endswith("<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    # a system message of the data keeps its text; the tools follow it
    text = codec.tokenizer.decode(codec.encode_prompt([{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi"}]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    with pytest.raises(ValueError, match="declares no tools.*hermes"):
        configure_codec(as_codec(agent_tokenizer(SMOLLM2)), load_tools([multiply]), "qwen_xml")


def test_a_template_with_tools_renders_them_and_the_tool_messages():
    codec = as_codec(agent_tokenizer(WITH_TOOLS))
    assert configure_codec(codec, load_tools([multiply]), "auto") is True
    assert codec.tokenizer.decode(codec.encode_prompt("Hi")).startswith("<|im_start|>system\nTools: multiply<|im_end|>")
    renderer = Renderer(codec)
    assert renderer.continuation_text([{"role": "tool", "name": "multiply", "content": "408"}]) == \
        "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"


def test_appended_ids_follow_the_models_own_end_of_turn():
    tok = agent_tokenizer(SMOLLM2)
    renderer = Renderer(as_codec(tok))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    message = [{"role": "user", "content": "again"}]
    full = tok("<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert renderer.continuation_ids(message, last_model_token=end) == full["input_ids"][1:]  # the model wrote it
    eos = tok.convert_tokens_to_ids("<eos>")
    assert renderer.continuation_ids(message, last_model_token=eos) == full["input_ids"]  # it ended otherwise
    with pytest.raises(ValueError, match="need a chat template"):
        Renderer(as_codec(agent_tokenizer(SMOLLM2), chat_template="none"))


def test_environment_step_results():
    assert normalize_step("higher") == {"observation": "higher", "role": "user", "done": False, "reward": None}
    assert normalize_step(None)["done"] is True
    assert normalize_step(("right", True, 1)) == {"observation": "right", "role": "user", "done": True, "reward": 1.0}
    assert normalize_step({"observation": "42", "role": "tool"})["role"] == "tool"
    for bad, why in [(3, "step\\(\\) returned int"), ({"observation": 1}, "observation must be a string"),
                     ({"observation": "x", "done": "no"}, "done must be true or false"),
                     ({"done": False}, "done=False without an observation"),
                     ({"observation": "x", "reward": float("nan")}, "reward must be a finite number"),
                     ({"observation": "x", "role": "system"}, "role must be 'user' or 'tool'")]:
        with pytest.raises(ValueError, match=why):
            normalize_step(bad)


#: The limit of the calls that must return: a loaded machine may pause a process for
#: seconds, so no normal call is bounded by the short limits the hung calls are ended by.
GENEROUS_S = 120.0


def test_a_call_with_a_limit_never_raises_for_what_the_tool_does():
    from portarl.runtime.user_code import UserCodeGuard

    with UserCodeGuard(0.2, "rollout.tool_timeout_s") as short:  # the hung call's limit, and only its
        hung = call_with_limit(short, time.sleep, (60,))  # ended from inside, not abandoned
        assert not hung.ok and hung.kind == "timeout" and "within rollout.tool_timeout_s=0.2 s" in hung.error
        assert hung.elapsed_s < 60
    with UserCodeGuard(GENEROUS_S, "rollout.tool_timeout_s") as guard:
        assert call_with_limit(guard, multiply, (3, 4)).value == 12
        raised = call_with_limit(guard, divide, (1, 0))
        assert not raised.ok and raised.kind == "raised" and raised.error == "raised ZeroDivisionError: division by zero"
        exited = call_with_limit(guard, sys.exit, (3,))
        assert not exited.ok and exited.error == "called sys.exit(3)"
        not_json = call_with_limit(guard, lambda: {1, 2})
        assert not not_json.ok and not_json.kind == "not_json" and "returned set" in not_json.error
        assert json.loads(json.dumps(call_with_limit(guard, lambda: {"a": [1, 2.5, None]}).value)) == {
            "a": [1, 2.5, None]}


def test_the_tool_process_kills_a_hung_call_and_its_environments_are_lost():
    from pathlib import Path

    from portarl.multiturn.sandbox import ProcessExecutor

    here = Path(__file__).parent
    executor = ProcessExecutor(["agent_tools:wait", "agent_tools:pid"], "agent_tools:CountEnv", [here],
                               timeout_s=GENEROUS_S)  # every call that must return: no deadline a loaded machine breaks
    try:
        assert executor.run("env_reset", "a", None, {}).ok and executor.run("env_reset", "b", None, {}).ok
        assert executor.run("env_step", "a", "hi").value["observation"] == "again"
        first = executor.run("tool", "pid", {}).value
        executor.timeout_s = 0.5  # the hung call's limit only: it sleeps 30 s, any machine ends it at 0.5 s
        hung = executor.run("tool", "wait", {"seconds": 30})
        executor.timeout_s = GENEROUS_S
        assert hung.kind == "timeout" and "its process was killed" in hung.error and executor.restarts == 1
        lost = executor.run("env_step", "b", "hi")  # held by the killed process
        assert not lost.ok and lost.kind == "lost"
        assert executor.run("tool", "pid", {}).value != first  # a fresh process
        assert executor.run("env_reset", "c", None, {}).ok and executor.run("env_step", "c", "x").ok
    finally:
        executor.close()
    assert executor.proc is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_tool_process_ends_everything_its_tools_started_after_a_timeout_a_crash_and_at_close(tmp_path):
    """rollout.tool_isolation=process: the processes a tool started (a child, one in a
    session of its own, one a shell left behind) end with the tool process: when a later
    call's timeout kills it, when a tool crashes it, and when the executor closes. Before,
    only the tool process itself was killed, and the sleepers ran on past the run."""
    from pathlib import Path

    from portarl.multiturn.sandbox import ProcessExecutor
    from proc_tree import left_running, sleepers

    spawned = tmp_path / "spawned"
    executor = ProcessExecutor(["agent_tools:spawn", "agent_tools:wait", "agent_tools:crash"], None,
                               [Path(__file__).parent], timeout_s=60)
    try:
        first = executor.run("tool", "spawn", {"path": str(spawned)}).value
        assert len(first) == 3 and left_running(first) == first  # the check can fail
        executor.timeout_s = 0.5
        hung = executor.run("tool", "wait", {"seconds": 3600})
        assert hung.kind == "timeout" and executor.restarts == 1
        assert left_running(first) == [], "what the tool started outlived its killed process"
        executor.timeout_s = 60
        second = executor.run("tool", "spawn", {"path": str(spawned)}).value
        assert left_running(second) == second
        crashed = executor.run("tool", "crash", {})
        assert crashed.kind == "lost" and executor.restarts == 2
        assert left_running(second) == [], "what the tool started outlived its crashed process"
        third = executor.run("tool", "spawn", {"path": str(spawned)}).value
        assert left_running(third) == third
    finally:
        executor.close()
    assert sleepers(spawned) == first + second + third and left_running(first + second + third) == []
