"""The CUDA backend against the CPU path (SDPA over gathered blocks), on CUDA (skipped elsewhere): the decode
and prefill kernels on scattered blocks with GQA groups, head sizes, lengths from one token to many tiles, a
cached prefix or none, several chunks in one step; the fused elementwise kernels against the PyTorch ops they
replace (bitwise in bf16 for the norm and activation, within a rounding for rotary); and whole engines,
Triton against SDPA and graphs against eager steps."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rank_worker.model import fused_ops
from rank_worker.model.attention import decode_kernel, kv_quant
from rank_worker.model.attention.sdpa_backend import SdpaAttention, write_kv
from rank_worker.model.attention.triton_backend import TritonAttention
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice
from rank_worker.model.rotary import RotaryEmbedding

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not decode_kernel.available(), reason="needs CUDA and Triton")]
# FlashInfer with its FA3 module prebuilt (kvserve[cuda]; on the GPU machine bench/probes/flashinfer_check.sh's
# environment: the .fi wheels and module, FLASHINFER_DISABLE_JIT=1)
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
# flash-attn 4 (kvserve[cuda]; on the GPU machine bench/fa4_env.sh's site) on an SM90 GPU
needs_fa4 = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability()[0] != 9,
    reason="needs flash-attn 4 and an SM90 GPU",
)

BLOCK_SIZE = 16


def _pool(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    # two layers: the kernels must honour the pool's layer stride, not assume a contiguous layer
    return torch.randn(num_blocks, 2, 2, BLOCK_SIZE, kv_heads, head_dim, device="cuda").to(dtype)


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
    return table.cuda(), row_of


def _attend(backend, q, layer, batch) -> torch.Tensor:
    backend.plan(batch)
    return backend.attend(q, q, q, layer[:, 0], layer[:, 1], batch, q.shape[-1] ** -0.5)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (4, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_kernel_matches_sdpa_on_scattered_blocks(heads, kv_heads, head_dim, dtype) -> None:
    torch.manual_seed(0)
    lengths = [1, 15, 16, 17, 511, 512, 513, 1500, 3000]
    pool = _pool(500, kv_heads, head_dim, dtype)
    table, rows = _tables(lengths, 500, 16)
    q = torch.randn(len(lengths), heads, head_dim, device="cuda").to(dtype)
    dev = torch.device("cuda")
    batch = ForwardBatch(
        input_ids=torch.zeros(len(lengths), dtype=torch.long, device=dev),
        positions=torch.zeros(len(lengths), dtype=torch.long, device=dev),
        slot_blocks=torch.zeros(len(lengths), dtype=torch.long, device=dev),
        slot_offsets=torch.zeros(len(lengths), dtype=torch.long, device=dev),
        logits_indices=torch.zeros(0, dtype=torch.long, device=dev),
        block_tables=table,
        num_decodes=len(lengths),
        decode_rows=torch.tensor(rows, device=dev),
        decode_lens=torch.tensor(lengths, device=dev),
    )
    layer = pool[:, 1]
    ours = _attend(TritonAttention(dtype, heads // kv_heads), q, layer, batch)
    reference = _attend(SdpaAttention(), q, layer, batch)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(ours, reference, rtol=tolerance, atol=tolerance)


def _mixed_step(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunks=None):
    """One step: three decode rows, then chunks (new tokens, cached tokens before them) of every shape the
    scheduler makes: cold, warm over a long prefix, a chunk not starting on a tile, a 2-token chunk. Returns
    q, the step's k and v (read back from the pool, as the SDPA path wants them for cold chunks), one
    layer of the pool and the batch."""
    decodes = [33, 700, 1]
    chunks = chunks or [(300, 0), (129, 2000), (2, 77), (1000, 1000), (64, 15)]
    lengths = decodes + [new + cached for new, cached in chunks]
    pool = _pool(800, kv_heads, head_dim, dtype)
    table, rows = _tables(lengths, 800, 12)
    dev = torch.device("cuda")
    total = len(decodes) + sum(new for new, _ in chunks)
    pieces, cursor = [], len(decodes)
    for (new, cached), row in zip(chunks, rows[len(decodes) :], strict=True):
        pieces.append(PrefillSlice(cursor, new, cached + new, row))
        cursor += new
    q = torch.randn(total, heads, head_dim, device=dev).to(dtype)
    zeros = torch.zeros(total, dtype=torch.long, device=dev)
    batch = ForwardBatch(
        input_ids=zeros,
        positions=zeros,
        slot_blocks=zeros,
        slot_offsets=zeros,
        logits_indices=zeros[:0],
        block_tables=table,
        num_decodes=len(decodes),
        decode_rows=torch.tensor(rows[: len(decodes)], device=dev),
        decode_lens=torch.tensor(decodes, device=dev),
        prefills=pieces,
    )
    layer = pool[:, 0]
    k = torch.empty(total, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.empty_like(k)
    for piece in pieces:
        blocks = table[piece.table_row].long()
        tokens = torch.arange(piece.context_len - piece.num_new, piece.context_len, device=dev)
        rows_at = slice(piece.token_start, piece.token_start + piece.num_new)
        k[rows_at] = layer[:, 0][blocks[tokens // BLOCK_SIZE], tokens % BLOCK_SIZE]
        v[rows_at] = layer[:, 1][blocks[tokens // BLOCK_SIZE], tokens % BLOCK_SIZE]
    return q, k, v, layer, batch


def _relative_error_to_sdpa(backend, q, k, v, layer, batch) -> float:
    scale = q.shape[-1] ** -0.5
    backend.plan(batch)
    out = backend.attend(q, k, v, layer[:, 0], layer[:, 1], batch, scale)  # every row written anew
    sdpa = SdpaAttention()
    sdpa.plan(batch)
    reference = sdpa.attend(q, k, v, layer[:, 0], layer[:, 1], batch, scale)
    assert not out.isnan().any()
    return float((out.float() - reference.float()).norm() / reference.float().norm())


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (8, 2, 64), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pack_gqa", [True, False])
def test_prefill_kernel_matches_sdpa_with_and_without_a_prefix(heads, kv_heads, head_dim, dtype, pack_gqa) -> None:
    torch.manual_seed(1)
    q, k, v, layer, batch = _mixed_step(heads, kv_heads, head_dim, dtype)
    error = _relative_error_to_sdpa(TritonAttention(dtype, heads // kv_heads, pack_gqa), q, k, v, layer, batch)
    assert error < (1e-2 if dtype == torch.bfloat16 else 1e-5), error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_read_an_fp8_pool_as_the_sdpa_path_does(dtype) -> None:
    """kv_cache_dtype fp8_e4m3: the decode and prefill kernels cast what they load to the model's dtype, SDPA
    dequantises what it gathers, and both attend a cold chunk to its own K/V as the pool holds them."""
    torch.manual_seed(6)
    q, k, v, layer, batch = _mixed_step(8, 2, 64, dtype)
    error = _relative_error_to_sdpa(TritonAttention(dtype, 4), q, k, v, kv_quant.quantize(layer), batch)
    assert error < (1e-2 if dtype == torch.bfloat16 else 1e-5), error


def test_the_fused_store_quantises_into_an_fp8_pool_as_kv_quant_does() -> None:
    """Rotary and the store in one kernel, into an fp8 pool: the bits kv_quant.store writes (saturated at
    +-448, rounded to nearest), values past the range included."""
    torch.manual_seed(7)
    heads, kv_heads, head_dim, tokens = 8, 2, 64, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda") * 120  # some past 448
    positions = torch.arange(tokens, device="cuda")
    slot_blocks = torch.randperm(100, device="cuda")[:tokens]
    slot_offsets = torch.randint(0, BLOCK_SIZE, (tokens,), device="cuda")
    pool = torch.zeros(100, 1, 2, BLOCK_SIZE, kv_heads, head_dim, device="cuda").to(kv_quant.FP8)
    reference = pool.clone()
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    kv_quant.store(reference[:, 0, 0], slot_blocks, slot_offsets, k.reshape(tokens, kv_heads, head_dim))
    kv_quant.store(reference[:, 0, 1], slot_blocks, slot_offsets, v.reshape(tokens, kv_heads, head_dim))
    layer = pool[:, 0]
    fused_ops.rope_and_store(
        qkv.clone(), positions, None, None, slot_blocks, slot_offsets, layer[:, 0], layer[:, 1], heads, kv_heads,
        head_dim,
    )  # fmt: skip
    assert torch.equal(pool.view(torch.uint8), reference.view(torch.uint8))


@needs_flashinfer
def test_flashinfer_backend_matches_sdpa_on_a_mixed_step() -> None:
    """FA3's paged prefill for the warm chunks (and the cold one between them), ours for the decodes."""
    from rank_worker.model.attention.flashinfer_backend import FlashInferAttention

    torch.manual_seed(1)
    q, k, v, layer, batch = _mixed_step(32, 8, 128, torch.bfloat16)
    error = _relative_error_to_sdpa(FlashInferAttention(torch.bfloat16, 4), q, k, v, layer, batch)
    assert error < 1e-2, error


