"""The fp8 KV cache (kv_cache_dtype: fp8_e4m3) on the CPU/SDPA path, for both families (engine_model: the
embedded SmolLM2 and a tiny DeepSeek-V3, whose pool holds MLA latents): the pool's dtype and how many blocks a
memory budget holds, e4m3's round-trip error and saturation, greedy tokens and logits against the same engine
in the model's dtype (the measured match rate is in the assertion message), warm == cold, chunked and
batched exactly, L1 restore exactly, the block-hash namespace, and the CUDA kernels refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from engine_fixtures import generate_greedy, generate_one, greedy, make_engine, random_prompt, run_to_completion
from l1_fixtures import kvstore_settings, l1_engine, tiny_model
from service_processes import free_port, start_kvstore

from contracts.block_hash import prefix_block_hashes
from contracts.config import KvServeConfig
from rank_worker.engine.factory import size_kv_pool
from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.model_runner import kv_block_bytes
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.model.attention import kv_quant
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

BLOCK = 16
FP8 = {"kv_cache_dtype": "fp8_e4m3"}


def _fp8_engine(model, tokenizer=None, **overrides: object) -> PagedEngine:
    return make_engine(model, tokenizer, **FP8, **overrides)


# --- the pool ---


def test_the_pool_is_float8_and_a_block_takes_one_byte_a_value(engine_model) -> None:
    model, tokenizer = engine_model
    auto, fp8 = make_engine(model, tokenizer, num_blocks=8), _fp8_engine(model, tokenizer, num_blocks=8)
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    assert auto.kv_cache.dtype == model.embed_tokens.dtype  # auto: the model's dtype, unchanged
    assert fp8.kv_cache.shape == auto.kv_cache.shape  # same layout, block-major: one block one chunk
    assert fp8.kv_cache[0].nbytes * auto.kv_cache.element_size() == auto.kv_cache[0].nbytes
    assert fp8.kv_cache[0].is_contiguous()


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_a_memory_budget_holds_itemsize_times_the_blocks_in_fp8(engine_model, model_dtype: torch.dtype) -> None:
    """Sized as the CPU sizes it (kv_cache_memory_gb): a bf16 model's fp8 pool holds 2x the blocks, float32's 4x."""
    model, _ = engine_model
    budget = {"kv_cache_memory_gb": 0.01, "block_size": BLOCK}
    cpu = torch.device("cpu")
    auto = size_kv_pool(KvServeConfig(**budget), model, cpu, model_dtype, 2048)
    fp8 = size_kv_pool(KvServeConfig(**budget, **FP8), model, cpu, model_dtype, 2048)
    assert fp8 // model_dtype.itemsize == auto, (auto, fp8)  # floor division of one budget by both block sizes
    assert fp8 == int(0.01 * 1024**3) // kv_block_bytes(model, BLOCK, torch.float8_e4m3fn)
    assert kv_block_bytes(model, BLOCK, torch.float8_e4m3fn) * 2 == kv_block_bytes(model, BLOCK, torch.bfloat16)


def test_the_config_key_defaults_to_the_models_dtype_and_refuses_others() -> None:
    assert KvServeConfig().engine.kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KvServeConfig(kv_cache_dtype="int8")


# --- quantise / dequantise ---


def test_round_trip_error_is_within_e4m3s_half_step_and_the_range_ends_saturate() -> None:
    gen = torch.Generator().manual_seed(0)
    # Magnitudes across e4m3's whole normal range [2^-6, 448], both signs.
    magnitude = torch.exp2(torch.empty(20000).uniform_(-6, math.log2(448), generator=gen))
    x = magnitude * torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float32)
    relative = ((back - x).abs() / x.abs()).max().item()
    assert relative <= 2**-4, relative  # 3 mantissa bits: round to nearest is off by at most half of 2^-3
    assert relative > 2**-6  # and it does round: a test that could not see fp8 would measure 0
    ends = torch.tensor([448.0, 449.0, 1e4, 1e30, -448.0, -1e4, -1e30])
    stored = kv_quant.quantize(ends)
    assert stored.dtype == torch.float8_e4m3fn
    assert kv_quant.dequantize(stored, torch.float32).tolist() == [448.0] * 4 + [-448.0] * 3  # saturated, no NaN
    assert kv_quant.dequantize(kv_quant.quantize(torch.zeros(3)), torch.float32).tolist() == [0.0] * 3
    # Dequantised into the compute dtype; a pool in the model's dtype is read as it is.
    assert kv_quant.dequantize(stored, torch.bfloat16).dtype == torch.bfloat16
    plain = torch.randn(4)
    assert kv_quant.dequantize(plain, torch.float32) is plain
    assert kv_quant.round_trip(plain, torch.zeros(1)) is plain


def test_pool_dtype_names_the_setting() -> None:
    assert kv_quant.pool_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_quant.pool_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or fp8_e4m3"):
        kv_quant.pool_dtype("fp8_e5m2", torch.float32)  # type: ignore[arg-type]


# --- against the model's own dtype ---


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(24 + 7 * i, vocab, seed=40 + i) for i in range(4)]


# Bounds on the relative logit error (the worst position; the assertion messages print it), measured:
# SmolLM2 (real weights) 0.06 prefill, 0.07 decode; the tiny random DeepSeek-V3 0.39 prefill, 0.06 decode.
# Its latents carry e4m3's ~2.6% error like any (measured per layer), but its bold random weights make
# attention near one-hot and its routing discrete (8 experts, a drawn correction bias), so a small change in
# a score can move a token: a measure of that model's sensitivity more than of fp8.
LOGIT_ERROR_BOUND = {"llama": 0.1, "deepseek_v3": 0.6}


def test_greedy_tokens_mostly_match_the_models_dtype(engine_model) -> None:
    """Two rates: free-running greedy tokens equal position by position (a divergence compounds), and the
    top-1 agreement along the reference's own continuation (teacher-forced: each position's next token over
    the same context), which is what fp8 changes per step. The floor holds for the second in both families."""
    model, tokenizer = engine_model
    prompts, length = _prompts(model.cfg.vocab_size), 12
    reference = generate_greedy(make_engine(model, tokenizer, prefix_cache=False), prompts, [length] * len(prompts))
    fp8 = generate_greedy(_fp8_engine(model, tokenizer, prefix_cache=False), prompts, [length] * len(prompts))
    positions = len(prompts) * length
    same = sum(a == b for ref, ours in zip(reference, fp8, strict=True) for a, b in zip(ref, ours, strict=True))
    agree = 0
    settings = {"num_blocks": 8, "block_size": BLOCK, "max_model_len": 8 * BLOCK, "prefix_cache": False}
    ref_engine, fp8_engine = make_engine(model, tokenizer, **settings), _fp8_engine(model, tokenizer, **settings)
    for prompt, continuation in zip(prompts, reference, strict=True):
        sequence = prompt + continuation  # in blocks 0.. of each pool, over the previous prompt's
        ref_logits, _ = _logits(model, ref_engine, sequence)
        fp8_logits, _ = _logits(model, fp8_engine, sequence)
        span = slice(len(prompt) - 1, len(sequence) - 1)  # the logits that chose each continuation token
        agree += int((ref_logits[span].argmax(-1) == fp8_logits[span].argmax(-1)).sum())
    rate, forced = same / positions, agree / positions
    message = (
        f"{model.cfg.model_type}: fp8 KV greedy match {rate:.3f} of positions free-running, {forced:.3f} teacher-forced"
    )
    print(message)
    assert forced >= 0.6, message
    assert rate >= 0.2, message  # at least the first tokens after each prompt


def _logits(model, engine: PagedEngine, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits of every position but the last, then the last token's logits from a decode step that
    reads the whole context back from the pool."""
    count = len(prompt) - 1
    table = torch.arange(-(-len(prompt) // BLOCK), dtype=torch.int32).unsqueeze(0)
    positions = torch.arange(len(prompt))
    blocks, offsets = positions // BLOCK, positions % BLOCK
    with torch.inference_mode():
        prefill = ForwardBatch(
            input_ids=torch.tensor(prompt[:count]),
            positions=positions[:count],
            slot_blocks=blocks[:count],
            slot_offsets=offsets[:count],
            logits_indices=torch.arange(count),
            block_tables=table,
            prefills=[PrefillSlice(0, count, count, table_row=0)],
        )
        first = model(prefill, engine.kv_cache)
        decode = ForwardBatch(
            input_ids=torch.tensor(prompt[count:]),
            positions=positions[count:],
            slot_blocks=blocks[count:],
            slot_offsets=offsets[count:],
            logits_indices=torch.tensor([0]),
            block_tables=table,
            num_decodes=1,
            decode_rows=torch.tensor([0]),
            decode_lens=torch.tensor([len(prompt)]),
        )
        last = model(decode, engine.kv_cache)
    return first, last


def test_logits_are_close_to_the_models_dtype(engine_model) -> None:
    model, tokenizer = engine_model
    prompt = random_prompt(40, model.cfg.vocab_size, seed=7)
    settings = {"num_blocks": 4, "block_size": BLOCK, "max_model_len": 64, "prefix_cache": False}
    ref_prefill, ref_decode = _logits(model, make_engine(model, tokenizer, **settings), prompt)
    fp8_prefill, fp8_decode = _logits(model, _fp8_engine(model, tokenizer, **settings), prompt)
    bound = LOGIT_ERROR_BOUND[model.cfg.model_type]
    for name, ours, ref in [("prefill", fp8_prefill, ref_prefill), ("decode", fp8_decode, ref_decode)]:
        error = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        message = f"{model.cfg.model_type} {name}: relative logit error {error:.4f} (bound {bound})"
        print(message)
        assert 0 < error <= bound, message


# --- exactness within fp8 ---


def _prompt_block_bytes(engine: PagedEngine, prompt: list[int]) -> torch.Tensor:
    """The bytes of the prompt's full blocks as the prefix cache holds them, in prompt order."""
    hashes = prefix_block_hashes(engine.namespace, prompt, engine.settings.engine.block_size)
    block_ids = [engine.pool.lookup(h) for h in hashes]
    assert None not in block_ids
    return _export_blocks(engine, block_ids).view(torch.uint8)  # type: ignore[arg-type]


def _export_blocks(engine: PagedEngine, block_ids: list[int]) -> torch.Tensor:
    """Physical blocks copied out of the engine's pool (all layers of each block, contiguous)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=engine.kv_cache.device)
    return engine.kv_cache.index_select(0, index)


def _import_blocks(engine: PagedEngine, block_ids: list[int], data: torch.Tensor) -> None:
    """Blocks another engine of the same model and layout exported, written into these physical blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=engine.kv_cache.device)
    data = data.to(engine.kv_cache.device, engine.kv_cache.dtype).contiguous()
    # As bytes: index_copy_ has no float8 kernel on the CPU, and a block is its bytes whatever the dtype.
    engine.kv_cache.view(torch.uint8).index_copy_(0, index, data.view(torch.uint8))


def test_warm_and_chunked_give_the_cold_tokens_and_bytes(engine_model) -> None:
    model, tokenizer = engine_model
    prompt = random_prompt(6 * BLOCK + 5, model.cfg.vocab_size, seed=11)
    cold_engine = _fp8_engine(model, tokenizer)
    cold = generate_one(cold_engine, prompt, greedy(10), "cold")
    warm = generate_one(cold_engine, prompt, greedy(10), "warm")
    assert warm.stats.l0_cached_tokens == 6 * BLOCK
    assert warm.new_token_ids == cold.new_token_ids
    # Chunked over a cached prefix against the same chunks computed cold. Not against the one pass above: the
    # CPU's attention blocks a 16-token chunk differently from a 101-token one, and on some CPUs (AVX-512, torch
    # 2.13) the last-bit differences flip fp8 roundings that then spread through the layers (12% of the bytes,
    # other greedy tokens); the prefix cache's promise is that reusing blocks equals recomputing them.
    cold_chunks_engine = _fp8_engine(model, tokenizer, max_num_batched_tokens=BLOCK)  # a block a step
    cold_chunks = generate_one(cold_chunks_engine, prompt, greedy(10), "cold-chunks")
    assert cold_chunks.stats.l0_cached_tokens == 0
    chunked_engine = _fp8_engine(model, tokenizer, max_num_batched_tokens=BLOCK)
    generate_one(chunked_engine, prompt[: 3 * BLOCK + 2], greedy(2), "earlier-turn")
    chunked = generate_one(chunked_engine, prompt, greedy(10), "chunked")
    assert chunked.stats.l0_cached_tokens == 3 * BLOCK
    assert chunked.new_token_ids == cold_chunks.new_token_ids
    # What a chunked pass over a cached prefix stored: the same quantised bytes, in order, as recomputing it.
    assert torch.equal(_prompt_block_bytes(chunked_engine, prompt), _prompt_block_bytes(cold_chunks_engine, prompt))


def test_batched_equals_one_at_a_time(engine_model) -> None:
    model, tokenizer = engine_model
    prompts = [random_prompt(5 + 13 * i, model.cfg.vocab_size, seed=60 + i) for i in range(6)]
    lengths = [4 + i for i in range(6)]
    alone = [
        generate_one(_fp8_engine(model, tokenizer, prefix_cache=False), p, greedy(n)).new_token_ids
        for p, n in zip(prompts, lengths, strict=True)
    ]
    engine = _fp8_engine(model, tokenizer, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache=False)
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(EngineRequest(f"q{i}", p, greedy(n)))
    together = run_to_completion(engine)
    assert [together[f"q{i}"].new_token_ids for i in range(6)] == alone


def test_exported_blocks_import_byte_for_byte(engine_model) -> None:
    model, tokenizer = engine_model
    engine = _fp8_engine(model, tokenizer, num_blocks=8)
    prompt = random_prompt(3 * BLOCK + 1, model.cfg.vocab_size, seed=3)
    generate_one(engine, prompt, greedy(1))
    data = _prompt_block_bytes(engine, prompt).view(torch.float8_e4m3fn)
    other = _fp8_engine(model, tokenizer, num_blocks=8)
    _import_blocks(other, [5, 2, 7], data)
    assert torch.equal(_export_blocks(other, [5, 2, 7]).view(torch.uint8), data.view(torch.uint8))


def test_session_evicted_from_l0_is_restored_from_l1_exactly(engine_model, tmp_path: Path) -> None:
    model, tokenizer = engine_model
    vocab = model.cfg.vocab_size
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        engine = l1_engine(model, tokenizer, port, num_blocks=20, max_model_len=320, **FP8)
        assert engine.stats().l1_attached
        a1_prompt = random_prompt(8 * BLOCK + 5, vocab, seed=21)
        a1 = generate_one(engine, a1_prompt, greedy(8), "a1")
        assert engine.stats().l1_offloaded_blocks == 8
        before = _prompt_block_bytes(engine, a1_prompt)
        generate_one(engine, random_prompt(300, vocab, seed=22), greedy(2), "b")  # evicts most of A from L0
        a2_prompt = a1_prompt + a1.new_token_ids + random_prompt(20, vocab, seed=23)
        a2 = generate_one(engine, a2_prompt, greedy(8), "a2")
        assert a2.stats.l1_cached_tokens >= 6 * BLOCK
        assert a2.stats.l0_cached_tokens + a2.stats.l1_cached_tokens == 8 * BLOCK
        assert torch.equal(_prompt_block_bytes(engine, a1_prompt), before)  # the bytes that left came back
        cold = generate_one(_fp8_engine(model, tokenizer, prefix_cache=False), a2_prompt, greedy(8), "cold")
        assert a2.new_token_ids == cold.new_token_ids
        engine.close()


# --- the namespace and the kernels ---


def test_the_namespace_carries_the_kv_dtype(engine_model) -> None:
    model, tokenizer = engine_model
    auto, fp8 = make_engine(model, tokenizer, num_blocks=4), _fp8_engine(model, tokenizer, num_blocks=4)
    assert fp8.namespace != auto.namespace  # neither L1 nor the router's index mixes their blocks
    assert fp8.model_info.hash_namespace == fp8.namespace
    prompt = random_prompt(2 * BLOCK + 1, model.cfg.vocab_size, seed=9)
    assert set(prefix_block_hashes(fp8.namespace, prompt, BLOCK)).isdisjoint(
        prefix_block_hashes(auto.namespace, prompt, BLOCK)
    )


@pytest.mark.parametrize("setting", ["fa4", "flashinfer"])
def test_fa4_and_flashinfer_are_refused_by_name_with_fp8(engine_model, setting) -> None:
    """Checked before anything asks for CUDA, so it holds on the CPU as on a GPU: FA4's SM90 kernel and
    FlashInfer's FA3 module read 16-bit K/V only (the Triton kernels read fp8: test_cuda_attention.py)."""
    model, tokenizer = engine_model
    with pytest.raises(RuntimeError, match=rf"attention_backend: {setting} does not read an fp8 KV cache.*triton"):
        _fp8_engine(model, tokenizer, num_blocks=4, attention_backend=setting)


def test_fp8_runs_the_sdpa_path_under_auto_on_the_cpu() -> None:
    engine = _fp8_engine(tiny_model(), num_blocks=4, attention_backend="auto")
    assert engine.attention.name == "sdpa"
    assert not engine.attention.fused_store and not engine.attention.graph_safe  # eager steps, no fused store
