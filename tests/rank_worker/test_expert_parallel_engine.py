"""Expert parallelism end to end in the engine: 2 and 4 rank processes, each with its own engine (scheduler,
KV pool, L0 cache) and its shard of a tiny DeepSeek-V2 / V3 checkpoint's routed experts, stepping together
over gloo (real torch.distributed), give every request the greedy tokens, and logits within float32
tolerance, that one rank holding every expert gives it. The ranks' steps differ as they do in serving: one
idle while another works, one in a chunked prefill while another decodes, warm turns over a cached prefix,
a rank preempting for want of blocks, and one restoring a session from L1 (a real kvstore process)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from deepseek_checkpoints import write_deepseek
from engine_fixtures import engine_settings, greedy, random_prompt
from ep_processes import run_group
from l1_fixtures import kvstore_settings
from service_processes import free_port, start_kvstore

from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.paged_engine import EngineSettings, PagedEngine

VOCAB = 96
LOGITS_ATOL = 2e-4  # float32: the experts' sums meet in another order across ranks (exchange.py)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class RankPlan:
    """One rank's requests in phases: a phase's requests go in together; the next once they have all finished."""

    phases: list[list[Request]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # EngineSettings over the defaults below
    l1: bool = False  # the engine's L1 tier talks to the test's kvstore


def _settings(**overrides: Any) -> EngineSettings:
    values: dict[str, Any] = {"num_blocks": 64, "block_size": 16, "max_model_len": 512, "max_num_batched_tokens": 32}
    values.update(overrides)
    return engine_settings(**values)


def _load(checkpoint: str, rank: int, size: int) -> tuple[torch.nn.Module, Any]:
    from rank_worker.engine.factory import build_model
    from rank_worker.expert_parallel.shard import ExpertShard
    from rank_worker.model_files.opener import open_model_source

    source = open_model_source(checkpoint)
    model = build_model(source, torch.device("cpu"), torch.float32, 512, 0, shard=ExpertShard(rank, size))
    return model, source.tokenizer


def _capture_logits(engine: PagedEngine) -> dict[str, list[torch.Tensor]]:
    """Every logits row the engine samples from, by request, in order (one per output token)."""
    captured: dict[str, list[torch.Tensor]] = {}
    runner = engine.runner
    original = runner._sampled

    def sampled(logits: torch.Tensor, seqs: list[Any], span: object) -> Any:
        for row, seq in enumerate(seqs):
            captured.setdefault(seq.request_id, []).append(logits[row].detach().clone())
        return original(logits, seqs, span)

    runner._sampled = sampled  # type: ignore[method-assign]
    return captured


async def _serve_phases(loop_: Any, plan: RankPlan) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}

    async def one(request: Request) -> None:
        stream = loop_.submit(EngineRequest(request.request_id, request.prompt, greedy(request.max_tokens)))
        got: list[int] = []
        async for output in stream:
            got.extend(output.new_token_ids)
        tokens[request.request_id] = got

    for phase in plan.phases:
        await asyncio.gather(*(one(request) for request in phase))
    return tokens


def _rank_main(group: Any, checkpoint: str, plans: list[RankPlan], kvstore_port: int) -> dict[str, Any]:
    """In each rank process: its engine in an EngineLoop (the serving path: idle ranks sleep and are woken by
    the group), its plan served, then the group stopped together once every rank is done and the group idle."""
    from rank_worker.engine_loop import EngineLoop
    from rank_worker.expert_parallel.attach import join_group

    plan = plans[group.rank]
    model, tokenizer = _load(checkpoint, group.rank, group.size)
    lockstep = join_group(model, group)
    l1_client = None
    if plan.l1:
        import uuid

        from rank_worker.l1.kvstore_link import KvStoreLink

        l1_client = KvStoreLink(f"127.0.0.1:{kvstore_port}", f"ep-rank-{group.rank}", uuid.uuid4().hex)
    engine = PagedEngine(model, _settings(**plan.settings), tokenizer, l1_client=l1_client, lockstep=lockstep)
    logits = _capture_logits(engine)
    loop_ = EngineLoop(engine)
    loop_.start()
    tokens = asyncio.run(_serve_phases(loop_, plan))
    # Stop together: once every rank is done and no rank steps (the group's last agreement said idle).
    group.announce(f"done/{group.rank}")
    for rank in range(group.size):
        assert group.wait_for(f"done/{rank}", 120.0), f"rank {rank} did not finish"
    idle = threading.Event()
    while not idle.wait(0.05):
        if not (engine.has_unfinished() or lockstep.wants_step()):
            idle.set()
    group.announce(f"idle/{group.rank}")
    for rank in range(group.size):
        assert group.wait_for(f"idle/{rank}", 60.0)
    loop_.stop()
    stats = engine.stats()
    engine.close()
    return {
        "tokens": tokens,
        "logits": {rid: torch.stack(rows) for rid, rows in logits.items()},
        "empty_steps": lockstep.empty_steps,
        "steps": lockstep.steps,
        "preemptions": stats.preemptions,
        "l1_restored_tokens": stats.l1_restored_tokens,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
    }


def _reference(checkpoint: str, requests: list[Request]) -> dict[str, tuple[list[int], torch.Tensor]]:
    """One rank holding every expert, each request alone (cold), as the outputs to match."""
    model, tokenizer = _load(checkpoint, 0, 1)
    out: dict[str, tuple[list[int], torch.Tensor]] = {}
    for request in requests:
        engine = PagedEngine(model, _settings(), tokenizer)
        logits = _capture_logits(engine)
        engine.add_request(EngineRequest(request.request_id, request.prompt, greedy(request.max_tokens)))
        tokens: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens.extend(output.new_token_ids)
        out[request.request_id] = (tokens, torch.stack(logits[request.request_id]))
    return out


def _plans(size: int) -> list[RankPlan]:
    """Rank 0: a long prompt in chunks of 32 beside a decoder, then a warm turn over the long prompt's prefix.
    Rank 1: a short decoder in the first phase, then idle. With 4: rank 2 idle throughout; rank 3 a pool of 12
    blocks for two sessions of ~100 tokens (preemption), their L1 on, then the first session's next turn,
    restored from L1 after the second took the pool."""
    long_prompt = random_prompt(150, VOCAB, 1)
    plans = [
        RankPlan(
            phases=[
                [Request("r0-long", long_prompt, 6), Request("r0-decode", random_prompt(9, VOCAB, 2), 24)],
                [Request("r0-warm", long_prompt + random_prompt(20, VOCAB, 3), 6)],
            ]
        ),
        RankPlan(phases=[[Request("r1-decode", random_prompt(12, VOCAB, 4), 8)]]),
    ]
    if size == 4:
        first = random_prompt(90, VOCAB, 5)
        second = random_prompt(90, VOCAB, 6)
        plans += [
            RankPlan(),
            RankPlan(
                phases=[
                    [Request("r3-a", first, 30), Request("r3-b", random_prompt(95, VOCAB, 7), 30)],
                    [Request("r3-c", second, 8)],
                    [Request("r3-a2", first + random_prompt(10, VOCAB, 8), 8)],
                ],
                settings={"num_blocks": 12},
                l1=True,
            ),
        ]
    return plans


@pytest.mark.parametrize(("model_type", "size"), [("deepseek_v2", 2), ("deepseek_v3", 4)])
def test_expert_parallel_group_matches_one_rank_holding_every_expert(
    tmp_path: Path, model_type: str, size: int
) -> None:
    checkpoint = tmp_path / model_type
    write_deepseek(model_type, checkpoint)
    plans = _plans(size)
    kvstore_port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", kvstore_port, **kvstore_settings(tmp_path)):
        results = run_group(_rank_main, size, str(checkpoint), plans, kvstore_port)
    requests = [request for plan in plans for phase in plan.phases for request in phase]
    reference = _reference(str(checkpoint), requests)
    for rank, (plan, result) in enumerate(zip(plans, results, strict=True)):
        for phase in plan.phases:
            for request in phase:
                want_tokens, want_logits = reference[request.request_id]
                got_logits = result["logits"][request.request_id]
                assert result["tokens"][request.request_id] == want_tokens, (rank, request.request_id)
                assert len(want_tokens) == request.max_tokens
                assert got_logits.shape == want_logits.shape, (rank, request.request_id)
                torch.testing.assert_close(got_logits, want_logits, atol=LOGITS_ATOL, rtol=1e-4)
    # Every rank made the same agreements; the idle ones ran empty steps for the others' work.
    assert len({result["steps"] for result in results}) == 1
    assert results[1]["empty_steps"] > 0  # idle in rank 0's second phase
    assert results[0]["prefix_hit_tokens"] >= 144  # the warm turn over the long prompt's cached blocks
    if size == 4:
        assert results[2]["empty_steps"] > 0  # never had work of its own, stepped for the others
        assert results[3]["preemptions"] > 0
        assert results[3]["l1_restored_tokens"] > 0
