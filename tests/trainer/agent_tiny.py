"""Tools and environments on the built-in tiny model (tiny Qwen2), made in code: a
character-level BPE tokenizer (printable ASCII, a few merges, so text does not always
tokenise back to the ids that produced it) with SmolLM2's chat template (plain ChatML, no
tools: portarl renders them, Hermes style) or one that declares tools; tools and
environments for the tests; and a scripted engine (a fixed policy whose log-probs are the
model's own) for the loop and the masks."""

from __future__ import annotations

import json
import string
import time

import torch

from portarl.rollout.base import RolloutBatch, RolloutEngine

#: SmolLM2-135M-Instruct's chat template, verbatim (the GGUF file's).
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
           "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")

#: A ChatML template that declares tools (Qwen2.5-like, short).
WITH_TOOLS = ("{% if tools %}{{ '<|im_start|>system\nTools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}"
              "{{ '<|im_end|>\n' }}{% endif %}{% for m in messages %}{% if m.role != 'system' %}{{ '<|im_start|>' + m.role"
              " + '\n' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIAL = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
MERGES = [("1", "2"), ("3", "4"), ("5", "6"), ("a", "n"), ("t", "o"), ("e", "r"), (" ", "t"), ("o", "l")]


def agent_tokenizer(template: str = SMOLLM2):
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS + [a + b for a, b in MERGES])}
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = template
    return fast


def tiny_model(vocab_size: int, seed: int = 0):
    from portarl.models import tiny_qwen2

    return tiny_qwen2(vocab_size, hidden_size=32, intermediate_size=64, max_positions=4096, seed=seed)


# ---------------------------------------------------------------- tools and environments
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b  # b = 0 raises ZeroDivisionError: the model must get it as a message


def wait(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)  # past rollout.tool_timeout_s: a hung tool
    return "woke"


def reward_env_text(prompts, completions, conversation, **columns):
    """A batched reward that reads the conversation column (multi-turn episodes add it)."""
    return [float(sum(m["role"] == "assistant" for m in conv)) for conv in conversation]


class CountEnv:
    """Answers every reply with "again" until the third, then is done; reward: replies seen."""

    def reset(self, row):
        self.replies = 0
        return None

    def step(self, message):
        self.replies += 1
        if self.replies >= 3:
            return {"observation": None, "done": True, "reward": float(self.replies)}
        return "again"


class BrokenEnv(CountEnv):
    def step(self, message):
        raise RuntimeError("the environment broke")


# ---------------------------------------------------------------------- scripted policy
class ScriptedRollout(RolloutEngine):
    """Replies ``script[k]`` (text) at the k-th model turn of a context, ending with
    ``<|im_end|>``; log-probs are ``model``'s for those tokens (teacher forcing at the
    sampling temperature), as a real engine's would be."""

    name = "scripted"

    def __init__(self, model, tokenizer, script: list[str], temperature: float = 1.0):
        self.model, self.tok, self.script, self.temperature = model, tokenizer, script, temperature
        self.start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.assistant = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.calls = []

    def _turn(self, context) -> int:
        n = len(self.assistant)
        return sum(context[i:i + n] == self.assistant for i in range(len(context) - n + 1)) - 1

    def generate(self, prompts, seeds, params):
        from portarl.trainer.sequences import build_batch, completion_logprobs

        self.calls.append([list(p) for p in prompts])
        completions = []
        for p in prompts:
            text = self.script[min(self._turn(list(p)), len(self.script) - 1)]
            completions.append(self.tok(text, add_special_tokens=False)["input_ids"] + [self.end])
        batch = build_batch(prompts, completions, 0, "cpu")
        with torch.no_grad():
            logp = completion_logprobs(self.model, batch, temperature=self.temperature)
        logprobs = [logp[i, : len(c)].tolist() for i, c in enumerate(completions)]
        return RolloutBatch([list(p) for p in prompts], completions, logprobs, [True] * len(prompts))

    def samples_policy_of(self, model):
        return model is self.model


def call_text(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