def test_fused_norm_and_activation_equal_the_pytorch_ops_bitwise() -> None:
    torch.manual_seed(2)
    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    expected_sum = x + residual
    expected = fused_ops.rms_norm_reference(expected_sum, weight, 1e-5)
    stream = residual.clone()
    out = fused_ops.add_rms_norm(x, stream, weight, 1e-5)
    assert torch.equal(stream, expected_sum)
    assert torch.equal(out, expected)
    assert torch.equal(fused_ops.add_rms_norm(x, None, weight, 1e-5), fused_ops.rms_norm_reference(x, weight, 1e-5))
    gate_up = torch.randn(37, 2 * 3000, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fused_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul_reference(gate_up))


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (9, 3)])
def test_fused_rotary_and_store_match_rotary_then_write_kv(heads: int, kv_heads: int) -> None:
    """Within one bf16 rounding (the H200 run of 2026-12-01 showed 1-ulp differences in some q elements: the
    compiler may keep a product in float32 that the eager op rounds); every slot the eager path writes."""
    torch.manual_seed(3)
    head_dim, tokens = 64, 50
    rotary = RotaryEmbedding(head_dim, 10000.0, None, 4096).cuda()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.randperm(4000, device="cuda")[:tokens]
    slot_blocks = torch.randperm(200, device="cuda")[:tokens]
    slot_offsets = torch.randint(0, BLOCK_SIZE, (tokens,), device="cuda")
    pool = _pool(200, kv_heads, head_dim, torch.bfloat16)
    reference_pool = pool.clone()
    q, k, v = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = rotary(positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim))
    batch = ForwardBatch(positions, positions, slot_blocks, slot_offsets, positions[:0], torch.zeros(1, 1))
    layer = reference_pool[:, 1]
    write_kv(layer[:, 0], layer[:, 1], k_ref, v.reshape(tokens, kv_heads, head_dim), batch)
    layer = pool[:, 1]
    fused_ops.rope_and_store(
        qkv, positions, rotary.cos_cache, rotary.sin_cache, slot_blocks, slot_offsets,
        layer[:, 0], layer[:, 1], heads, kv_heads, head_dim,
    )  # fmt: skip
    one_rounding = {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), q_ref, **one_rounding)
    torch.testing.assert_close(pool, reference_pool, **one_rounding)
    assert (pool != reference_pool).float().mean() < 0.01  # nearly all bitwise equal, and no slot left unwritten


