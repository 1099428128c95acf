"""Solo prefills: a prompt with nothing cached, admitted when nothing else runs on the rank, goes in one step up to
solo_prefill_tokens (past max_num_batched_tokens), and only then: not beside decoders, not over a cached prefix,
not behind a warm request admitted first, not past the cap, and in chunks again when its blocks are short. The
engine gives the same greedy tokens as in chunks, its MLP running max_num_batched_tokens rows at a time; the
setting resolves to the attention backend's preference when unset."""

from __future__ import annotations

import torch
from engine_fixtures import engine_settings, greedy, make_engine, random_prompt, run_to_completion
from l1_fixtures import tiny_model
from scheduler_fixtures import advance, chunk_of, queue_request

from contracts.config import SchedulingConfig
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.paged_engine import solo_prefill_tokens
from rank_worker.engine.scheduler import ScheduledBatch, Scheduler
from rank_worker.model.attention.fa4_backend import Fa4Attention
from rank_worker.model.attention.sdpa_backend import SdpaAttention
from rank_worker.model.residual_stream import mlp_by_rows

BLOCK = 16
VOCAB = 128
BUDGET = 1024  # max_num_batched_tokens
SOLO = 4096


def _scheduler(solo: int = SOLO, blocks: int = 2000, budget_ms: float = 50.0) -> Scheduler:
    kv = KvCacheManager(BlockPool(blocks, caching=True), BLOCK, b"solo-prefill-test")
    policy = SchedulingConfig(scheduling_policy="warm_first", decode_step_budget_ms=budget_ms, solo_prefill_tokens=solo)
    return Scheduler(kv, 64, BUDGET, policy)


def test_a_cold_prompt_alone_goes_in_one_step_and_the_next_waits() -> None:
    sched = _scheduler()
    cold = queue_request(sched, "cold", random_prompt(3000, VOCAB, seed=1))
    other = queue_request(sched, "other", random_prompt(3500, VOCAB, seed=2))  # longer: cold work goes shortest first
    batch = sched.schedule()
    assert batch.entries == [(cold, 3000)]
    assert chunk_of(batch, other) == 0  # the solo step carries nothing else
    advance(sched, batch)
    assert chunk_of(sched.schedule(), other) > 0  # admitted beside the decoder afterwards, in chunks


def test_the_cap_holds_and_what_is_left_goes_in_chunks() -> None:
    sched = _scheduler()
    cold = queue_request(sched, "cold", random_prompt(6000, VOCAB, seed=3))
    first = sched.schedule()
    assert chunk_of(first, cold) == SOLO
    advance(sched, first)
    assert chunk_of(sched.schedule(), cold) == BUDGET  # no longer cold from token 0: a chunk over its prefix


def test_not_beside_decoders_nor_over_a_cached_prefix() -> None:
    sched = _scheduler(budget_ms=0.0)  # no time cut: a chunk is then max_num_batched_tokens less the decodes
    decoder = queue_request(sched, "decoder", random_prompt(100, VOCAB, seed=4))
    advance(sched, sched.schedule())
    assert decoder.num_uncomputed_tokens == 1
    cold = queue_request(sched, "cold", random_prompt(3000, VOCAB, seed=5))
    assert chunk_of(sched.schedule(), cold) == BUDGET - 1

    sched = _scheduler()
    history = random_prompt(320, VOCAB, seed=6)
    first = queue_request(sched, "history", history)
    advance(sched, sched.schedule())
    sched.remove(first)  # a finished turn: its blocks stay as cache entries
    turn = queue_request(sched, "turn", history + random_prompt(2700, VOCAB, seed=7))
    batch = sched.schedule()
    assert turn.num_l0_cached_tokens == 320
    assert chunk_of(batch, turn) == BUDGET


def test_a_warm_request_admitted_first_keeps_the_cold_one_in_chunks() -> None:
    sched = _scheduler()
    history = random_prompt(320, VOCAB, seed=8)
    first = queue_request(sched, "history", history)
    advance(sched, sched.schedule())
    sched.remove(first)
    cold = queue_request(sched, "cold", random_prompt(3000, VOCAB, seed=9))
    warm = queue_request(sched, "warm", history + random_prompt(32, VOCAB, seed=10))
    batch = sched.schedule()
    assert chunk_of(batch, warm) == 32 and chunk_of(batch, cold) == BUDGET - 32


