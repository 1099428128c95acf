"""Our model code (the Llama family, DeepSeek-V2/V3) against Hugging Face transformers on the same weights:
logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from deepseek_checkpoints import MLA_MOE_LAYERS, YARN
from engine_fixtures import embolden_weights, generate_one, greedy, make_engine, random_prompt, write_word_tokenizer

from rank_worker.engine.factory import build_model
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice
from rank_worker.model_files.opener import open_model_source

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
)
MLA_MOE = MLA_MOE_LAYERS  # with COMMON's two layers: layer 0 dense, layer 1 MoE

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(num_key_value_heads=2, rope_theta=10000.0)),
    "llama3-rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    # attention_bias in Llama biases o_proj as well as q/k/v.
    "llama-attention-bias": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_key_value_heads=2, attention_bias=True),
    ),
    "qwen3-qknorm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=1, sliding_window=None),
    ),
    # A window as wide as max_model_len (512 below) is full attention: accepted, and exact.
    "mistral-window-covers-context": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=1, sliding_window=512),
    ),
    # Layer 1 of 2 is a NoPE layer (no rotary embedding), as every 4th layer of SmolLM3-3B; tied embeddings.
    "smollm3-nope": (
        transformers.SmolLM3Config,
        transformers.SmolLM3ForCausalLM,
        dict(num_key_value_heads=2, no_rope_layer_interval=2, pad_token_id=None, bos_token_id=None, eos_token_id=None),
    ),
    # DeepSeek-V2 without q compression (as V2-Lite), group-limited routing, YaRN with the softmax-scale mscale.
    "deepseek-v2-yarn": (
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(
            MLA_MOE,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            topk_method="group_limited_greedy",
            rope_parameters=YARN,  # mscale = mscale_all_dim = 0.707
        ),
    ),
    # V2-Lite's routing: plain greedy top-k over softmax scores, no groups.
    "deepseek-v2-greedy": (
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(MLA_MOE, q_lora_rank=None, qk_rope_head_dim=8, topk_method="greedy", n_group=1, routed_scaling_factor=1.5),
    ),
    # DeepSeek-V3: q compression, sigmoid noaux_tc routing normalized then scaled, interleaved rope pairs.
    "deepseek-v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(MLA_MOE, q_lora_rank=24, qk_rope_head_dim=16),
    ),
    # V3's YaRN (mscale = mscale_all_dim = 1: cos/sin unscaled, softmax scale corrected), half-split rope.
    "deepseek-v3-yarn-halfsplit": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            MLA_MOE,
            q_lora_rank=24,
            qk_rope_head_dim=16,
            rope_interleave=False,
            rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0),
        ),
    ),
}


def _write_checkpoint(case: str, directory: Path) -> torch.nn.Module:
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(1234)
    hf = model_cls(config_cls(**COMMON, **extra)).eval()
    embolden_weights(hf)
    hf.save_pretrained(directory, safe_serialization=True)
    write_word_tokenizer(directory, VOCAB)
    return hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(case: str, tmp_path: Path) -> None:
    hf = _write_checkpoint(case, tmp_path)
    source = open_model_source(str(tmp_path))
    ours = build_model(source, torch.device("cpu"), torch.float32, max_positions=512, seed=0)
    prompt = random_prompt(37, VOCAB, seed=7)

    # Logits at every position of one prefill through the paged path.
    engine = make_engine(ours, num_blocks=16, block_size=8, max_model_len=128)
    table = torch.arange(5)
    positions = torch.arange(len(prompt))
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt),
        positions=positions,
        slot_blocks=table[positions // 8],
        slot_offsets=positions % 8,
        logits_indices=positions,
        block_tables=table.view(1, -1).to(torch.int32),
        prefills=[PrefillSlice(0, len(prompt), len(prompt), table_row=0)],
    )
    with torch.inference_mode():
        our_logits = ours(batch, engine.kv_cache)
        ref_logits = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(our_logits, ref_logits, rtol=1e-4, atol=1e-4)

    # Greedy generation through the whole engine (prefill, then decode steps over paged blocks).
    out = generate_one(make_engine(ours, num_blocks=32, block_size=8, max_model_len=128), prompt, greedy(20))
    assert out.new_token_ids == _reference_greedy(hf, prompt, 20)


def _reference_greedy(hf: torch.nn.Module, prompt: list[int], count: int) -> list[int]:
    """Plain argmax over full recomputation: no generation config (eos suppression etc.) in the way."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_smollm2_gguf_greedy_matches_transformers_on_the_same_weights(smollm2) -> None:
    """The embedded GGUF through our loader and engine vs transformers' own GGUF loader (it dequantizes
    the same file): same greedy answer to a fixed chat prompt."""
    from tokenizers import Tokenizer

    from rank_worker.model_files.embedded import embedded_model_path

    model, tokenizer = smollm2
    path = Path(embedded_model_path())
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    chat = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    prompt = Tokenizer.from_str(tokenizer.tokenizer_json).encode(chat, add_special_tokens=False).ids
    ours = generate_one(make_engine(model, tokenizer), prompt, greedy(16)).new_token_ids
    assert ours == _reference_greedy(reference, prompt, 16)
    assert "Paris" in Tokenizer.from_str(tokenizer.tokenizer_json).decode(ours)
