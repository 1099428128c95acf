"""DeepSeek-V2/V3 in our engine against transformers on tiny random checkpoints the tests write: the absorbed
decode and the prefill over a cached latent prefix (one mixed step) within float32 tolerance, warm == cold
through the prefix cache with chunked prefill, the latent pool's shape and bytes, loading (V3's MTP layer
skipped, random weights from a config.json) and the refusals. Prefill logits and greedy tokens of each
variant are in test_model_parity; batching, preemption and L1 restore run on both families through the
engine_model fixture (test_batching, test_prefix_cache, test_l1_engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_checkpoints import V2, V3, VOCAB, load_ours, reference_greedy, write_deepseek
from engine_fixtures import generate_one, greedy, make_engine, random_prompt
from safetensors.torch import load_file, save_file

from rank_worker.engine.factory import build_model
from rank_worker.engine.model_runner import kv_block_bytes, kv_pool_shape
from rank_worker.model.attention.mla_sdpa import MlaSdpaAttention
from rank_worker.model.attention.mla_triton import MlaTritonAttention
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.feature_check import UnsupportedModelError
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice
from rank_worker.model.moe import grouped_gemm_runs
from rank_worker.model_files.hf_config import normalize_hf_config
from rank_worker.model_files.opener import open_model_source

BLOCK = 8


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = write_deepseek(request.param, directory)
    model, tokenizer = load_ours(directory)
    return hf, model, tokenizer, directory


def _slots(table: list[int], start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + count)
    return torch.tensor(table)[positions // BLOCK], positions % BLOCK


def test_absorbed_decode_and_prefill_over_a_latent_prefix_match_transformers(checkpoint) -> None:
    """Sequence A prefills 21 tokens, B 13; then one mixed step: A decodes its 22nd token (absorbed, over the
    latents in the pool) while B prefills 9 more over its 13 cached ones (latents expanded into K/V)."""
    hf, model, _, _ = checkpoint
    a, b = random_prompt(22, VOCAB, seed=1), random_prompt(22, VOCAB, seed=2)
    engine = make_engine(model, num_blocks=16, block_size=BLOCK, max_model_len=128)
    tables = [[3, 9, 1], [7, 2, 12]]  # scattered blocks: reads must go through the block table
    block_tables = torch.tensor(tables, dtype=torch.int32)
    with torch.inference_mode():
        for row, (prompt, count) in enumerate([(a, 21), (b, 13)]):
            blocks, offsets = _slots(tables[row], 0, count)
            prefill = ForwardBatch(
                input_ids=torch.tensor(prompt[:count]),
                positions=torch.arange(count),
                slot_blocks=blocks,
                slot_offsets=offsets,
                logits_indices=torch.tensor([count - 1]),
                block_tables=block_tables,
                prefills=[PrefillSlice(0, count, count, table_row=row)],
            )
            model(prefill, engine.kv_cache)
        a_blocks, a_offsets = _slots(tables[0], 21, 1)
        b_blocks, b_offsets = _slots(tables[1], 13, 9)
        mixed = ForwardBatch(
            input_ids=torch.tensor([a[21], *b[13:22]]),
            positions=torch.tensor([21, *range(13, 22)]),
            slot_blocks=torch.cat([a_blocks, b_blocks]),
            slot_offsets=torch.cat([a_offsets, b_offsets]),
            logits_indices=torch.arange(10),
            block_tables=block_tables,
            num_decodes=1,
            decode_rows=torch.tensor([0]),
            decode_lens=torch.tensor([22]),
            prefills=[PrefillSlice(1, 9, 22, table_row=1)],
        )
        ours = model(mixed, engine.kv_cache)
        ref_a = hf(torch.tensor([a])).logits[0, 21:22].float()
        ref_b = hf(torch.tensor([b])).logits[0, 13:22].float()
    torch.testing.assert_close(ours, torch.cat([ref_a, ref_b]), rtol=1e-4, atol=1e-4)


def test_warm_and_chunked_prefill_give_the_cold_tokens(checkpoint) -> None:
    hf, model, tokenizer, _ = checkpoint
    prompt = random_prompt(61, VOCAB, seed=5)
    cold = generate_one(make_engine(model, tokenizer, prefix_cache=False), prompt, greedy(12), "cold")
    assert cold.new_token_ids == reference_greedy(hf, prompt, 12)
    engine = make_engine(model, tokenizer, block_size=BLOCK, max_num_batched_tokens=16)  # chunks of 16
    generate_one(engine, prompt[:45], greedy(3), "earlier-turn")
    warm = generate_one(engine, prompt, greedy(12), "warm")
    assert warm.stats.l0_cached_tokens == 40  # the five full blocks of the earlier turn's 45 tokens
    assert warm.new_token_ids == cold.new_token_ids


def test_the_pool_keeps_only_the_latent_per_token_and_layer(checkpoint) -> None:
    _, model, tokenizer, _ = checkpoint
    cfg = model.cfg
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert kv_pool_shape(model, 10, BLOCK) == (10, cfg.num_layers, 1, BLOCK, 1, latent)
    assert kv_block_bytes(model, BLOCK, torch.bfloat16) == cfg.num_layers * BLOCK * latent * 2
    engine = make_engine(model, tokenizer, num_blocks=6, block_size=BLOCK)
    assert tuple(engine.kv_cache.shape) == (7, cfg.num_layers, 1, BLOCK, 1, latent)  # + the scratch block
    assert engine.kv_cache[0].is_contiguous()  # a block is one chunk for the L1 copies


def test_deepseek_v2_lite_latent_is_576_values_about_30_kb_per_token() -> None:
    """The issue's numbers, from the V2-Lite config.json's shape: 27 layers of 512 + 64 values in bf16."""
    lite = dict(V2, num_hidden_layers=27, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=2048)
    lite.update(num_attention_heads=16, model_type="deepseek_v2", rope_parameters=None)
    cfg = DeepseekConfig.from_hf(normalize_hf_config(lite))
    assert cfg.latent_dim == 576
    model = _meta_model(cfg)
    assert kv_block_bytes(model, 1, torch.bfloat16) == 27 * 576 * 2 == 31104


def _meta_model(cfg: DeepseekConfig) -> torch.nn.Module:
    from rank_worker.model.deepseek import DeepseekForCausalLM

    with torch.device("meta"):
        return DeepseekForCausalLM(cfg, max_positions=16)


def test_mtp_layer_tensors_are_skipped_and_unknown_ones_refused(tmp_path: Path) -> None:
    """V3 checkpoints carry a multi-token-prediction layer after the last one; it is not part of the forward."""
    hf = write_deepseek("deepseek_v3", tmp_path, num_mtp_layers=1)
    shard = tmp_path / "model.safetensors"
    tensors = load_file(shard)
    layers = hf.config.num_hidden_layers
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{layers}.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, shard, metadata={"format": "pt"})
    model, tokenizer = load_ours(tmp_path)
    prompt = random_prompt(20, VOCAB, seed=3)
    assert generate_one(make_engine(model, tokenizer), prompt, greedy(6)).new_token_ids == reference_greedy(
        hf, prompt, 6
    )
    tensors["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)  # layer 0 is dense
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.0\.mlp\.experts"):
        load_ours(tmp_path)


def test_random_weights_from_a_config_json_alone(tmp_path: Path) -> None:
    config = dict(V3, model_type="deepseek_v3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = open_model_source(str(tmp_path / "config.json"))
    assert source.load_weights is None
    model = build_model(source, torch.device("cpu"), torch.bfloat16, max_positions=256, seed=0)
    assert model.embed_tokens.dtype == torch.bfloat16
    router = model.layers[1].mlp.gate
    assert router.weight.dtype == torch.float32  # routing in float32 whatever the model's dtype
    assert not router.e_score_correction_bias.any()
    out = generate_one(make_engine(model), random_prompt(30, VOCAB, seed=4), greedy(5))
    assert len(out.new_token_ids) == 5


def test_uniform_random_weights_draw_every_parameter_as_vllm_does(tmp_path: Path) -> None:
    """random_weights uniform: every parameter (norms, the float32 router and its bias too) in (-1e-3, 1e-3),
    none left at its normal-scheme value, equal where shapes are; an unknown scheme is refused by name."""
    config = dict(V3, model_type="deepseek_v3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    (tmp_path / "config.json").write_text(json.dumps(config))
    source = open_model_source(str(tmp_path / "config.json"))
    model = build_model(source, torch.device("cpu"), torch.float32, max_positions=256, seed=0, random_weights="uniform")
    for name, param in model.named_parameters():
        assert param.abs().max() <= 1e-3, name
        assert param.std() > 1e-4, name  # drawn, not filled (norms were 1, the bias 0)
    # each parameter's generator seeded alike, as vLLM's: tensors of one shape are equal, others differ
    layers = [layer for layer in model.layers if hasattr(layer.mlp, "experts_gate_up")]
    assert len(layers) >= 2
    assert torch.equal(layers[0].mlp.experts_gate_up, layers[1].mlp.experts_gate_up)
    assert not torch.equal(layers[0].mlp.experts_gate_up[0], layers[0].mlp.experts_gate_up[1])
    with pytest.raises(ValueError, match="no scheme 'xavier'"):
        build_model(source, torch.device("cpu"), torch.float32, max_positions=256, seed=0, random_weights="xavier")


def test_attention_backend_is_the_mla_path_and_kernels_are_refused(checkpoint) -> None:
    """On the CPU auto and sdpa take the PyTorch MLA path (the MLA kernel, mla_triton.py, needs CUDA: its
    choice on a GPU is in test_cuda_mla); triton without CUDA and flashinfer anywhere are refused by name."""
    _, model, tokenizer, _ = checkpoint
    cpu = torch.device("cpu")
    assert type(model.choose_attention("auto", cpu, torch.float32)) is MlaSdpaAttention
    assert type(make_engine(model, tokenizer, attention_backend="sdpa").attention) is MlaSdpaAttention
    with pytest.raises(RuntimeError, match="triton for MLA needs CUDA"):
        model.choose_attention("triton", cpu, torch.float32)
    with pytest.raises(RuntimeError, match="flashinfer has no MLA kernel"):
        model.choose_attention("flashinfer", cpu, torch.float32)
    assert not MlaSdpaAttention.graph_safe  # its decode sizes its gather on the host: no CUDA graphs
    assert MlaTritonAttention.graph_safe


def test_a_gpu_without_flash_attn_4_says_mla_prefill_runs_sdpa(checkpoint, monkeypatch, caplog) -> None:
    """Where the MLA kernel runs but flash-attn 4 does not (not installed, not SM90), prefill falls back to SDPA,
    which over a long prefix is slow enough to stall every decoder: the rank says so at start. A CUDA device is
    pretended (nothing runs on it: choosing a backend launches nothing)."""
    from rank_worker.model.attention import decode_kernel, fa4_backend

    _, model, _, _ = checkpoint
    monkeypatch.setattr(decode_kernel, "available", lambda: True)
    for usable in (False, True):
        monkeypatch.setattr(fa4_backend, "usable", lambda device, dtype, usable=usable: usable)
        caplog.clear()
        with caplog.at_level("WARNING", logger="rank_worker.model.deepseek"):
            chosen = model.choose_attention("auto", torch.device("cuda"), torch.bfloat16)
        assert type(chosen) is MlaTritonAttention and chosen.fa4_prefill is usable
        warned = [r.getMessage() for r in caplog.records if "MLA prefill runs SDPA" in r.getMessage()]
        assert len(warned) == (0 if usable else 1)


def test_routed_experts_without_a_host_sync_match_the_loop_over_the_experts_hit(checkpoint) -> None:
    """MoE.every_expert (what a CUDA graph records) against experts_hit (the eager path) on the same routing."""
    _, model, _, _ = checkpoint
    moe = model.layers[1].mlp
    torch.manual_seed(7)
    x = torch.randn(3, model.cfg.hidden_size)  # 3 tokens of top-2 over 8 experts: some experts unused
    ids, weights = moe.route(x)
    close = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(moe.every_expert(x, ids, weights), moe.experts_hit(x, ids, weights), **close)


def test_grouped_gemm_experts_match_the_loop_over_the_experts_hit(checkpoint) -> None:
    """MoE.grouped_experts (sorted pairs, two torch._grouped_mm: the bf16 CUDA path) against experts_hit, here
    on the CPU in float32, with tokens that leave experts unused and one token batch that is empty."""
    _, model, _, _ = checkpoint
    moe = model.layers[1].mlp
    torch.manual_seed(11)
    for count in (1, 3, 40):
        x = torch.randn(count, model.cfg.hidden_size)
        ids, weights = moe.route(x)
        torch.testing.assert_close(moe.grouped_experts(x, ids, weights), moe.experts_hit(x, ids, weights))
    empty = torch.empty(0, model.cfg.hidden_size)
    ids, weights = moe.route(empty)
    assert moe.grouped_experts(empty, ids, weights).shape == (0, model.cfg.hidden_size)
    assert not grouped_gemm_runs(x)  # the CPU keeps the exact loop


def test_shared_experts_run_as_experts_every_token_takes_at_weight_one(checkpoint) -> None:
    """The shared MLP loaded as S experts stacked after the routed ones (its intermediate dims cut in S): their
    weighted sum at weight 1 is transformers' shared_experts; each token's slots are its k routed experts, then
    the shared ones; the whole layer is transformers' MoE."""
    hf, model, _, _ = checkpoint
    ours, theirs = model.layers[1].mlp, hf.model.layers[1].mlp
    routed, shared = model.cfg.n_routed_experts, model.cfg.n_shared_experts
    assert ours.experts_gate_up.shape[0] == routed + shared and not hasattr(ours, "shared_experts")
    torch.manual_seed(13)
    x = torch.randn(5, model.cfg.hidden_size)
    ids, weights = ours.route(x)
    k = model.cfg.num_experts_per_tok
    assert ids.shape == weights.shape == (5, k + shared)
    assert torch.equal(ids[:, k:], torch.arange(routed, routed + shared).expand(5, -1))
    assert torch.equal(weights[:, k:], torch.ones(5, shared))
    assert (ids[:, :k] < routed).all()
    close = {"rtol": 1e-5, "atol": 1e-6}
    with torch.inference_mode():
        only_shared = ours.experts_hit(x, ids[:, k:], weights[:, k:])
        torch.testing.assert_close(only_shared, theirs.shared_experts(x), **close)
        torch.testing.assert_close(ours(x), theirs(x.unsqueeze(0)).squeeze(0), **close)


