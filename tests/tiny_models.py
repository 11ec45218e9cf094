"""Tiny random-weight models built from real `transformers` configs, saved as Hugging Face folders.

A byte-level tokenizer (256 byte tokens + an end-of-text token) makes them usable with text prompts. Weights are
drawn with a larger spread than training init so next-token distributions are peaked like a trained model's,
which keeps greedy decoding away from near-ties.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast
from transformers import Qwen2Config, Qwen2ForCausalLM

BYTE_VOCAB = 257
EOS_ID = 256


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    assert len(vocab) == 256
    vocab["<|endoftext|>"] = EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def tiny_config(arch: str = "qwen2", vocab_size: int = BYTE_VOCAB, **overrides):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=EOS_ID if vocab_size > EOS_ID else vocab_size - 1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "qwen2":
        return Qwen2Config(**common), Qwen2ForCausalLM
    if arch == "llama":
        return LlamaConfig(**common), LlamaForCausalLM
    if arch == "mistral":
        return MistralConfig(**common), MistralForCausalLM
    raise ValueError(arch)


def build_model(arch="qwen2", seed=0, scale=0.15, vocab_size=BYTE_VOCAB, **overrides):
    config, cls = tiny_config(arch, vocab_size, **overrides)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, scale)
            elif p.abs().sum() == 0:  # biases start at zero; give them values too (norm weights stay 1)
                p.normal_(0.0, scale * 0.1)
    return model


def perturbed_copy(model, noise: float, seed: int = 1):
    """A draft that mostly agrees with `model`: the same weights plus Gaussian noise."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn_like(p) * noise)
    return draft


def save_model(model, path: Path, with_tokenizer: bool = True) -> Path:
    path = Path(path)
    model.save_pretrained(path)
    if with_tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path
