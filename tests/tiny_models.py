"""Tiny random-weight Llama models and a character tokenizer, built from a config in the tests."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " .,:!?'-\n" + "é")
VOCAB = SPECIALS + CHARS  # 49 tokens
BOS, EOS = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_model(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides))
    with torch.no_grad():  # sharper than the default init, so greedy choices are not near ties
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def perturbed_copy(model: LlamaForCausalLM, seed: int, scale: float) -> LlamaForCausalLM:
    """A draft that agrees with the target often but not always."""
    copy = LlamaForCausalLM(model.config)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in copy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return copy.eval()


def save(model: LlamaForCausalLM, path: Path, with_tokenizer: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if with_tokenizer:
        make_tokenizer().save_pretrained(path)
    return path