def _tiny_config(tmp_path, hidden: int = 256, heads: int = 8, kv_heads: int = 2) -> str:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 512,
                "hidden_size": hidden,
                "intermediate_size": 2 * hidden,
                "num_hidden_layers": 4,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
            }
        )
    )
    return str(path)


def _tiny_float32_engine(tmp_path, **settings):
    """An engine over random float32 weights of _tiny_config's shape, 256 blocks, 256-token steps."""
    from contracts.config import KvServeConfig
    from rank_worker.engine.factory import build_engine

    config = KvServeConfig(
        model=_tiny_config(tmp_path),
        load_format="dummy",
        dtype="float32",
        num_kv_blocks=256,
        max_num_batched_tokens=256,
        **settings,
    )
    return build_engine(config)


def test_engines_with_triton_and_sdpa_and_graphs_give_the_same_tokens_in_float32(tmp_path) -> None:
    """Prompts sharing prefixes (warm chunks over cached blocks), chunked prefill (a small token budget),
    batches that shrink as rows finish; float32 so greedy tokens must agree exactly. The last engine also
    pipelines its steps (pipeline_steps: input ids taken on the device, tokens read through pinned buffers
    behind events)."""
    from engine_fixtures import generate_greedy, random_prompt

    base = random_prompt(300, 512, seed=5)
    prompts = [base[: 40 + 37 * i] + random_prompt(9 + 31 * i, 512, seed=90 + i) for i in range(13)]
    lengths = [10 + 5 * (i % 3) for i in range(13)]
    runs = {}
    for backend, graphs, pipelined in (
        ("sdpa", False, False),
        ("triton", False, False),
        ("triton", True, False),
        ("triton", True, True),
    ):
        engine = _tiny_float32_engine(
            tmp_path,
            cuda_graphs=graphs,
            attention_backend=backend,
            pipeline_steps=pipelined,  # steps launched before their predecessor is read
        )
        assert engine.attention.name == backend
        runs[(backend, graphs, pipelined)] = generate_greedy(engine, prompts, lengths)
        if graphs:
            assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.steps > 10
        assert (engine.pipelined_steps > 0) == pipelined
        assert engine.stats().prefix_hit_tokens > 0
        assert engine.stats().used_blocks == 0
    plain = runs[("sdpa", False, False)]
    assert runs[("triton", False, False)] == plain
    assert runs[("triton", True, False)] == plain
    assert runs[("triton", True, True)] == plain