def test_a_shared_expert_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path: Path) -> None:
    write_deepseek("deepseek_v2", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    weights[name] = weights[name][:, :-1].contiguous()  # one intermediate dim short
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"shared_experts\.down_proj\.weight: checkpoint shape"):
        load_ours(tmp_path)


@pytest.mark.parametrize(
    ("base", "change", "message"),
    [
        (V3, {"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints"),
        (V3, {"scoring_func": "softmax"}, "routes with sigmoid scores"),
        (V3, {"topk_method": "greedy"}, "routes by noaux_tc"),
        (V2, {"topk_method": "noaux_tc"}, "routes by greedy or group_limited_greedy"),
        (V2, {"norm_topk_prob": True}, "norm_topk_prob"),
        (V2, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic'"),
        (V3, {"n_routed_experts": 6, "n_group": 4}, "not a multiple of n_group"),
        (V3, {"attention_bias": True}, "attention biases"),
    ],
)
def test_unsupported_configs_are_refused_by_name(base: dict, change: dict, message: str) -> None:
    model_type = "deepseek_v3" if base is V3 else "deepseek_v2"
    config = normalize_hf_config(dict(base, model_type=model_type, **change))
    with pytest.raises(UnsupportedModelError, match=message):
        DeepseekConfig.from_hf(config)


def test_whole_query_is_a_view_of_one_projection_and_a_copy_of_two() -> None:
    """FA4's MLA prefill takes [q_nope | q_pe] per head: the split projection's own tensor (no copy) when the two
    are its views, a joined copy when they are not."""
    from rank_worker.model.attention.mla_triton import whole_query

    q = torch.randn(5, 3, 12)
    q_nope, q_pe = q.split([8, 4], dim=-1)
    joined = whole_query(q_nope[1:4], q_pe[1:4])
    assert joined.data_ptr() == q[1:4].data_ptr() and torch.equal(joined, q[1:4])
    apart = whole_query(q_nope.clone(), q_pe.clone())
    assert apart.data_ptr() != q.data_ptr() and torch.equal(apart, q)
    assert torch.equal(whole_query(q_pe, q_nope), torch.cat([q_pe, q_nope], dim=-1))  # the wrong order: copied
    wide = torch.randn(5, 3 * 12 + 7)  # V2's q beside kv_a in one projection: rows 43 apart, not 36
    q_nope, q_pe = wide[:, :36].view(5, 3, 12).split([8, 4], dim=-1)
    packed = whole_query(q_nope, q_pe)
    assert packed.is_contiguous() and torch.equal(packed, wide[:, :36].view(5, 3, 12))
