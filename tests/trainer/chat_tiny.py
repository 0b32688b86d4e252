"""A tiny Hugging Face tokenizer with a ChatML chat template (``<|im_end|>`` ends a turn,
eos is a different token), built in code: what real instruct models look like, nothing
downloaded. Plus a tiny Llama model sized for it."""

from __future__ import annotations

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WORDS = ("system user assistant You are helpful . What is 1 2 3 4 5 6 7 8 9 0 + = ? plus the answer sum of "
         "Answer with a number only").split()


def chat_tokenizer(template: str = CHATML):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<eos>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(special + ["\n"] + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.WhitespaceSplit()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = template
    return fast


def tiny_llama(vocab_size: int, seed: int = 0, max_positions: int = 256):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def save_chat_model(directory, seed: int = 0):
    tok = chat_tokenizer()
    model = tiny_llama(len(tok), seed)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model, tok
