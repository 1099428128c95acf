"""Who runs in the next step: continuous batching under a token budget, with chunked prefill.

Every running sequence asks for its uncomputed tokens (1 when decoding, a chunk of the rest of its
prompt when prefilling); running sequences go first, then waiting ones are admitted while the budget,
max_num_seqs and free blocks allow. When blocks run out, the last running sequence in this step's order is
preempted (its blocks released, cached ones kept as cache entries) and requeued at the front, so it
resumes from its cached prefix later.

max_num_seqs bounds the sequences holding a block-table row: the running ones and those ending in a step still
on the device (end(): a pipelined successor is scheduled before that step is read, and their rows go back only
then), so the model runner's rows are never all taken whatever a burst ends at once.

Two policies:
- fifo: running sequences oldest first, then waiting ones in arrival order.
- warm_first: a waiting request whose cached prefix (L0, plus what the host tier is known to hold) covers
  warm_prefix_fraction of its prompt is warm. Each step gives its token budget to running decodes and warm
  prefills, then to waiting warm requests (each group in arrival order), then to cold work shortest first:
  running cold prefills by what they have left and waiting cold requests by their uncached tokens, in one
  order. So a warm turn (a few new tokens over a long cached context) never waits behind someone else's
  100K-token prefill, and neither does a 15K-token cold prompt (a new session, a subagent) behind the rest of a
  400K-token one, which it delays by its own few seconds at most. At most max_cold_prefills cold requests
  are admitted into prefill at once (0 = no cap; a sequence counts from admission until its prefill
  completes). A cold request or prefill that has gone cold_max_wait_secs without a token (waiting since its
  arrival, or held back since its last chunk) is starved from then on: waiting, it is admitted with the warm
  requests (not held back by the cap); running, it leads the cold work and its chunk, up to
  min_prefill_chunk_tokens, is set aside before the warm work takes the budget. So a steady stream of warm or
  shorter work cannot starve it, and a starved 400K-token prefill still does not hold every warm turn behind
  its minutes of chunks. Time spent being prefilled is not waiting. Preempted sequences keep their place at
  the front of the queue; when blocks run out, cold prefills are preempted first, the one with the most left
  first.

A request whose context the host tier holds past its L0 prefix is restored whole or waits (both policies):
when the free pool cannot take all of it beside its next chunk while other sequences run, admission waits for
them to give blocks back, up to cold_max_wait_secs; restoring in part would have the rest computed again
(kv_cache_manager.restore_waits_for_room). While its lookup is under way (a step or two), admissions and prefill
chunks leave free the blocks the answer will take (kv_cache_manager.reserved_blocks): taken meanwhile, the answer
would find no room and cut the restore.

Decoders are not stalled by prefill (both policies): while running sequences are decoding, a step's prefill
tokens are capped so that the step's predicted time (step_cost.py, fitted to the steps the engine measured)
stays within decode_step_budget_ms, each chunk cut to a whole number of blocks; the chunks go in the policy's
order (warm ones first under warm_first), and each step still gets min_prefill_chunk_tokens of prefill, so a
prefill is never starved by decoders whose own steps fill the budget. With nobody decoding (or a budget of 0)
prefill takes the whole max_num_batched_tokens, as one long step stalls no one.

Paying back an overrun (decode_payback, on by default): over a long context, or beside many decoders past the
pool, even min_prefill_chunk_tokens can take more than a budget (DeepSeek-V2-Lite on the H200: 1-1.5K tokens
over 250-400K cached took 80-270 ms a step, so 4 agents' decoders got a token per such step). With the option
on, the time a step carrying prefill beside decoders measured past the budget is owed to the decoders, and the
next steps decode only (no prefill, no admission) until what they leave of their budget has paid it back: the
decoders average about one token a budget (so the budget must sit under the rate they need, with room for the
gaps between steps), the prefill runs a little slower.

A solo prefill: a prompt with nothing cached, admitted when nothing else runs on the rank, is taken in one step
up to solo_prefill_tokens (past max_num_batched_tokens; that step carries nothing else), where the attention
backend reads a whole cold prompt faster than chunks over their predecessors' pages (Fa4Attention). Nobody
decodes beside it, and a warm request already waiting is admitted first (it is not alone then); one arriving
during it waits for the step, as for any step.

The load the rank reports (prefill_load) is prefill still to do: for each waiting request its prompt tokens
not in L0 (those the host tier is known to hold at l1_restore_cost each), for each running one still in
prefill what is left of it. It is the unit of the router's own estimate and score, so the two add up.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from contracts.config import SchedulingConfig
from rank_worker.engine.kv_cache_manager import KvCacheManager
from rank_worker.engine.sequence import Sequence, SequenceStatus
from rank_worker.engine.step_cost import StepCostModel, StepLoad

# How long a computed prefill load is reused (a load signal, heard once a heartbeat).
LOAD_REFRESH_S = 0.5


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)
    preempted: list[Sequence] = field(default_factory=list)
    # Running sequences left out for want of blocks, where preempting was not allowed (schedule(preempt=False)).
    skipped: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    @property
    def load(self) -> StepLoad:
        """What the step carries, for the step-cost model (read before the step advances its sequences)."""
        return step_load(self.entries)


def payback(overrun_s: float, load: StepLoad, seconds: float, budget_s: float) -> float:
    """What decoders are still owed after a step of `seconds` carrying `load`: a step with prefill beside
    decoders adds its time past the budget; a decode-only step pays back what it leaves of the budget, and one
    that fills the budget by itself clears the debt (decoders cannot go faster, and prefill must not starve)."""
    if load.decode_rows == 0:
        return overrun_s
    if load.prefill_tokens > 0:
        return overrun_s + max(0.0, seconds - budget_s)
    if seconds >= budget_s:
        return 0.0
    owed = overrun_s - (budget_s - seconds)
    return owed if owed > 1e-6 else 0.0  # a microsecond's rounding is not worth a step


def step_load(entries: Iterable[tuple[Sequence, int]], load: StepLoad = StepLoad()) -> StepLoad:
    """`load` plus these (sequence, tokens to compute) entries: a 1-token entry is a decoding row (the model
    runner runs it as one), longer ones prefill chunks over the sequence's computed tokens."""
    rows, kv, tokens, attention = load.decode_rows, load.decode_kv_tokens, load.prefill_tokens, load.prefill_attention
    for seq, num_new in entries:
        cached = seq.num_computed_tokens
        if num_new == 1:
            rows += 1
            kv += cached + 1
        else:
            tokens += num_new
            attention += num_new * (cached + num_new / 2)
    return StepLoad(rows, kv, tokens, attention)


