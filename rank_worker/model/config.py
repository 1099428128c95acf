"""The architecture facts the model code needs, read from a Hugging Face style config.json dict: the Llama
family here, the DeepSeek family in deepseek_config.py; registry.py tells which one a config.json is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rank_worker.model.feature_check import check_supported, rope_layer_flags

# Types whose `attention_bias` puts a bias on o_proj as well as q/k/v (Qwen2's o_proj never has one; Mistral
# has no attention biases at all, whatever its config says).
_OUTPUT_BIAS_TYPES = ("llama", "qwen3", "smollm2", "smollm3")


@dataclass(frozen=True)
class LlamaFamilyConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; others with attention_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before rotary (Qwen3)
    # Per layer, whether it applies rotary embedding (SmolLM3's NoPE layers do not); () means every layer does.
    rope_layers: tuple[bool, ...] = ()
    output_bias: bool = False  # o_proj carries a bias (attention_bias in Llama, Qwen3, SmolLM3)
    n_routed_experts: ClassVar[int] = 0  # a dense MLP: nothing for expert parallelism to split

    def uses_rope(self, layer_index: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer_index]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params_excluding_embeddings(self) -> int:
        """Parameters that take part in every token's matmuls (for MFU: 2 FLOP per parameter per token)."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @classmethod
    def for_serving(cls, hf: dict[str, Any], max_positions: int) -> LlamaFamilyConfig:
        """from_hf, then UnsupportedModelError naming every feature our code would get wrong serving up to
        max_positions tokens (feature_check.py)."""
        cfg = cls.from_hf(hf)
        check_supported(hf, max_positions)
        return cfg

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaFamilyConfig:
        model_type = str(hf.get("model_type", "llama"))
        rope = hf.get("rope_parameters") or {}
        rope_theta = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        attention_bias = model_type != "mistral" and bool(hf.get("attention_bias", model_type == "qwen2"))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            rope_layers=tuple(rope_layer_flags(hf)),
            # GGUF files say it per tensor (attention_output_bias); HF configs through attention_bias.
            output_bias=bool(hf.get("attention_output_bias", attention_bias and model_type in _OUTPUT_BIAS_TYPES)),
        )
