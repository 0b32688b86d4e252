"""Multi-turn episodes on the built-in tiny model (tiny Qwen2), made in code: a
character-level BPE tokenizer (printable ASCII, a few merges, so text does not always
tokenise back to the ids that produced it) with SmolLM2's chat template (plain ChatML, no
tools: portarl renders them, Hermes style) or one that declares tools, and a scripted
engine (a fixed policy whose log-probs are the model's own) for the loop and the masks.
The tools and environments are in agent_tools.py."""

from __future__ import annotations

import json
import string

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
#: Every pair of the digits 1-4 merges (a model that writes "1" then "2" produced two tokens,
#: which the text "12" tokenises to one), and a few letter pairs.
MERGES = [(a, b) for a in "1234" for b in "1234"] + [("a", "n"), ("t", "o"), ("e", "r"), (" ", "t"), ("o", "l")]


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


def tiny_model(vocab_size: int, seed: int = 0, **sizes):
    from portarl.assets.models import tiny_qwen2

    sizes = {"hidden_size": 32, "intermediate_size": 64, **sizes}
    return tiny_qwen2(vocab_size, max_positions=4096, seed=seed, **sizes)


def talkative_model(tok, seed: int = 0, **sizes):
    """The tiny model with the output rows of ``<|im_end|>`` and the digits 1-4 set along
    its mean final hidden state: a random model rarely ends a turn (one token in ~120),
    this one does within a few tokens, and writes digit pairs that tokenise differently
    as text (MERGES)."""
    model = tiny_model(len(tok), seed, **sizes)
    with torch.no_grad():
        ids = torch.randint(4, len(tok), (16, 40), generator=torch.Generator().manual_seed(seed))
        hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size)
        u = hidden.mean(0) / hidden.mean(0).norm()
        for token, scale in (("<|im_end|>", 2.0), ("1", 1.6), ("2", 1.6), ("3", 1.6), ("4", 1.6)):
            model.lm_head.weight[tok.convert_tokens_to_ids(token)] = scale * u  # tied: the embedding row too
    return model


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
        from portarl.trainer.phases.sequences import build_batch, completion_logprobs

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


def save_agent_run_files(directory, **sizes):
    """``(model directory, data file)`` under ``directory``: the talkative model and its
    tokenizer saved as a Hugging Face directory, and 8 conversational prompts (what a run
    that loads its model from config.model.path needs: the async worker, torchrun, vLLM)."""
    from pathlib import Path

    directory = Path(directory)
    tok = agent_tokenizer()
    talkative_model(tok, **sizes).save_pretrained(directory / "model")
    tok.save_pretrained(directory / "model")
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Count {i}"}]}) + "\n"
                            for i in range(8)))
    return directory / "model", data
