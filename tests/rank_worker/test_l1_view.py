"""A rank's view of L1 is the kvstore's: after a failover, the rank that takes a session over finds its blocks
in L1 although another rank wrote them, schedules its turn as warm (ahead of cold prefills, not under the cold
cap), and restores it with the same tokens. Two engines share one real kvstore process."""

from __future__ import annotations

import time
from pathlib import Path

from engine_fixtures import generate_one, greedy, make_engine, random_prompt
from l1_fixtures import kvstore_settings, kvstore_stats, l1_engine, tiny_model
from service_processes import free_port, start_kvstore

from contracts.block_hash import prefix_block_hashes
from contracts.kv_events import KvEvent, KvEventKind
from rank_worker.engine.interface import EngineRequest
from rank_worker.l1.l1_view import L1View

BLOCK = 16
SESSION_BLOCKS = 10


def test_the_rank_taking_a_session_over_schedules_it_warm_from_blocks_another_rank_wrote(tmp_path: Path) -> None:
    model = tiny_model()
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        first_rank = l1_engine(model, None, port, num_blocks=40, max_model_len=320)
        session = random_prompt(SESSION_BLOCKS * BLOCK + 3, 128, seed=7)
        turn1 = generate_one(first_rank, session, greedy(4), "turn-1")
        assert kvstore_stats(port).stored_slots >= SESSION_BLOCKS

        # The rank the session fails over to: an empty L0, one cold prefill at a time, small steps.
        taker = l1_engine(
            model, None, port, num_blocks=40, max_model_len=320, max_cold_prefills=1, max_num_batched_tokens=16
        )
        assert taker.l1 is not None
        turn2 = session + turn1.new_token_ids + random_prompt(3, 128, seed=8)
        hashes = prefix_block_hashes(taker.namespace, turn2[: SESSION_BLOCKS * BLOCK], BLOCK)
        deadline = time.monotonic() + 5  # the kvstore's events reach the new rank within milliseconds
        while taker.l1.known_run(hashes) < SESSION_BLOCKS:
            assert time.monotonic() < deadline, f"the new rank knows {taker.l1.known_run(hashes)} blocks in L1"
            time.sleep(0.02)

        cold = random_prompt(12 * BLOCK, 128, seed=9)  # someone else's new session: 12 steps of prefill
        taker.add_request(EngineRequest("cold", cold, greedy(2)))
        taker.step()  # the cold prefill is admitted and fills the cold cap
        taker.add_request(EngineRequest("turn-2", turn2, greedy(4)))
        first_token_at: dict[str, int] = {}
        tokens: dict[str, list[int]] = {"cold": [], "turn-2": []}
        step = 0
        while taker.has_unfinished():
            step += 1
            assert step < 1000
            # A step of the tiny model takes well under a millisecond, a real one tens: give the L1 thread's
            # lookup (an RPC to another process, slow on a loaded machine) the time real steps would.
            time.sleep(0.05)
            for out in taker.step():
                first_token_at.setdefault(out.request_id, step)
                tokens[out.request_id].extend(out.new_token_ids)

        # Warm: admitted while the cold prefill still runs (not held back by the cap), so its first token
        # comes first, and it never counted as a cold admission.
        assert first_token_at["turn-2"] < first_token_at["cold"], first_token_at
        assert taker.scheduler.cold_admissions == 1
        reference = generate_one(make_engine(model, None, prefix_cache=False), turn2, greedy(4), "ref")
        assert tokens["turn-2"] == reference.new_token_ids  # float32 on the CPU: restored KV is exact
        restored = taker.stats().l1_restored_tokens
        assert restored >= SESSION_BLOCKS * BLOCK
        first_rank.close()
        taker.close()


def test_the_view_follows_stored_removed_and_a_snapshot() -> None:
    view = L1View()
    a, b, c = (bytes([n]) * 16 for n in (1, 2, 3))
    view.apply([KvEvent(KvEventKind.STORED, (a, b, c))])
    assert view.leading_run([a, b, c]) == 3
    view.apply([KvEvent(KvEventKind.REMOVED, (b,))])
    assert view.leading_run([a, b, c]) == 1 and c in view
    # A resubscription's snapshot (a restarted kvstore) replaces everything known before.
    view.apply([KvEvent(KvEventKind.ALL_CLEARED), KvEvent(KvEventKind.STORED, (c,))])
    assert view.leading_run([a, b, c]) == 0 and view.leading_run([c]) == 1 and len(view) == 1
