"""One engine rank in the simulator: the REAL Scheduler, KvCacheManager and BlockPool of rank_worker/engine, with
a model runner that computes nothing and instead says how long the step took on the GPU (step_time.py).

step() follows PagedEngine.step: schedule, advance every scheduled sequence by its tokens, register full
blocks, append a token to each sequence that reached its end (a made-up id: outputs are never reused, as
in the load generator, whose next turn is the trace's content), write through to L1 at the first output
(and offer L1 the entries L0 evicts next, rank_worker/l1/eviction_horizon.py),
finish at max_tokens or max_model_len. Output lengths come from the trace (ignore_eos). As the engine measures
its steps, the scheduler's step-cost model is told each step's modelled time, so its decode time budget
(decode_step_budget_ms) cuts prefill chunks as it would on the GPU the step-time model was fitted to.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from contracts.config import EngineConfig, SchedulingConfig
from contracts.kv_events import KvEvent
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.scheduler import Scheduler
from rank_worker.engine.sequence import Sequence, SequenceStatus
from rank_worker.l1.eviction_horizon import horizon_blocks_for
from rank_worker.l1.slot_reserve import reserved_slots_for
from simulator.host_cache import NodeHostCache, RankHostTier
from simulator.step_time import StepTimeModel

# The engine keys a simulated rank runs by; the others (kernels, pool sizing) are the step-time model's and
# num_blocks'.
SIMULATED_ENGINE_KEYS = frozenset(
    {
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "l1_eviction_horizon_blocks",
        "l1_write_through",
        "l1_refresh_finished",
        "l1_offload_mb_per_step",
        "l1_reserved_slots",
    }
)


def _engine_benchmark_chunk() -> EngineConfig:
    return EngineConfig(max_num_batched_tokens=32768)  # the engine benchmark's chunk, where none is given


@dataclass(frozen=True)
class RankSettings:
    num_blocks: int
    max_model_len: int = 131072
    engine: EngineConfig = field(default_factory=_engine_benchmark_chunk)  # the config's section, as a rank's
    policy: SchedulingConfig = field(default_factory=SchedulingConfig)  # the config's section, as a rank's
    kv_bytes_per_token: int = 131072  # for the time an L1 restore takes
    l1_bytes_per_s: float = 50e9
    # write-through copies paced as the real tier's (l1_offload_mb_per_step a step, their blocks pinned in the pool
    # until they land), where False lands each at once, pinning nothing
    l1_paced_copies: bool = False
    l1_copy_latency_s: float = 0.0  # paced: from a copy's issue to its landing (0: by the next step)
    # exclusive tiers as an upper bound: L1 takes what L0 evicts as it evicts it, nothing written through
    l1_exclusive_ideal: bool = False
    # with it: the copies of what L0 evicts charged to the step that evicts them at this rate (bytes/s), as if none
    # overlapped the step before (a bound from below); None: free (the bound from above)
    l1_exclusive_copy_bytes_per_s: float | None = None

    @property
    def block_bytes(self) -> int:
        """One KV block's bytes: what a block copy to or from L1 moves."""
        return self.kv_bytes_per_token * self.engine.block_size

    @property
    def offload_blocks_per_step(self) -> int | None:
        """The real tier's pace in blocks, when copies are paced."""
        if not self.l1_paced_copies:
            return None
        return max(1, self.engine.l1_offload_bytes_per_step // self.block_bytes)

    def to_json(self) -> dict[str, Any]:
        """The rank as results record it: its own fields and the engine keys it runs by (its policy apart)."""
        own = {item.name: getattr(self, item.name) for item in fields(self) if item.name not in ("engine", "policy")}
        return {**own, **self.engine.model_dump(include=SIMULATED_ENGINE_KEYS)}


@dataclass
class StepOutcome:
    start: float
    end: float
    first_tokens: list[Sequence]  # sequences whose first output came in this step
    finished: list[Sequence]
    events: list[KvEvent]  # the pool's KV events of this step (for the router's prefix index)


class ReplayRank(Protocol):
    """What the replay and the simulated router need of a rank."""

    rank_id: str
    settings: RankSettings
    scheduler: Scheduler
    kv: KvCacheManager
    busy_until: float
    busy_s: float
    steps: int

    @property
    def has_work(self) -> bool: ...

    def add(self, seq: Sequence, now: float) -> None: ...

    def step(self, now: float) -> StepOutcome: ...


class SimulatedRank:
    def __init__(
        self,
        rank_id: str,
        settings: RankSettings,
        namespace: bytes,
        step_time: StepTimeModel,
        clock: Callable[[], float],
        node_cache: NodeHostCache | None = None,
    ) -> None:
        self.rank_id = rank_id
        self.settings = settings
        self.step_time = step_time
        self.pool = BlockPool(settings.num_blocks, caching=True)
        engine = settings.engine
        horizon = horizon_blocks_for(
            engine.l1_eviction_horizon_blocks, engine.max_num_batched_tokens, engine.block_size
        )
        self.tier = (
            RankHostTier(
                node_cache,
                self.pool,
                horizon,
                engine.l1_write_through == "while_room",
                refresh_finished=engine.l1_refresh_finished,
                offload_blocks_per_step=settings.offload_blocks_per_step,
                copy_latency_s=settings.l1_copy_latency_s,
                exclusive_ideal=settings.l1_exclusive_ideal,
                save_evicted=engine.l1_write_through == "on_evict",
                reserved_slots=reserved_slots_for(
                    engine.l1_reserved_slots, engine.max_num_batched_tokens, engine.block_size
                ),
            )
            if node_cache is not None
            else None
        )
        self.kv = KvCacheManager(self.pool, engine.block_size, namespace, self.tier)
        self.scheduler = Scheduler(
            self.kv, engine.max_num_seqs, engine.max_num_batched_tokens, settings.policy, clock=clock
        )
        self.busy_until = 0.0  # the simulated time its current step ends
        self.steps = 0
        self.busy_s = 0.0
        self._output_ids = itertools.count(-1, -1)  # negative: never a prompt token

    @property
    def has_work(self) -> bool:
        # copies on their way keep the real engine stepping (L1Tier.has_pending): they hold pool blocks
        return self.scheduler.has_work() or (self.tier is not None and self.tier.has_pending)

    def add(self, seq: Sequence, now: float) -> None:
        if not self.has_work:
            self.busy_until = max(self.busy_until, now)  # an idle rank starts when work arrives
        self.scheduler.add(seq)

    def _eviction_copy_bytes_per_s(self) -> float:
        """Exclusive tiers' copies, in the way of the step that evicts: at the given rate, else free for the ideal
        (the bound from above) and at the host link's measured rate for l1_write_through on_evict, as the real tier
        queues them on the compute stream."""
        rate = self.settings.l1_exclusive_copy_bytes_per_s
        if rate:
            return rate
        return float("inf") if self.settings.l1_exclusive_ideal else self.settings.l1_bytes_per_s

    def step(self, now: float) -> StepOutcome:
        if self.tier is not None:
            self.tier.poll(now)  # the copies issued by now have landed
        restored_before = self.scheduler.restored_tokens
        copies_before = self.tier.eviction_copies if self.tier is not None else 0
        batch = self.scheduler.schedule()
        # exclusive tiers with a copy rate: the evictions this step's allocations made, copied before it runs
        eviction_copies = (self.tier.eviction_copies - copies_before) if self.tier is not None else 0
        prefills: list[tuple[int, int]] = []
        decodes: list[int] = []
        for seq, num_new in batch.entries:
            if num_new > 1:
                prefills.append((num_new, seq.num_computed_tokens))
            else:  # a 1-token chunk runs as a decode in the model runner too
                decodes.append(seq.num_computed_tokens + 1)
        restored = self.scheduler.restored_tokens - restored_before
        duration = self.step_time.step_s(prefills, decodes) if batch.entries else 0.0
        if batch.entries:
            self.scheduler.observe_step(batch.load, duration)  # the model's run: the restore below is not part of it
        duration += restored * self.settings.kv_bytes_per_token / self.settings.l1_bytes_per_s
        if eviction_copies:
            duration += eviction_copies * self.settings.block_bytes / self._eviction_copy_bytes_per_s()
        end = now + duration
        outcome = StepOutcome(start=now, end=end, first_tokens=[], finished=[], events=[])
        for seq, num_new in batch.entries:
            seq.num_computed_tokens += num_new
            self.kv.register_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that is not the prompt's last
            seq.token_ids.append(next(self._output_ids))
            if seq.first_token_time is None:
                seq.first_token_time = end
                outcome.first_tokens.append(seq)
            if seq.num_output_tokens == 1:
                self.kv.offload(seq)
            if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.settings.max_model_len:
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.FINISHED
                seq.finish_time = end
                outcome.finished.append(seq)
        if self.tier is not None:
            # after the step's launch, as the real engine: the horizon's pass and this step's copies, off its
            # critical path (no step time), but an idle rank's step is those copies (the real one waits for them)
            issued = self.tier.pump(now)
            if not batch.entries:
                end += issued * self.settings.block_bytes / self.settings.l1_bytes_per_s
                landing = self.tier.next_landing
                if landing is not None and not issued:
                    end = max(end, landing)  # nothing to run: wait for the oldest copy, as the real engine
                outcome.end = end
                duration = end - now
        copying = self.tier is not None and self.tier.has_pending  # the pool blocks they hold come back
        if not batch.entries and not batch.preempted and self.scheduler.has_work() and not copying:
            raise RuntimeError(
                f"rank {self.rank_id} is stuck: {len(self.scheduler.waiting)} waiting requests and none fits "
                f"the {self.settings.num_blocks}-block pool"
            )
        outcome.events = self.pool.drain_events()
        self.busy_until = end
        self.steps += 1
        self.busy_s += duration
        return outcome
