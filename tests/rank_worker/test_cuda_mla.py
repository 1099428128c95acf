"""The MLA decode kernel (mla_decode_kernel.py, through MlaTritonAttention) against MlaSdpaAttention's absorbed
decode on scattered blocks: head counts below, at and above a head block, latents of the tiny checkpoints and of
V2-Lite/V3, rope widths that need padding, lengths from one token to many tiles and not multiples of the block
size; a whole DeepSeek step (decodes beside a warm and a cold chunk) by both backends; and whole engines, the
kernel backend with and without CUDA graphs against the PyTorch path, greedy tokens equal in float32.

On CUDA with Triton (skipped elsewhere). The kernel and model-step tests also run on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, triton importable) on smaller shapes, without bf16 there: the interpreter's
tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584), so float16 stands in for a 16-bit model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from deepseek_checkpoints import VOCAB, write_deepseek
from engine_fixtures import generate_greedy, generate_one, greedy, make_engine, random_prompt

from rank_worker.engine.factory import build_model
from rank_worker.engine.model_runner import kv_pool_shape
from rank_worker.model.attention import decode_kernel, kv_quant, mla_decode_kernel
from rank_worker.model.attention.mla_sdpa import MlaSdpaAttention
from rank_worker.model.attention.mla_triton import MlaTritonAttention
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice
from rank_worker.model_files.opener import open_model_source

ON_CUDA = decode_kernel.available()
INTERPRETED = not ON_CUDA and os.environ.get("TRITON_INTERPRET") == "1" and mla_decode_kernel.triton is not None
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (ON_CUDA or INTERPRETED), reason="needs CUDA and Triton, or TRITON_INTERPRET=1 and triton"),
]
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA and Triton")

BLOCK_SIZE = 16
SCALE = 192**-0.5  # DeepSeek's qk_head_dim (128 nope + 64 rope)
# (heads, kv_lora_rank, rope): the tiny V2 checkpoint's, heads past one head block, V2-Lite's, V3's
SHAPES = [(4, 32, 8), (20, 64, 16)] + ([] if INTERPRETED else [(16, 512, 64), (128, 512, 64)])
LENGTHS = [1, 15, 16, 17, 70] if INTERPRETED else [1, 15, 16, 17, 100, 511, 512, 513, 1500, 3000]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _tables(lengths: list[int], num_blocks: int, rows: int) -> tuple[torch.Tensor, list[int]]:
    """Scattered blocks (never block 0) for each sequence, in table rows placed out of order."""
    max_blocks = -(-max(lengths) // BLOCK_SIZE) + 3
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros(rows, max_blocks, dtype=torch.int32)
    row_of = torch.randperm(rows)[: len(lengths)].tolist()
    used = 0
    for row, length in zip(row_of, lengths, strict=True):
        count = -(-length // BLOCK_SIZE)
        table[row, :count] = torch.tensor(order[used : used + count])
        used += count
    return table.to(DEVICE), row_of


def _decode_batch(table: torch.Tensor, rows: list[int], lengths: list[int]) -> ForwardBatch:
    zeros = torch.zeros(len(lengths), dtype=torch.long, device=DEVICE)
    return ForwardBatch(
        input_ids=zeros,
        positions=zeros,
        slot_blocks=zeros,
        slot_offsets=zeros,
        logits_indices=zeros[:0],
        block_tables=table,
        num_decodes=len(lengths),
        decode_rows=torch.tensor(rows, device=DEVICE),
        decode_lens=torch.tensor(lengths, device=DEVICE),
    )


def _decode_latent(backend: MlaSdpaAttention, q_lat, q_pe, layer, batch) -> torch.Tensor:
    backend.plan(batch)
    return backend.decode_latent(q_lat, q_pe, layer, batch, SCALE)


@pytest.mark.parametrize(("heads", "rank", "rope"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mla_decode_kernel_matches_the_absorbed_sdpa_decode_on_scattered_blocks(heads, rank, rope, dtype) -> None:
    if INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("the interpreter's tl.dot multiplies bf16 bit patterns (triton-lang/triton#11584)")
    torch.manual_seed(0)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in LENGTHS) + 20
    # two layers: the kernel must honour the pool's block stride, not assume one contiguous layer
    pool = torch.randn(num_blocks, 2, 1, BLOCK_SIZE, 1, rank + rope, device=DEVICE).to(dtype)
    layer = pool[:, 1, 0]
    table, rows = _tables(LENGTHS, num_blocks, len(LENGTHS) + 4)
    batch = _decode_batch(table, rows, LENGTHS)
    q_lat = torch.randn(len(LENGTHS), heads, rank, device=DEVICE).to(dtype)
    q_pe = torch.randn(len(LENGTHS), heads, 2 * rope, device=DEVICE).to(dtype)[..., rope:]  # strided, as split
    ours = _decode_latent(MlaTritonAttention(), q_lat, q_pe, layer, batch)
    reference = _decode_latent(MlaSdpaAttention(), q_lat, q_pe, layer, batch)
    assert ours.dtype == dtype and ours.shape == (len(LENGTHS), heads, rank)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(ours, reference, rtol=tolerance, atol=tolerance)


# slicings the probe may pick: one slice, slices with a floor that leaves a short row's later slices empty (they
# write only their lse, and the merge must not read their partial outputs), many slices, a small tile
LAUNCHES = [
    {"slices": 1},
    {"slices": 4, "min_slice": 32},
    {"slices": 16, "min_slice": 1000},
    {"slices": 64, "TILE": 16},
    {"slices": 128, "min_slice": 0},
]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda launch: "-".join(f"{k}{v}" for k, v in launch.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_slicing_of_the_mla_kernel_gives_the_sdpa_decode(launch, dtype) -> None:
    torch.manual_seed(3)
    heads, rank, rope = SHAPES[1]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in LENGTHS) + 20
    # NaN in every block no row holds: the kernel must read only the rows' own tokens
    pool = torch.full((num_blocks, BLOCK_SIZE, 1, rank + rope), float("nan"), device=DEVICE, dtype=dtype)
    table, rows = _tables(LENGTHS, num_blocks, len(LENGTHS) + 4)
    for row, length in zip(rows, LENGTHS, strict=True):
        blocks = table[row, : -(-length // BLOCK_SIZE)].long()
        pool[blocks] = torch.randn(len(blocks), BLOCK_SIZE, 1, rank + rope, device=DEVICE).to(dtype)
    batch = _decode_batch(table, rows, LENGTHS)
    q_lat = torch.randn(len(LENGTHS), heads, rank, device=DEVICE).to(dtype)
    q_pe = torch.randn(len(LENGTHS), heads, rope, device=DEVICE).to(dtype)
    lens = batch.decode_lens
    ours = mla_decode_kernel.mla_decode_attention(q_lat, q_pe, pool, table, batch.decode_rows, lens, SCALE, launch)
    # the SDPA decode gathers whole padded block rows (weight 0 is still NaN there): its pool has zeros instead
    reference = _decode_latent(MlaSdpaAttention(), q_lat, q_pe, pool.nan_to_num(0.0), batch)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(ours, reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("slices", "filled"), [(8, 5), (128, 77)])  # 128: four chunks of MERGE_SLICES
def test_the_merge_weighs_slices_by_their_mass_and_never_reads_an_empty_slices_output(slices, filled) -> None:
    """Empty slices (lse -inf) write no partial output: NaN there must not reach the merged output."""
    torch.manual_seed(4)
    seqs, heads, dim = 3, 2, 256  # 256 dims: two programs per head (MERGE_DIMS 128)
    partial = torch.randn(seqs, heads, slices, dim, device=DEVICE)
    lse = torch.randn(seqs, heads, slices, device=DEVICE)
    lse[:, :, filled:] = float("-inf")
    partial[:, :, filled:] = float("nan")
    out = torch.empty(seqs, heads, dim, device=DEVICE)
    decode_kernel.merge_slices(partial, lse, out)
    weights = torch.softmax(lse[:, :, :filled], dim=-1)
    expected = (partial[:, :, :filled] * weights[..., None]).sum(dim=2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_mla_kernel_reads_an_fp8_pool_as_the_sdpa_decode_does(dtype) -> None:
    """An fp8 pool (kv_cache_dtype fp8_e4m3): the kernel casts each latent it loads to the model's dtype, the
    SDPA decode dequantises the gathered latents; the same outputs, as over a pool in the model's dtype."""
    torch.manual_seed(5)
    heads, rank, rope = SHAPES[1]
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in LENGTHS) + 20
    pool = kv_quant.quantize(torch.randn(num_blocks, 2, 1, BLOCK_SIZE, 1, rank + rope, device=DEVICE))
    layer = pool[:, 1, 0]
    table, rows = _tables(LENGTHS, num_blocks, len(LENGTHS) + 4)
    batch = _decode_batch(table, rows, LENGTHS)
    q_lat = torch.randn(len(LENGTHS), heads, rank, device=DEVICE).to(dtype)
    q_pe = torch.randn(len(LENGTHS), heads, rope, device=DEVICE).to(dtype)
    ours = _decode_latent(MlaTritonAttention(), q_lat, q_pe, layer, batch)
    reference = _decode_latent(MlaSdpaAttention(), q_lat, q_pe, layer, batch)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(ours, reference, rtol=tolerance, atol=tolerance)


