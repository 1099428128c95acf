"""CPU probe: agents of growing sessions through the real engine (a tiny random model) and its L1 tier against a
real kvstore process, past the L0 pool: the share of the reusable prefix (the previous turn's context) that
comes back from L0 or L1, per request. The simulator's host tier answers a restore at once; the real one a step
or more later, and this probe shows what that gap costs (2026-12-06: a lookup's L0 prefix evicted meanwhile
dropped the whole restore; bench/results/2026-12-06-h100-peer-llama-8b-past-pool/README.md).

    python bench/probes/l1_agents_cpu.py --agents 24 --l1 4096 --json out.json

Scaled down from llama-8b on an H100 (25,800 blocks of L0, 32,768 of L1, 32 agents, 32,768 tokens a step):
400 blocks of L0, 64 blocks of eviction horizon, 4 blocks of write-through a step, 512 tokens a step, 100 steps of
think time between an agent's turns."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests", ROOT / "tests" / "rank_worker"):
    sys.path.insert(0, str(path))

from l1_fixtures import TINY_MODEL, l1_engine, tiny_model  # noqa: E402
from service_processes import free_port, start_kvstore  # noqa: E402

from loadgen.provenance import checkout_record  # noqa: E402
from rank_worker.engine.interface import EngineRequest, SamplingParams  # noqa: E402

BLOCK = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=24)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--l0", type=int, default=400, help="L0 pool blocks")
    ap.add_argument("--l1", type=int, default=512, help="L1 arena slots")
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--horizon", type=int, default=64, help="l1_eviction_horizon_blocks")
    ap.add_argument("--offload-blocks", type=int, default=4, help="write-through blocks a step")
    ap.add_argument("--think", type=int, default=100, help="engine steps between an agent's turns")
    ap.add_argument(
        "--turn-tokens",
        default="5,30",
        metavar="LO,HI",
        help="new tokens a turn adds, drawn from LO..HI (with larger ones a session's restore can outgrow the horizon: "
        "on the H100 one 80K-token restore allocated 5,000 blocks against a 4,096-block horizon)",
    )
    ap.add_argument("--max-context", type=int, default=512, help="the engine's max_model_len")
    ap.add_argument(
        "--write-through",
        choices=["always", "while_room"],
        default=None,
        help="l1_write_through (unset: the engine's default)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--together",
        action="store_true",
        help="every agent's first turn at step 0: the turns come in bursts, as on the GPU (bench/results/"
        "2026-12-06-h100-peer-llama-8b-l1-80); default: first turns spread over 50 steps",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kvstore-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kvstore setting (an A/B of its eviction switches), e.g. KVSERVE_L1_EVICT_WRITTEN_THROUGH_FIRST=true",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    turn_lo, turn_hi = (int(n) for n in args.turn_tokens.split(","))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 127) for _ in range(n)]

    # A tiny-model block: its layers x K,V x 16 tokens x kv heads x head dims x 4 bytes (float32)
    m = TINY_MODEL
    slot_bytes = m["num_hidden_layers"] * 2 * BLOCK * m["num_key_value_heads"] * m["head_dim"] * 4
    arena = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    env = {
        "KVSERVE_L1_HOST_GB": str(args.l1 * slot_bytes / 1e9),
        "KVSERVE_L1_ARENA_DIR": str(arena),
        "KVSERVE_L1_HEADROOM_GB": "0",
        **dict(setting.split("=", 1) for setting in args.kvstore_set),
    }
    port = free_port()
    with start_kvstore(Path(f"/tmp/l1-agents-probe-{port}.log"), port, **env):
        engine = l1_engine(
            tiny_model(max_positions=args.max_context),
            None,
            port,
            num_blocks=args.l0,
            max_model_len=args.max_context,
            max_num_seqs=128,
            max_num_batched_tokens=args.budget,
            l1_eviction_horizon_blocks=args.horizon,
            l1_offload_mb_per_step=args.offload_blocks * slot_bytes / (1 << 20),
            **({"l1_write_through": args.write_through} if args.write_through else {}),
        )
        assert engine.l1 is not None and engine.l1.slot_bytes == slot_bytes, "the tiny model's block size changed"
        agents = [
            # (the first turn's step is drawn either way: --together changes nothing else of the sessions)
            {
                "context": tokens(rng.randint(40, 150)),
                "turn": 0,
                "ready": rng.randint(0, 50) * (not args.together),
                "busy": False,
            }
            for _ in range(args.agents)
        ]
        in_flight: dict[str, tuple[dict, list[int], int]] = {}
        outputs: dict[str, list[int]] = {}
        reusable = reused = from_l1 = lost = 0
        tiers: list[tuple[int, int, int]] = []  # every 20 steps: L0's cache entries, L1's blocks, blocks in both
        step = requests = 0
        while in_flight or any(a["turn"] < args.turns for a in agents):
            for agent in agents:
                if agent["busy"] or agent["turn"] >= args.turns or step < agent["ready"]:
                    continue
                prompt = agent["context"] + (tokens(rng.randint(turn_lo, turn_hi)) if agent["turn"] else [])
                # the previous turn's full blocks, short of the last prompt token (always computed)
                full = min(len(agent["context"]) // BLOCK, (len(prompt) - 1) // BLOCK)
                optimum = full * BLOCK if agent["turn"] else 0
                request_id = f"r{requests}"
                requests += 1
                in_flight[request_id] = (agent, prompt, optimum)
                engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
                agent["busy"] = True
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if not out.finished:
                    continue
                agent, prompt, optimum = in_flight.pop(out.request_id)
                cached = out.stats.l0_cached_tokens + out.stats.l1_cached_tokens
                reusable += optimum
                reused += min(cached, optimum)
                from_l1 += out.stats.l1_cached_tokens
                lost += cached < optimum - BLOCK
                agent["context"] = prompt + outputs.pop(out.request_id)
                agent["turn"] += 1
                agent["busy"] = False
                agent["ready"] = step + args.think
            if step % 20 == 0:
                l0_hashes, l1_view = engine.pool.cached_hashes(), engine.l1.view
                tiers.append((len(l0_hashes), len(l1_view), sum(1 for h in l0_hashes if h in l1_view)))
            step += 1
        stats = engine.stats()
        engine.close()
    result = {
        **checkout_record(),
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "steps": step,
        "requests": requests,
        "final_context_blocks": sum(len(a["context"]) for a in agents) // BLOCK,
        "largest_context_blocks": max(len(a["context"]) for a in agents) // BLOCK,
        "reused_of_optimum": round(reused / max(reusable, 1), 4),
        "l1_share_of_optimum": round(from_l1 / max(reusable, 1), 4),
        "requests_short_by_more_than_a_block": lost,
        "l1_room_waits": stats.l1_room_waits,
        "l1_offloaded_blocks": stats.l1_offloaded_blocks,
        "l0_evicted_blocks": stats.l0_evicted_blocks,
        "l0_evicted_unsaved_blocks": stats.l0_evicted_unsaved_blocks,
        "l0_evicted_unsaved_in_flight_blocks": stats.l0_evicted_unsaved_in_flight_blocks,
        "l0_evicted_unsaved_unoffered_blocks": stats.l0_evicted_unsaved_unoffered_blocks,
        "l0_evicted_unsaved_past_held_blocks": stats.l0_evicted_unsaved_past_held_blocks,
        "l1_fetch_timeouts": stats.l1_fetch_timeouts,
        "l1_restore_missing_blocks": stats.l1_restore_missing_blocks,
        "l1_restore_room_cut_blocks": stats.l1_restore_room_cut_blocks,
        "l1_restore_unstarted_blocks": stats.l1_restore_unstarted_blocks,
        "l1_offer_refused_blocks": stats.l1_offer_refused_blocks,
        # over the run's second half: how far the tiers hold the same blocks (L1 a copy of L0 adds little to it)
        "second_half_mean_l0_l1_both": [
            round(sum(sample[i] for sample in tiers[len(tiers) // 2 :]) / max(1, len(tiers) - len(tiers) // 2), 1)
            for i in range(3)
        ],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