def test_a_solo_prefill_gives_the_chunked_tokens_in_float32(tmp_path) -> None:
    """A 900-token prompt alone: in 256-token chunks, or in one step (solo_prefill_tokens) whose MLP runs 256
    rows at a time in the fused residual stream; the same greedy tokens, one prefill step against four."""
    from engine_fixtures import generate_greedy, random_prompt

    prompt = random_prompt(900, 512, seed=21)
    runs, prefill_steps = {}, {}
    for solo in (0, 1024):
        engine = _tiny_float32_engine(tmp_path, attention_backend="triton", solo_prefill_tokens=solo)
        assert engine.model.fused and engine.scheduler.policy.solo_prefill_tokens == solo
        schedule, steps = engine.scheduler.schedule, []

        def counted(preempt: bool = True, schedule=schedule, steps=steps):
            batch = schedule(preempt)
            steps.append(max((n for _, n in batch.entries), default=0))
            return batch

        engine.scheduler.schedule = counted
        runs[solo] = generate_greedy(engine, [prompt], [16])
        prefill_steps[solo] = sum(1 for n in steps if n > 1)
    assert runs[1024] == runs[0]
    assert prefill_steps == {0: 4, 1024: 1}


def test_fp8_engines_with_triton_and_sdpa_give_the_same_tokens_in_float32(tmp_path) -> None:
    """kv_cache_dtype fp8_e4m3: auto takes the Triton kernels (FlashInfer's module reads no fp8), graphed and
    pipelined, and gives the fp8 SDPA engine's greedy tokens; prefixes shared, prefill chunked."""
    from engine_fixtures import generate_greedy, random_prompt

    base = random_prompt(200, 512, seed=8)
    prompts = [base[: 30 + 41 * i] + random_prompt(7 + 23 * i, 512, seed=80 + i) for i in range(9)]
    lengths = [8 + 4 * (i % 3) for i in range(9)]
    runs = {}
    for backend in ("sdpa", "auto"):
        engine = _tiny_float32_engine(tmp_path, attention_backend=backend, kv_cache_dtype="fp8_e4m3")
        assert engine.kv_cache.dtype == kv_quant.FP8
        assert engine.attention.name == ("sdpa" if backend == "sdpa" else "triton")
        runs[backend] = generate_greedy(engine, prompts, lengths)
        assert engine.stats().prefix_hit_tokens > 0 and engine.stats().used_blocks == 0
        if backend == "auto":
            assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.steps > 5
            assert engine.pipelined_steps > 0
    assert runs["auto"] == runs["sdpa"]


