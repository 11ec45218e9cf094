"""Decoder-only transformer for the Qwen2 and Llama families (Qwen2.5, Llama 3, SmolLM2, Mistral) over paged KV.

Parameter names follow Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...) so weights load by
name; q/k/v and gate/up are fused once at load time into single matmuls. The forward works on a flat batch of
tokens from many sequences (no padding): the attention metadata says which tokens belong to which sequence and
where their KV lives.

A layer is four matmuls (`Linear`, through kernels/dispatch.py's `linear`: torch's matmul, the few-rows kernel of a
decode step, or the batch-invariant mode's GEMM) and four fused steps (kernels/dispatch.py: Triton on a GPU, the
torch references on the CPU): add + RMSNorm, rotary + KV write, paged attention, SiLU * up. The residual stream
travels beside the normed activations so each residual add happens inside the next norm; the arithmetic is
transformers' own, op for op. A small model's one-row decode step on a GPU takes the norm, rotary and the KV write
into the q/k/v matmul (`norm_qkv_rotary`), the norm and SiLU * up into gate/up's (`norm_linear`): five kernels a
layer instead of eleven.
"""

import torch
from torch import nn

from specsplit.kernels.dispatch import (add_rms_norm, linear, norm_linear, norm_qkv_rotary, paged_attention, rotary_kv,
                                       silu_mul)
from specsplit.services.models.config import DecoderConfig
from specsplit.services.models.rotary import RotaryEmbedding
from specsplit.services.runtime.attention_metadata import AttentionMetadata


class Linear(nn.Linear):
    """nn.Linear whose product goes through the kernels' one matmul entry point. The CPU weight layouts
    (models/weight_formats.py) replace it like any nn.Linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add of the previous sub-layer, fused in."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = config.head_dim**-0.5

    def query(self, norm: nn.Module, hidden, residual, positions, rotary: RotaryEmbedding, meta: AttentionMetadata,
              kv_cache):
        """(q rotated, the residual stream): the input norm (with the residual add), the q/k/v projection, rotary,
        and k, v written to the cache: one kernel where they fuse (`_plain`), each as its module otherwise."""
        key_cache, value_cache = kv_cache
        if _plain(norm, self.qkv_proj):
            return norm_qkv_rotary(hidden, residual, norm.weight, norm.eps, self.qkv_proj.weight, self.qkv_proj.bias,
                                   positions, rotary.cos_sin, key_cache, value_cache, meta.slot_mapping,
                                   self.num_heads, self.num_kv_heads, self.head_dim)
        normed, residual = norm(hidden, residual)
        q = rotary_kv(self.qkv_proj(normed), positions, rotary.cos_sin, key_cache, value_cache, meta.slot_mapping,
                      self.num_heads, self.num_kv_heads, self.head_dim)
        return q, residual

    def forward(self, q, meta: AttentionMetadata, kv_cache):
        """q: the rows' rotated queries, their k and v already in the cache (`query`)."""
        key_cache, value_cache = kv_cache
        out = paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.scale, meta.max_query_len, meta.max_seq_len,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def activated(self, norm: nn.Module, attended, residual):
        """(SiLU(gate) * up of the normed rows, the residual stream): the post-attention norm (with the residual
        add) and the gate/up projection, one kernel where they fuse (as Attention.query)."""
        if _plain(norm, self.gate_up_proj):
            return norm_linear(attended, residual, norm.weight, norm.eps, self.gate_up_proj.weight,
                               self.gate_up_proj.bias, silu_mul_after=True)
        normed, residual = norm(attended, residual)
        return silu_mul(self.gate_up_proj(normed)), residual

    def forward(self, activated):
        """activated: SiLU(gate) * up of the normed rows (`activated`)."""
        return self.down_proj(activated)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, positions, rotary, meta, kv_cache):
        """hidden: the previous layer's MLP output (the embeddings, with residual None, for the first layer).
        Returns this layer's MLP output and the residual stream before it is added."""
        q, residual = self.self_attn.query(self.input_layernorm, hidden, residual, positions, rotary, meta, kv_cache)
        attended = self.self_attn(q, meta, kv_cache)
        activated, residual = self.mlp.activated(self.post_attention_layernorm, attended, residual)
        return self.mlp(activated), residual


def _plain(norm: nn.Module, projection: nn.Module) -> bool:
    """Whether a norm and the projection after it are this module's own, which the kernels may fuse; a replaced one
    (a CPU weight layout, a tensor-parallel norm that all-reduces first) runs as its module."""
    return type(norm) is RMSNorm and type(projection) is Linear


class DecoderModel(nn.Module):
    """The Hugging Face `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalDecoder(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.rotary = RotaryEmbedding(config.hf_config, config.head_dim)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, self.rotary, meta, kv_cache)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only the rows that need a distribution are projected to the vocabulary (float32 logits)."""
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        loaded = set()
        for i in range(self.config.num_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            for kind in ("weight", "bias"):
                parts = [state.pop(f"{attn}{p}_proj.{kind}", None) for p in "qkv"]
                if all(p is not None for p in parts):
                    _copy(own, f"{attn}qkv_proj.{kind}", torch.cat(parts, 0), loaded)
                parts = [state.pop(f"{mlp}{p}_proj.{kind}", None) for p in ("gate", "up")]
                if all(p is not None for p in parts):
                    _copy(own, f"{mlp}gate_up_proj.{kind}", torch.cat(parts, 0), loaded)
        for name, tensor in state.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name in own:
                _copy(own, name, tensor, loaded)
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = set(own) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing parameters: {sorted(missing)[:8]}")


def _copy(own: dict, name: str, tensor: torch.Tensor, loaded: set) -> None:
    target = own[name]
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))
    loaded.add(name)
