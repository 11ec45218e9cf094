"""The decoder shape read from a Hugging Face config: the one description both model families share."""

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("qwen2", "llama", "mistral")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(repr=False, compare=False, default=None)

    @property
    def max_model_len(self) -> int:
        """Longest context served exactly: a sliding-window model is served only within its window."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, hf_config) -> "DecoderConfig":
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture '{model_type}': specsplit serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        sliding = None
        if model_type == "mistral" or getattr(hf_config, "use_sliding_window", False):
            sliding = getattr(hf_config, "sliding_window", None)
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in `attention_bias`.
            qkv_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            hf_config=hf_config,
        )
