"""BENCHMARKS ONLY: random weights for a model folder that holds a config and the random-weights marker
(loader.RANDOM_WEIGHTS_MARKER) instead of weights."""

import zlib

import torch

from specsplit.services.models.config import DecoderConfig


class RandomCheckpoint:
    """BENCHMARKS ONLY: a checkpoint of random weights under the Hugging Face names, each tensor drawn whole from a
    generator seeded by its name (norms 1, every other tensor normal(0, std)), so a whole model (degree 1) and every
    degree's shards are one model: a degree-2 replica computes what a degree-4 one and the unsharded model do. Read
    like the checkpoints it stands for: whole tensors as LazySafetensors gives them (pop, items), slices as
    safe_open's handles do (get_slice); each tensor is drawn when read and dropped after."""

    def __init__(self, full: DecoderConfig, settings: dict, dtype: torch.dtype, device):
        self.settings, self.dtype, self.device = settings, dtype, device
        hidden, q, kv = full.hidden_size, full.num_heads * full.head_dim, full.num_kv_heads * full.head_dim
        shapes = {"model.norm.weight": (hidden,), "model.embed_tokens.weight": (full.vocab_size, hidden)}
        if not full.tie_word_embeddings:
            shapes["lm_head.weight"] = (full.vocab_size, hidden)
        for i in range(full.num_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            shapes.update({f"{attn}q_proj.weight": (q, hidden), f"{attn}k_proj.weight": (kv, hidden),
                           f"{attn}v_proj.weight": (kv, hidden), f"{attn}o_proj.weight": (hidden, q),
                           f"{mlp}gate_proj.weight": (full.intermediate_size, hidden),
                           f"{mlp}up_proj.weight": (full.intermediate_size, hidden),
                           f"{mlp}down_proj.weight": (hidden, full.intermediate_size),
                           f"model.layers.{i}.input_layernorm.weight": (hidden,),
                           f"model.layers.{i}.post_attention_layernorm.weight": (hidden,)})
            if full.qkv_bias:
                shapes.update({f"{attn}q_proj.bias": (q,), f"{attn}k_proj.bias": (kv,), f"{attn}v_proj.bias": (kv,)})
            if full.o_bias:
                shapes[f"{attn}o_proj.bias"] = (hidden,)
            if full.mlp_bias:
                shapes.update({f"{mlp}gate_proj.bias": (full.intermediate_size,),
                               f"{mlp}up_proj.bias": (full.intermediate_size,), f"{mlp}down_proj.bias": (hidden,)})
        self.shapes = shapes
        self._unread = dict.fromkeys(shapes, True)  # what pop() and items() have not handed out yet

    def pop(self, name: str, default=None):
        return self.draw(name) if self._unread.pop(name, None) else default

    def items(self):
        for name in list(self._unread):
            yield name, self.pop(name)

    def get_slice(self, name: str) -> "_Drawn":
        return _Drawn(self, name)

    def draw(self, name: str) -> torch.Tensor:
        tensor = torch.empty(self.shapes[name], dtype=self.dtype, device=self.device)
        if "norm" in name:
            return tensor.fill_(1.0)
        seed = self.settings.get("seed", 0) * (1 << 32) + zlib.crc32(name.encode())
        generator = torch.Generator(device=tensor.device).manual_seed(seed)
        return tensor.normal_(0.0, self.settings.get("std", 0.02), generator=generator)


class _Drawn:
    def __init__(self, checkpoint: RandomCheckpoint, name: str):
        self.checkpoint, self.name = checkpoint, name

    def __getitem__(self, index) -> torch.Tensor:
        return self.checkpoint.draw(self.name)[index]