def test_in_chunks_when_the_pool_cannot_hold_the_solo_step() -> None:
    sched = _scheduler(blocks=100)  # 1,600 tokens: the 3,000-token prompt's whole blocks do not fit at once
    cold = queue_request(sched, "cold", random_prompt(3000, VOCAB, seed=11))
    assert chunk_of(sched.schedule(), cold) == BUDGET


def test_off_at_zero_and_when_the_cap_is_within_the_token_budget() -> None:
    for solo in (0, BUDGET // 2):
        sched = _scheduler(solo=solo)
        cold = queue_request(sched, "cold", random_prompt(3000, VOCAB, seed=12))
        assert chunk_of(sched.schedule(), cold) == BUDGET


def test_the_setting_resolves_to_the_backends_choice_within_max_model_len() -> None:
    def resolved(backend: object, **settings: object) -> int:
        values: dict[str, object] = {"num_blocks": 1, "max_model_len": 200_000, "max_num_batched_tokens": 32768}
        values.update(settings)
        return solo_prefill_tokens(engine_settings(**values), backend)  # type: ignore[arg-type]

    fa4 = Fa4Attention(torch.bfloat16, group=4)  # no CUDA needed to build it: attributes only
    assert resolved(fa4) == Fa4Attention.solo_prefill_tokens == 131072
    assert resolved(fa4, max_model_len=104_160) == 104_160
    assert resolved(fa4, solo_prefill_tokens=0) == 0
    assert resolved(fa4, max_model_len=16_384) == 0  # never past max_num_batched_tokens: nothing to do
    assert resolved(SdpaAttention()) == 0
    assert resolved(SdpaAttention(), solo_prefill_tokens=65536) == 65536


def test_the_mlp_by_rows_is_the_mlp() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.SiLU(), torch.nn.Linear(24, 8))
    h = torch.randn(70, 8)
    with torch.no_grad():
        whole = layer(h)
        pieces = mlp_by_rows(layer, h, 16)
        assert torch.allclose(pieces, whole, rtol=0, atol=1e-6)  # a GEMM's rounding may depend on its rows
        assert torch.equal(pieces[64:], layer(h[64:]))  # the last piece: those rows alone
        assert torch.equal(mlp_by_rows(layer, h, 0), whole)
        assert torch.equal(mlp_by_rows(layer, h, 70), whole)


def test_the_engine_gives_the_chunked_tokens_with_its_mlp_in_pieces() -> None:
    model = tiny_model()
    prompt = random_prompt(300, VOCAB, seed=13)
    outputs, chunks, rows = {}, {}, {}
    for solo in (0, 512):
        engine = make_engine(
            model, max_model_len=512, max_num_batched_tokens=64, solo_prefill_tokens=solo, pipeline_steps=False
        )
        assert engine.scheduler.policy.solo_prefill_tokens == solo
        seen: list[int] = []
        steps: list[int] = []
        hook = model.layers[0].mlp.register_forward_hook(lambda _m, args, _out, seen=seen: seen.append(len(args[0])))
        schedule = engine.scheduler.schedule

        def counted(preempt: bool = True, schedule=schedule, steps=steps) -> ScheduledBatch:
            batch = schedule(preempt)
            steps.append(max((n for _, n in batch.entries), default=0))
            return batch

        engine.scheduler.schedule = counted  # type: ignore[method-assign]
        engine.add_request(EngineRequest("r", list(prompt), greedy(12)))
        outputs[solo] = run_to_completion(engine)["r"].new_token_ids
        hook.remove()
        chunks[solo] = [n for n in steps if n > 1]
        rows[solo] = seen[:5]
    assert outputs[512] == outputs[0]
    assert chunks == {0: [64, 64, 64, 64, 44], 512: [300]}  # five chunks, or one step
    assert rows[512] == [64, 64, 64, 64, 44]  # the solo step's MLP, max_num_batched_tokens rows at a time
    assert rows[0] == [64, 64, 64, 64, 44]  # the chunks' own