@dataclass(frozen=True)
class PrefillLoad:
    """Prefill still to do on the rank, in prompt tokens to compute (as the router scores a request)."""

    tokens: int  # waiting requests' uncached prompt tokens, plus what partially prefilled ones have left
    warm_tokens: int  # the part of it a newly arrived warm request waits for


@dataclass
class _Step:
    """What one call of schedule() carries between its phases."""

    budget: int
    now: float
    batch: ScheduledBatch = field(default_factory=ScheduledBatch)
    cold_in_prefill: int = 0
    closed: bool = False  # no more admissions this step
    preempt: bool = True  # False: a running sequence that gets no blocks sits this step out instead
    time_budget_s: float | None = None  # what the step may take, while sequences are decoding (None: no cap)
    decode_only: bool = False  # paying back an overrun: no prefill tokens, nobody admitted
    # What it carries so far (kept under a time budget only): its decodes from the start, then each prefill chunk.
    load: StepLoad = field(default_factory=StepLoad)


class Scheduler:
    def __init__(
        self,
        kv: KvCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulingConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        step_cost: StepCostModel | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The config's scheduling section, with what the engine resolved for its device and attention backend
        # (decode_step_budget_ms, solo_prefill_tokens); left unset here, a GPU's budget and no solo prefill.
        self.policy = policy or SchedulingConfig()
        self.clock = clock  # the clock of arrival times (tests and the simulator set their own)
        self.step_cost = step_cost or StepCostModel()  # fed by observe_step with every step the model ran
        self.overrun_s = 0.0  # decode_payback: decoders' time still owed by steps that ran past the budget
        # Tokens a step may carry after one ran out of GPU memory (step_token_cap.py); None: the budget's own.
        self.step_token_cap: int | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Out of `running` (their last step is still on the device) but holding their row and blocks until removed.
        self.ending: set[Sequence] = set()
        self.num_preemptions = 0
        self.room_waits = 0  # admissions closed for a host-tier restore that did not fit the free pool yet
        self.restore_unstarted_blocks = 0  # host-tier blocks of admitted prompts not restored: no room for any
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.restored_tokens = 0  # cumulative tokens restored from the host tier, re-admissions included
        self.cold_admissions = 0  # requests admitted as cold prefills (warm_first only)
        self._load: tuple[float, PrefillLoad] | None = None  # (when, value) of the last prefill_load

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def end(self, seq: Sequence) -> None:
        """The step running on the device is seq's last (it reaches its length there): no later step gives it
        tokens, but its block-table row and blocks stay taken until that step is read and seq removed, so it still
        counts against max_num_seqs (admitting in its place now would need one row more than there are)."""
        if seq in self.running:
            self.running.remove(seq)
            self.ending.add(seq)

    def num_seated(self) -> int:
        """Sequences holding a block-table row: the running ones and those ending in the step on the device."""
        return len(self.running) + len(self.ending)

    def remove(self, seq: Sequence, release: bool = True) -> None:
        """Take a sequence out of the queues and release its blocks (finish or abort); release=False leaves the
        blocks to the caller (a step still running on the GPU writes them: the engine frees them after it)."""
        self.ending.discard(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if release:
            self.kv.free(seq, finished=True)

    def waiting_prefill_tokens(self) -> int:
        return self.prefill_load().tokens

    def waiting_warm_prefill_tokens(self) -> int:
        return self.prefill_load().warm_tokens

    def prefill_load(self) -> PrefillLoad:
        """Prefill still to do, and the part of it a newly arrived warm request would queue behind: under
        warm_first only the requests taken before cold ones (warm, preempted, starved waiting ones; running
        prefills that are not cold), under fifo everything. The router compares the warm part, not the whole, when a
        session's rank is busy with cold prefills: its warm turn would not wait for them.

        Measuring walks every waiting request's block hashes, and the engine loop asks after every step: the
        value is reused for LOAD_REFRESH_S (the router hears it once a heartbeat, and counts what it routed
        since in the same unit)."""
        now = self.clock()
        if not self.waiting and not self.running:
            # An idle rank's loop stops asking: a value kept from its last busy step would be reported until the
            # next request, steering the router away from an idle rank.
            self._load = None
            return PrefillLoad(0, 0)
        if self._load is not None and 0 <= now - self._load[0] < LOAD_REFRESH_S:
            return self._load[1]
        load = self._measure_load(now)
        self._load = (now, load)
        return load

    def _measure_load(self, now: float) -> PrefillLoad:
        total = warm = 0
        for seq in self.waiting:
            in_l0, in_l1 = self.kv.peek_cached_split(seq)
            work = seq.num_tokens - in_l0 - in_l1 + round(in_l1 * self.policy.l1_restore_cost)
            total += work
            taken_first = (
                seq.num_l0_cached_tokens is not None
                or self._starved(seq, now)
                or in_l0 + in_l1 >= self.policy.warm_prefix_fraction * seq.num_prompt_tokens
            )
            warm += work if taken_first or not self.policy.warm_first else 0
        for seq in self.running:
            left = seq.num_uncomputed_tokens
            if left <= 1:
                continue  # decoding: its share of the GPU is the router's per-running-sequence cost
            total += left
            in_cold_prefill = seq.num_computed_tokens < seq.cold_until  # starved or not: warm work goes first
            warm += left if not in_cold_prefill or not self.policy.warm_first else 0
        return PrefillLoad(total, warm)

    def observe_step(self, load: StepLoad, seconds: float) -> None:
        """The model took `seconds` for a step carrying `load` (a batch's load, read before its sequences
        advanced: their computed tokens are the chunks' cached context)."""
        self.step_cost.observe(load, seconds)
        budget_ms = self.policy.step_budget_ms()
        if self.policy.decode_payback and budget_ms > 0:
            self.overrun_s = payback(self.overrun_s, load, seconds, budget_ms / 1000)

    def schedule(self, preempt: bool = True) -> ScheduledBatch:
        """The next step's batch. preempt=False (a step scheduled while its predecessor still runs on the device,
        which writes the running sequences' blocks): a running sequence that gets no blocks is left out of this
        step (batch.skipped) and nobody new is admitted, rather than preempting anyone."""
        budget = self.max_num_batched_tokens
        if self.step_token_cap is not None:
            budget = min(budget, self.step_token_cap)
        step = _Step(budget=budget, now=self.clock(), preempt=preempt)
        budget_ms = self.policy.step_budget_ms()
        if budget_ms > 0:
            decoding = [(seq, 1) for seq in self.running if seq.num_uncomputed_tokens == 1]
            if decoding:
                step.time_budget_s = budget_ms / 1000
                step.load = step_load(decoding)
                step.decode_only = self.overrun_s > 0
                step.closed = step.decode_only
            else:
                self.overrun_s = 0.0  # nobody to pay back
        if not self.policy.warm_first:
            order = list(self.running)
            self._run(order, 0, len(order), step)
            self._admit(((seq, False, False) for seq in list(self.waiting)), step)
            return step.batch
        # warm_first: running decodes and warm prefills, then waiting warm requests, then running cold
        # prefills, then waiting cold requests (under the cap). Victims of a block shortage come from the
        # back of the running order: cold prefills first.
        first: list[Sequence] = []
        cold: list[Sequence] = []
        for seq in self.running:
            in_cold_prefill = seq.num_computed_tokens < seq.cold_until
            (cold if in_cold_prefill else first).append(seq)
            step.cold_in_prefill += in_cold_prefill
        # Starved prefills lead the cold work, the rest goes shortest first (stable: equals keep their order).
        cold.sort(key=lambda seq: (not self._starved(seq, step.now), seq.num_uncomputed_tokens))
        # A starved prefill's chunk is set aside before the warm work takes the budget: it progresses every step.
        reserve = min(self.policy.min_prefill_chunk_tokens, step.budget) if cold and cold[0].starved else 0
        step.budget -= reserve
        order = first + cold
        index = self._run(order, 0, len(first), step)
        later: list[tuple[Sequence, int]] = []
        self._admit(self._first_class(step.now, later), step)
        step.budget += reserve
        self._cold_work(order, index, later, step)
        return step.batch

    def _cold_work(self, order: list[Sequence], index: int, waiting: list[tuple[Sequence, int]], step: _Step) -> None:
        """warm_first's last phase: the running cold prefills order[index:] (starved ones first, then by what
        they have left) and the waiting cold requests (each with its uncached tokens), merged shortest first."""
        pending = deque(sorted(waiting, key=lambda item: item[1]))  # stable: equals keep their arrival order
        while step.budget > 0:
            running = order[index] if index < len(order) else None
            left = None if running is None else 0 if running.starved else running.num_uncomputed_tokens
            if pending and (left is None or pending[0][1] < left):
                seq, _ = pending.popleft()
                self._admit(iter([(seq, True, True)]), step)
                continue
            if left is None:
                return
            after = self._run(order, index, index + 1, step)
            if after == index:
                return  # the budget is spent, or the prefill preempted itself (order ends before it now)
            index = after

    def _run(self, order: list[Sequence], index: int, stop: int, step: _Step) -> int:
        """Give running sequences order[index:stop] their tokens; returns where it stopped. When blocks run
        out, sequences are preempted from the back of `order` (which shrinks) until the current one fits."""
        batch = step.batch
        while index < min(stop, len(order)) and step.budget > 0:
            seq = order[index]
            num_new = self._tokens_within_time(seq, min(seq.num_uncomputed_tokens, step.budget), step)
            if num_new > 1 and not seq.starved:  # a prefill chunk leaves the blocks lookups under way will take
                num_new = self.kv.tokens_within_reserve(seq, num_new)  # (a starved one progresses every step)
            if num_new == 0:
                index += 1  # the step's time is spent (or the free pool is promised): it continues in a later step
                continue
            allocated = self.kv.allocate(seq, num_new)
            if not allocated and not step.preempt:
                batch.skipped.append(seq)
                step.closed = True  # blocks are short: admitting anyone would only make it worse
                self._blocks_short()
                index += 1
                continue
            if not allocated:  # (step.preempt) restores waiting for their admission give way before anyone running
                self._blocks_short()
                allocated = self.kv.allocate(seq, num_new)
            while not allocated:
                victim = order.pop()
                self._preempt(victim, batch)
                if victim is seq:
                    break
                allocated = self.kv.allocate(seq, num_new)
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing further back can run either
            batch.entries.append((seq, num_new))
            seq.last_scheduled_time = step.now
            step.budget -= num_new
            if num_new > 1 and step.time_budget_s is not None:  # decoding rows are in step.load already
                step.load = step.load.with_chunk(num_new, seq.num_computed_tokens)
            index += 1
        return index

    def _admit(self, candidates: Iterable[tuple[Sequence, bool, bool]], step: _Step) -> None:
        """Admit candidates (sequence, counts as a cold prefill, held back by the cold cap) in order while
        there is room. The first one that does not fit closes admission for the rest of the step."""
        batch = step.batch
        cap = self.policy.max_cold_prefills
        for seq, cold, capped in candidates:
            # Admit only when nobody was preempted this step (or they would thrash).
            if step.closed or step.budget <= 0 or batch.preempted or self.num_seated() >= self.max_num_seqs:
                step.closed = True
                return
            if capped and cap and step.cold_in_prefill >= cap:
                continue  # the cap holds it back; warm requests behind it may still go
            if self._time_spent(step):
                step.closed = True  # the decoders' time budget is spent: whoever waits, waits a step
                return
            if self._waits_for_room(seq, step):
                step.closed = True
                self.room_waits += 1
                self._blocks_short()
                return
            if self.kv.waits_for_host(seq, step.budget):
                continue  # WAITING_FOR_L1: its blocks are being restored off the engine thread; admitted after
            fresh = seq.num_l0_cached_tokens is None
            cached, restored = self.kv.attach_cached_prefix(seq)
            self.restored_tokens += restored
            num_new = self._tokens_within_time(seq, min(seq.num_uncomputed_tokens, step.budget), step)
            solo = self._solo_tokens(seq, step)
            spare = self.kv.reserved_blocks()  # host-tier lookups under way take these when answered
            if solo and self.kv.allocate(seq, solo, spare=spare):
                num_new = solo
            elif num_new == 0 or not self.kv.allocate(seq, num_new, spare=spare):
                self.kv.free(seq)  # give the prefix back; try again next step
                step.closed = True
                self._blocks_short()
                return
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            seq.cold_until = seq.num_tokens if cold else 0
            if cold:
                step.cold_in_prefill += 1
                self.cold_admissions += 1
            if fresh:
                seq.num_l0_cached_tokens = cached
                seq.num_l1_cached_tokens = restored
                self.restore_unstarted_blocks += seq.l1_unstarted_blocks
                seq.first_scheduled_time = step.now
                self.prefix_query_tokens += seq.num_prompt_tokens
                self.prefix_hit_tokens += cached
            self.running.append(seq)
            batch.entries.append((seq, num_new))
            seq.last_scheduled_time = step.now
            step.budget = max(step.budget - num_new, 0)  # a solo prefill spends it all
            if step.time_budget_s is not None:
                step.load = step_load([(seq, num_new)], step.load)

    def _blocks_short(self) -> None:
        """Blocks ran short this step: restores waiting for their admission let go of what they hold (idle L0
        entries again, the most recent). Held, they would wait behind whoever ran short, and that one for them."""
        for seq in self.waiting:
            self.kv.drop_restore_hold(seq)

    def _waits_for_room(self, seq: Sequence, step: _Step) -> bool:
        """seq's context is in the host tier but the free pool cannot take it whole yet (restore_waits_for_room):
        it waits, and admission with it, for running sequences to give their blocks back, rather than being
        restored in part and the rest computed again. Not when nobody runs or ends (no blocks are coming back: a
        sequence whose last step is on the device gives its blocks back once that step is read), and not past
        cold_max_wait_secs of waiting: then what fits is restored, as a long decode would hold it too long."""
        # _waited, not _starved: the wait is measured without marking warm work starved
        if not (self.running or self.ending) or self._waited(seq, step.now) >= self.policy.cold_max_wait_secs:
            return False
        return self.kv.restore_waits_for_room(seq, step.budget)

    def _solo_tokens(self, seq: Sequence, step: _Step) -> int:
        """The one-step chunk of a solo prefill for seq (see the module's doc), or 0: not one."""
        cap = self.policy.solo_prefill_tokens or 0
        if self.step_token_cap is not None:
            cap = min(cap, self.step_token_cap)
        alone = not self.running and not step.batch.entries
        if cap <= step.budget or not alone or seq.num_computed_tokens or seq.num_uncomputed_tokens <= step.budget:
            return 0
        return min(seq.num_uncomputed_tokens, cap)

    # --- the decoders' time budget ---

    def _tokens_within_time(self, seq: Sequence, wanted: int, step: _Step) -> int:
        """Of `wanted` tokens of a prefill, those that keep the step within its time budget (all when it has
        none), cut to whole blocks; at least what is left of the step's min_prefill_chunk_tokens."""
        if step.time_budget_s is None or wanted <= 1:
            return wanted
        if step.decode_only:
            return 0
        fits = self.step_cost.max_chunk_tokens(step.load, seq.num_computed_tokens, step.time_budget_s)
        if fits >= wanted:
            return wanted
        fits -= fits % self.kv.block_size
        # what is left of the step's minimum prefill; a starved prefill gets a minimum of its own (its reserve)
        floor = self.policy.min_prefill_chunk_tokens - (0 if seq.starved else step.load.prefill_tokens)
        return min(wanted, max(fits, floor, 0))

    def _time_spent(self, step: _Step) -> bool:
        """Not one more prefill token (even over no cached context) fits the step's time budget."""
        if step.time_budget_s is None or step.load.prefill_tokens < self.policy.min_prefill_chunk_tokens:
            return False
        return self.step_cost.max_chunk_tokens(step.load, 0, step.time_budget_s) == 0

    # --- the policy ---

    def _first_class(self, now: float, later: list[tuple[Sequence, int]]) -> Iterator[tuple[Sequence, bool, bool]]:
        """warm_first's first pass over the waiting queue, in order: warm requests, preempted ones (they
        keep their place at the front) and starved cold ones (admitted as if warm: never held back, though
        they count as cold prefills); every other request is put in `later`, with its uncached tokens.

        A generator, so a step with no room classifies nobody (a peek walks up to thousands of hashes)."""
        for seq in list(self.waiting):
            starved = self._starved(seq, now)
            needed = self.policy.warm_prefix_fraction * seq.num_prompt_tokens
            # A peek stops at `enough` or at the first block not cached: short of warm, it is the whole run.
            cached = self.kv.peek_cached_tokens(seq, enough=int(needed) + 1)
            if cached >= needed:
                yield seq, False, False
            elif seq.num_l0_cached_tokens is not None or starved:
                yield seq, True, not starved
            else:
                later.append((seq, seq.num_tokens - cached))

    def _starved(self, seq: Sequence, now: float) -> bool:
        """It has gone cold_max_wait_secs without a token: waiting since its arrival, or (a running prefill)
        since its last chunk. Being prefilled is not waiting. Once starved, it stays so."""
        if not seq.starved:
            seq.starved = self._waited(seq, now) >= self.policy.cold_max_wait_secs
        return seq.starved

    @staticmethod
    def _waited(seq: Sequence, now: float) -> float:
        """Seconds without a token: waiting since its arrival, or (a running prefill) since its last chunk."""
        since = seq.arrival_time if seq.last_scheduled_time is None else seq.last_scheduled_time
        return now - since

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