@needs_fa4
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (8, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa4_backend_matches_sdpa_on_a_mixed_step(heads, kv_heads, head_dim, dtype) -> None:
    """FA4's paged forward for every chunk (cold ones included), ours for the decodes, over scattered blocks."""
    from rank_worker.model.attention.fa4_backend import Fa4Attention

    torch.manual_seed(1)
    q, k, v, layer, batch = _mixed_step(heads, kv_heads, head_dim, dtype)
    error = _relative_error_to_sdpa(Fa4Attention(dtype, heads // kv_heads), q, k, v, layer, batch)
    assert error < 1e-2, error


@needs_fa4
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 8, 128), (8, 2, 64)])
def test_fa4_backend_reads_a_cold_steps_own_kv(heads, kv_heads, head_dim) -> None:
    """A step whose chunks are all cold (decodes beside them) goes to FA4 over the chunks' own K/V rows, not the
    pool's pages: the plan says so, and the output matches SDPA's."""
    from rank_worker.model.attention.fa4_backend import Fa4Attention

    torch.manual_seed(3)
    q, k, v, layer, batch = _mixed_step(heads, kv_heads, head_dim, torch.bfloat16, [(300, 0), (1, 0), (2000, 0)])
    backend = Fa4Attention(torch.bfloat16, heads // kv_heads)
    backend.plan(batch)
    assert batch.attention.cold
    error = _relative_error_to_sdpa(backend, q, k, v, layer, batch)
    assert error < 1e-2, error
    # The pool's pages are not what it read: noise in the chunks' blocks leaves their output as it was.
    backend.plan(batch)  # the SDPA reference planned the batch for itself
    expected = backend.attend(q, k, v, layer[:, 0], layer[:, 1], batch, head_dim**-0.5)
    scratch = layer.clone()
    for piece in batch.prefills:
        blocks = batch.block_tables[piece.table_row, : -(-piece.context_len // BLOCK_SIZE)].long()
        scratch[blocks] = torch.randn_like(scratch[blocks])
    again = backend.attend(q, k, v, scratch[:, 0], scratch[:, 1], batch, head_dim**-0.5)
    span = slice(*batch.attention.span)
    torch.testing.assert_close(again[span], expected[span], rtol=0, atol=0)


def _fa4_compiled() -> int:
    """How many kernels flash-attn 4 has compiled in this process (all its compile caches)."""
    from flash_attn.cute import interface

    return sum(len(f.compile_cache.cache) for f in vars(interface).values() if hasattr(f, "compile_cache"))


@needs_fa4
def test_fa4_warm_up_compiles_every_variant_the_steps_need(tmp_path) -> None:
    """After the engine's start-up (Fa4Attention.warm_up over its pool), steps of other shapes compile nothing:
    a mixed step, a long chunk over a long prefix, one-token chunks, many chunks; so no request waits seconds
    for a compile while serving."""
    from rank_worker.model.attention.fa4_backend import Fa4Attention

    backend = Fa4Attention(torch.bfloat16, 4)
    pool = torch.zeros(8, 32, 2, BLOCK_SIZE, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert backend.warm_up(pool) > 0
    compiled = _fa4_compiled()
    torch.manual_seed(2)
    q, k, v, layer, batch = _mixed_step(32, 8, 128, torch.bfloat16)
    assert _relative_error_to_sdpa(backend, q, k, v, layer, batch) < 1e-2
    steps = [
        [(1, 1)],
        [(1, 5000)],
        [(4096, 9000)],
        [(7, 7)] * 20,
        [(129, 129), (1, 700), (3000, 3000)],
    ]
    dev = torch.device("cuda")
    for chunks in steps:
        lengths = [cached for _, cached in chunks]
        big = _pool(sum(-(-n // BLOCK_SIZE) for n in lengths) + 4, 8, 128, torch.bfloat16)
        table, rows = _tables(lengths, big.shape[0], len(chunks) + 2)
        pieces, cursor = [], 0
        for (new, context), row in zip(chunks, rows, strict=True):
            pieces.append(PrefillSlice(cursor, new, context, row))
            cursor += new
        zeros = torch.zeros(cursor, dtype=torch.long, device=dev)
        step = ForwardBatch(zeros, zeros, zeros, zeros, zeros[:0], table, prefills=pieces)
        backend.plan(step)
        query = torch.randn(cursor, 32, 128, device=dev, dtype=torch.bfloat16)
        out = backend.attend(query, query[:, :8], query[:, :8], big[:, 0, 0], big[:, 0, 1], step, 128**-0.5)
        assert not out.isnan().any()
    torch.cuda.synchronize()
    assert _fa4_compiled() == compiled, "a step compiled a kernel that warm_up did not"


def _bf16_engines_agree(tmp_path, backends: tuple[str, str], expected: str, around=None) -> None:
    """The same prompts (shared prefixes, chunked prefill) through bf16 engines on two backends (head_dim 128,
    the FA kernels' shape), the first taken as `expected`: the first token of every prompt and nearly every
    later one agree (bf16 roundings differ; bold weights keep argmax off ties). around(run) wraps each
    engine's run for more checks."""
    from engine_fixtures import embolden_weights, generate_greedy, random_prompt

    from contracts.config import KvServeConfig
    from rank_worker.engine.factory import build_engine

    base = random_prompt(300, 512, seed=5)
    prompts = [base[: 40 + 37 * i] + random_prompt(9 + 31 * i, 512, seed=90 + i) for i in range(13)]
    lengths = [8] * 13
    runs = []
    for index, backend in enumerate(backends):
        config = KvServeConfig(
            model=_tiny_config(tmp_path, hidden=512, heads=4, kv_heads=2),
            load_format="dummy",
            dtype="bfloat16",
            num_kv_blocks=256,
            max_num_batched_tokens=256,
            attention_backend=backend,
            pipeline_steps=index == 0,
        )
        engine = build_engine(config)
        assert engine.attention.name == (expected if index == 0 else backend)
        torch.manual_seed(3)
        embolden_weights(engine.model)

        def run(engine=engine):
            return generate_greedy(engine, prompts, lengths)

        runs.append(run() if around is None else around(run))
        assert engine.stats().prefix_hit_tokens > 0
    pairs = list(zip(*runs, strict=True))
    first = [a[0] == b[0] for a, b in pairs]
    assert sum(first) >= 12, first
    same = sum(x == y for a, b in pairs for x, y in zip(a, b, strict=True))
    assert same >= 0.8 * 13 * 8, same


@needs_fa4
def test_engines_with_fa4_and_triton_agree_in_bf16(tmp_path) -> None:
    """auto takes fa4 where it is installed on an SM90 GPU; its engine agrees with the triton one, and serving
    compiles no kernel that its start-up did not."""

    def compiles_nothing(run):
        compiled = _fa4_compiled()
        tokens = run()
        assert _fa4_compiled() == compiled
        return tokens

    _bf16_engines_agree(tmp_path, ("auto", "triton"), "fa4", compiles_nothing)


@needs_flashinfer
def test_engines_with_flashinfer_and_triton_agree_in_bf16(tmp_path) -> None:
    """FlashInfer by name (auto prefers fa4 where both are installed) against the triton backend."""
    _bf16_engines_agree(tmp_path, ("flashinfer", "triton"), "flashinfer")