# V2-Lite routes greedily (one group): the one-launch route kernel's way, with the shared experts' slots
GREEDY_V2 = {"topk_method": "greedy", "n_group": 1, "topk_group": 1}


def _tiny_deepseek(model_type: str, directory, **overrides):
    write_deepseek(model_type, directory, **overrides)
    return build_model(open_model_source(str(directory)), DEVICE, torch.float32, max_positions=512, seed=0)


# Each case takes 25-35 s of CPU under the interpreter: CI runs the greedy V2 one, which launches every kernel the
# other two do and the route kernel besides.
@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        pytest.param("deepseek_v2", {}, marks=pytest.mark.slow_interpreter),
        ("deepseek_v2", GREEDY_V2),
        pytest.param("deepseek_v3", {}, marks=pytest.mark.slow_interpreter),
    ],
)
def test_a_deepseek_step_through_the_kernel_backend_matches_the_pytorch_path(
    model_type, overrides, tmp_path, monkeypatch
) -> None:
    """Three decode rows (1, 17 and 40 tokens) beside a chunk of 5 over 30 cached tokens and a cold chunk of 9,
    over a pool of random latents: the same logits (float32). Under the interpreter the CPU is let take the
    CUDA paths' kernels too (the fused norms, latent store and SiLU, MoE's route/align/expert/combine kernels
    with the shared experts' slots), as a GPU does."""
    if INTERPRETED:
        from rank_worker.model import fused_ops, moe

        monkeypatch.setattr(fused_ops, "kernels_available", lambda device: True)
        monkeypatch.setattr(moe, "grouped_gemm_runs", lambda x: True)
        monkeypatch.setattr(moe, "route_runs", lambda x: x.shape[0] <= moe.moe_kernels.ROUTE_MAX_TOKENS)
    torch.manual_seed(4)
    model = _tiny_deepseek(model_type, tmp_path, **overrides)
    windows = MlaTritonAttention()  # the warm chunk's 30 cached latents in windows of 8 (mla_windows.py)
    windows.name, windows.context_window_tokens = "mla_triton_windows", 8
    results = _deepseek_step(model, (MlaSdpaAttention(), MlaTritonAttention(), windows), torch.float32)
    assert model.fused and model.layers[0].self_attn.fused
    torch.testing.assert_close(results["mla_triton"], results["mla_sdpa"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results["mla_triton_windows"], results["mla_sdpa"], rtol=1e-4, atol=1e-4)


def _deepseek_step(model, backends, dtype) -> dict:
    """One step (three decode rows, a warm and a cold chunk) through each backend: name -> logits."""
    decodes, chunks = [1, 17, 40], [(5, 30), (9, 0)]  # chunks: (new, cached)
    lengths = decodes + [new + cached for new, cached in chunks]
    num_blocks = 24
    pool = torch.randn(kv_pool_shape(model, num_blocks, BLOCK_SIZE), device=DEVICE).to(dtype)
    table, rows = _tables(lengths, num_blocks, 8)
    host_table = table.cpu()
    positions, slots, pieces = [n - 1 for n in decodes], [], []
    for (new, cached), row in zip(chunks, rows[len(decodes) :], strict=True):
        pieces.append(PrefillSlice(len(positions), new, cached + new, row))
        positions += range(cached, cached + new)
    token_rows = rows[: len(decodes)] + [p.table_row for p in pieces for _ in range(p.num_new)]
    for row, position in zip(token_rows, positions, strict=True):
        slots.append((int(host_table[row, position // BLOCK_SIZE]), position % BLOCK_SIZE))
    blocks, offsets = (torch.tensor(values, device=DEVICE) for values in zip(*slots, strict=True))
    last = [p.token_start + p.num_new - 1 for p in pieces]
    batch_fields = dict(
        input_ids=torch.randint(0, VOCAB, (len(positions),), device=DEVICE),
        positions=torch.tensor(positions, device=DEVICE),
        slot_blocks=blocks,
        slot_offsets=offsets,
        logits_indices=torch.tensor([0, 1, 2, *last], device=DEVICE),
        block_tables=table,
        num_decodes=len(decodes),
        decode_rows=torch.tensor(rows[: len(decodes)], device=DEVICE),
        decode_lens=torch.tensor(decodes, device=DEVICE),
        prefills=pieces,
    )
    results = {}
    with torch.inference_mode():
        for backend in backends:
            model.set_attention_backend(backend)
            results[backend.name] = model(ForwardBatch(**batch_fields), pool.clone())
    return results


needs_fa4 = pytest.mark.skipif(
    not ON_CUDA or importlib.util.find_spec("cutlass") is None or torch.cuda.get_device_capability()[0] != 9,
    reason="needs flash-attn 4 and an SM90 GPU",
)


@needs_fa4
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_mla_prefill_through_fa4_matches_the_sdpa_prefill_in_bf16(model_type, tmp_path) -> None:
    """The same step with the kernel backend's prefill through FA4 (one varlen launch over the expanded K/V of
    a warm and a cold chunk; or, bounded to windows of 8 context tokens, a launch per window merged by FA4's
    log-sum-exp) and through SDPA, in bf16: logits close; auto takes FA4 for prefill here, and after its
    warm-up the step compiles nothing."""
    from flash_attn.cute import interface

    def compiled() -> int:
        return sum(len(f.compile_cache.cache) for f in vars(interface).values() if hasattr(f, "compile_cache"))

    write_deepseek(model_type, tmp_path)
    model = build_model(open_model_source(str(tmp_path)), DEVICE, torch.bfloat16, max_positions=512, seed=0)
    cfg = model.cfg
    chosen = model.choose_attention("auto", DEVICE, torch.bfloat16)
    assert isinstance(chosen, MlaTritonAttention) and chosen.fa4_prefill
    assert chosen.warm_up(torch.empty(1, device=DEVICE)) > 0
    before = compiled()
    torch.manual_seed(4)
    fa4 = MlaTritonAttention((cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim, torch.bfloat16))
    fa4.name = "mla_fa4"
    windows = MlaTritonAttention((cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim, torch.bfloat16))
    windows.name, windows.context_window_tokens = "mla_fa4_windows", 8
    results = _deepseek_step(model, (MlaTritonAttention(), fa4, windows), torch.bfloat16)
    assert compiled() == before
    reference = results["mla_triton"].float()
    for name in ("mla_fa4", "mla_fa4_windows"):
        error = float((results[name].float() - reference).norm() / reference.norm())
        assert error < 2e-2, (name, error)


@needs_cuda
def test_the_pool_sizing_probe_covers_a_chunk_over_a_long_prefix(tmp_path) -> None:
    """DeepSeek-V2-Lite's shape in two layers, chunks of 512: a chunk over a 7.7K-token prefix takes no more
    memory than the pool's sizing probe measured (its prefix expanded a window at a time; expanded whole it
    took ~14 KB a token, 110 MB here, past the probe's peak: the out-of-memory failures of 2026-12-05)."""
    import json

    from contracts.config import KvServeConfig
    from rank_worker.engine.factory import _profile_peak_bytes, build_random_model

    shape = json.loads((Path(__file__).parents[2] / "bench/shapes/dsv2-lite-chat/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(shape | {"num_hidden_layers": 2}))
    model = build_random_model(str(tmp_path / "config.json"), max_positions=16384)
    config = KvServeConfig(model=str(tmp_path), engine={"max_num_batched_tokens": 512, "cuda_graphs": False})
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    # what the sizing keeps free beyond the weights; the engine's own buffers (sized by its max_model_len, the
    # probe's by its prompt) are allocated before the step, so only the step's own peak is compared with it
    probe = _profile_peak_bytes(config, model, DEVICE, torch.bfloat16, 16384) - weights
    engine = make_engine(
        model, num_blocks=600, block_size=16, max_model_len=16384, max_num_batched_tokens=512, cuda_graphs=False
    )
    assert engine.attention.context_window_tokens == 512
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    generate_one(engine, random_prompt(8192, VOCAB, seed=3), greedy(1))
    torch.cuda.synchronize()
    # within 2 MB (2% here): on an H100 the step took 0.4 MB more than the probe's (per-token bookkeeping of the
    # 8K prompt against the probe's 1K, unexamined); expanded whole, its prefix alone took 110 MB more
    assert torch.cuda.max_memory_allocated() - before <= probe + 2 * 1024**2


@needs_cuda
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_engines_on_the_mla_kernel_with_and_without_graphs_give_the_pytorch_paths_tokens(model_type, tmp_path) -> None:
    """Prompts sharing prefixes (warm chunks over cached latents), chunked prefill (a small token budget),
    batches that shrink as rows finish; float32 so greedy tokens must agree exactly. auto takes the kernel on
    CUDA; the graphed engines replay their decode steps (MoE.every_expert recorded), the last one pipelined;
    an fp8 pool under auto runs the kernel too, and gives the fp8 PyTorch path's tokens."""
    from contracts.config import KvServeConfig
    from rank_worker.engine.factory import build_engine

    write_deepseek(model_type, tmp_path)
    base = random_prompt(200, VOCAB, seed=5)
    prompts = [base[: 30 + 23 * i] + random_prompt(5 + 13 * i, VOCAB, seed=90 + i) for i in range(9)]
    lengths = [10 + 5 * (i % 3) for i in range(9)]
    runs = {}
    for backend, graphs, pipelined, name in (
        ("sdpa", False, False, "mla_sdpa"),
        ("triton", False, False, "mla_triton"),
        ("auto", True, False, "mla_triton"),
        ("triton", True, True, "mla_triton"),
    ):
        config = KvServeConfig(
            model=str(tmp_path),
            dtype="float32",
            device="cuda",
            num_kv_blocks=256,
            max_num_batched_tokens=96,
            max_num_seqs=16,
            cuda_graphs=graphs,
            attention_backend=backend,
            pipeline_steps=pipelined,
        )
        engine = build_engine(config)
        assert engine.attention.name == name
        runs[(backend, graphs, pipelined)] = generate_greedy(engine, prompts, lengths)
        if graphs:
            assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.steps > 10
        assert (engine.pipelined_steps > 0) == pipelined
        assert engine.stats().prefix_hit_tokens > 0
        assert engine.stats().used_blocks == 0
    plain = runs[("sdpa", False, False)]
    assert runs[("triton", False, False)] == plain
    assert runs[("auto", True, False)] == plain
    assert runs[("triton", True, True)] == plain
    fp8_runs = {}
    for backend, name in (("auto", "mla_triton"), ("sdpa", "mla_sdpa")):  # the kernel reads an fp8 pool too
        fp8 = KvServeConfig(
            model=str(tmp_path),
            dtype="float32",
            device="cuda",
            num_kv_blocks=256,
            max_num_batched_tokens=96,
            kv_cache_dtype="fp8_e4m3",
            attention_backend=backend,
        )
        engine = build_engine(fp8)
        assert engine.attention.name == name
        fp8_runs[name] = generate_greedy(engine, prompts, lengths)
    assert fp8_runs["mla_triton"] == fp8_runs["mla_sdpa"]


@needs_cuda
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_grouped_gemm_experts_in_bf16_match_the_loop_and_replay_in_a_cuda_graph(
    model_type, tmp_path, monkeypatch
) -> None:
    """bf16 on an SM90 GPU takes MoE.grouped_experts (two torch._grouped_mm, no host sync): close to the
    experts_hit loop on the same routing, the same bits on a second run, close to the grouped GEMMs over
    PyTorch's argsort (a prefill-sized batch's way) from moe_kernels (a decode batch's), and recorded in a
    CUDA graph it replays the eager result exactly (new inputs copied into the recorded buffer)."""
    from rank_worker.model import moe_kernels
    from rank_worker.model.moe import grouped_gemm_runs

    write_deepseek(model_type, tmp_path)
    model = build_model(open_model_source(str(tmp_path)), DEVICE, torch.bfloat16, max_positions=512, seed=0)
    moe = model.layers[1].mlp
    torch.manual_seed(12)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs compute capability 9.0")
    x = torch.randn(37, model.cfg.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    assert grouped_gemm_runs(x)
    with torch.inference_mode():
        ids, weights = moe.route(x)
        grouped = moe.grouped_experts(x, ids, weights)
        torch.testing.assert_close(grouped, moe.experts_hit(x, ids, weights), rtol=2e-2, atol=2e-2)
        assert torch.equal(grouped, moe.grouped_experts(x, ids, weights))
        with monkeypatch.context() as patch:
            patch.setattr(moe_kernels, "ALIGN_MAX_PAIRS", 0)
            # a prefill-sized batch's way: the grouped GEMMs instead of moe_mlp_kernel (other float32 sums)
            by_gemms = moe.grouped_experts(x, ids, weights)
        torch.testing.assert_close(by_gemms, grouped, rtol=2e-2, atol=2e-2)
        static = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(static)  # warm-up off the capture (allocator pools, kernel selection)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recorded = moe(static)
        other = torch.randn_like(x)
        static.copy_(other)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(recorded, moe(other), rtol=0, atol=0)
