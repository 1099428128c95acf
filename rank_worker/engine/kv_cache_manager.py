"""Which blocks each sequence holds: prefix lookup on admission (L0, after waiting for what the host tier
restores into L0), growth as tokens are computed, cache registration of every block the moment it is full,
and release when the sequence ends (its registered blocks written through to L1 first)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from typing import Protocol

from contracts.block_hash import BLOCK_HASH_BYTES, chain_block_hash, lookup_block_count, prefix_block_hashes
from rank_worker.engine.block_pool import BlockPool
from rank_worker.engine.sequence import Sequence, SequenceStatus
from rank_worker.l1.host_fetch import HostFetch, release_held

log = logging.getLogger(__name__)


class HostCacheTier(Protocol):
    """What the cache manager asks of a host tier (rank_worker.l1.tier.L1Tier). Nothing here waits."""

    def fetch(self, prefix: list[bytes], block_hashes: list[bytes], room: Callable[[int], int]) -> HostFetch | None:
        """Start restoring into L0 the leading run of block_hashes (which follow the L0 blocks of `prefix`) that
        the tier holds; None if it cannot now."""
        ...

    def abandon(self, fetch: HostFetch) -> None: ...

    def offload(self, block_ids: list[int], block_hashes: list[bytes], *, finished: bool = False) -> None:
        """Write registered blocks through to the tier; finished: their sequence ended (l1_refresh_finished)."""
        ...

    def known_run(self, block_hashes: list[bytes]) -> int:
        """How many leading block_hashes the tier is believed to hold, asking no one (a scheduling hint)."""
        ...


# A lookup answered when the free pool had no room left for any of its blocks is made again, at most this often
# (each one waits for room first); then the sequence computes what is left, as for a part of the pool.
MAX_LOOKUPS_CUT = 3


class KvCacheManager:
    def __init__(
        self, pool: BlockPool, block_size: int, hash_namespace: bytes, host_tier: HostCacheTier | None = None
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.namespace = hash_namespace
        self.host_tier = host_tier
        self._refusals_logged: set[str] = set()  # why sent hashes were not used, each said once
        self._lookups: list[HostFetch] = []  # started here and not answered yet: see reserved_blocks

    def sent_prompt_hashes(self, prompt: Tokens[int], sent: Tokens[bytes], namespace: bytes) -> list[bytes]:
        """The hash chain a new sequence starts with: the client's hashes of the prompt's full blocks when they
        are in this rank's namespace and there is one per full block, else none (the rank hashes the prompt
        itself when it first looks it up, as without them)."""
        if not sent and not namespace:
            return []  # a client that sends none
        full_blocks = len(prompt) // self.block_size
        if namespace != self.namespace:
            self._refused("namespace", f"namespace {namespace.hex()} is not this rank's {self.namespace.hex()}")
        elif len(sent) != full_blocks:
            self._refused("count", f"{len(sent)} hashes for a prompt of {full_blocks} full blocks")
        elif any(len(block_hash) != BLOCK_HASH_BYTES for block_hash in sent):
            self._refused("size", f"a hash that is not {BLOCK_HASH_BYTES} bytes long")
        else:
            return list(sent)  # our own list: the sequence extends it with its output blocks
        return []

    def _refused(self, reason: str, detail: str) -> None:
        if reason not in self._refusals_logged:
            self._refusals_logged.add(reason)
            log.debug("prompt block hashes sent with a request not used, hashed again here: %s", detail)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(total - len(seq.block_table), 0)

    def waits_for_host(self, seq: Sequence, token_budget: int | None = None) -> bool:
        """True while a sequence about to be admitted waits for the host tier (WAITING_FOR_L1): the tier holds
        blocks past its L0 prefix, and their restore into L0, started here, is not done. Once it is (restored,
        found missing, failed or timed out), admission goes on over the L0 prefix, longer by what came back.
        The restore leaves enough free blocks for the next chunk of at most token_budget tokens."""
        seq.l1_unstarted_blocks = 0
        fetch = seq.host_fetch
        if fetch is not None:
            if not fetch.done:
                return True
            seq.status = SequenceStatus.WAITING
            if fetch.cut and not fetch.restored and seq.l1_lookups_cut < MAX_LOOKUPS_CUT:
                # Others' admissions took the room while it was looked up, and L1 holds the blocks: wait for room
                # and look them up again (restore_waits_for_room) rather than compute them all now
                seq.l1_lookups_cut += 1
                seq.host_fetch = None
                self._let_go(fetch)
                return True
            return False
        found_past = self._past_l0(seq)
        if found_past is None:
            return False
        hashes, prefix, rest_tokens, _ = found_past

        def room(found: int) -> int:
            return self._restore_room(rest_tokens, found, token_budget)

        if room(len(hashes) - prefix) <= 0:
            seq.l1_unstarted_blocks = self.host_tier.known_run(hashes[prefix:])
            return False
        fetch = self.host_tier.fetch(hashes[:prefix], hashes[prefix:], room)
        if fetch is None:
            return False
        seq.host_fetch = fetch
        if fetch.done:  # a tier that answers at once (the simulator's): admitted in this same step
            return False
        fetch.reserved = self._restore_blocks(rest_tokens, room(fetch.expected), token_budget) + 1  # and the spare
        self._lookups.append(fetch)
        seq.status = SequenceStatus.WAITING_FOR_L1
        return True

    def reserved_blocks(self) -> int:
        """Free blocks promised to host-tier lookups under way: each counted, when it began, the free pool's room
        for the blocks L1 was known to hold and the chunk after them. Admissions and prefill chunks leave them free
        until the answer (a step or two): on the H100 at 40-48 agents, others' admissions in between took that
        room and restores were cut, 82K-234K tokens a step computed again while L1 held them
        (bench/results/2026-12-07-h100-peer-llama-8b-held, kvserve:l1_restore_room_cut_blocks)."""
        if self._lookups:
            self._lookups = [fetch for fetch in self._lookups if not fetch.done]
        return sum(fetch.reserved for fetch in self._lookups)

    def tokens_within_reserve(self, seq: Sequence, num_new_tokens: int) -> int:
        """At most num_new_tokens: as many as the free pool takes for seq while leaving reserved_blocks free."""
        reserved = self.reserved_blocks()
        if not reserved:
            return num_new_tokens
        blocks = len(seq.block_table) + self.pool.num_free - reserved
        return max(min(num_new_tokens, blocks * self.block_size - seq.num_computed_tokens), 0)

    def restore_waits_for_room(self, seq: Sequence, token_budget: int | None = None) -> bool:
        """True when the host tier is known to hold more of a sequence's prompt past its L0 prefix than the free
        pool takes beside its next chunk, while all of it would fit the pool: restoring only what fits now has
        the rest computed again (from L1 a 400K-token DeepSeek context takes under a second, as a prefill tens
        of seconds), so the scheduler waits for running sequences to give their blocks back instead. False when
        nothing is to be restored, all of it fits, or it could never fit whole (then part is the best there is)."""
        found_past = None if seq.host_fetch is not None or seq.block_table else self._past_l0(seq)
        if found_past is None:
            return False
        hashes, prefix, rest_tokens, idle_prefix = found_past
        assert self.host_tier is not None
        needed = self._restore_blocks(rest_tokens, self.host_tier.known_run(hashes[prefix:]), token_budget)
        # The prefix's idle blocks count as free but are taken with it (its lookup holds them): not room; nor are
        # the blocks lookups under way will take
        free = self.pool.num_free - self.reserved_blocks() - idle_prefix
        return needed > free - 1 and prefix + needed <= self.pool.num_blocks - 1

    def _past_l0(self, seq: Sequence) -> tuple[list[bytes], int, int, int] | None:
        """(lookup hashes, blocks of its L0 prefix, prompt tokens after it, how many of those blocks are idle
        cache entries, counted in the free pool) when the host tier is believed to hold the block after seq's L0
        prefix; None when there is nothing to restore."""
        if self.host_tier is None or not self.pool.caching:
            return None
        hashes = self.lookup_hashes(seq)
        run = self.pool.cached_run(hashes)
        prefix = len(run)
        if prefix >= len(hashes) or self.host_tier.known_run(hashes[prefix : prefix + 1]) == 0:
            return None
        blocks = self.pool.blocks
        idle = sum(1 for block_id in run if blocks[block_id].ref_count == 0)
        return hashes, prefix, seq.num_tokens - prefix * self.block_size, idle

    def attach_cached_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Give a sequence that holds no blocks its longest cached prefix from L0. Returns (tokens from L0,
        tokens of it the host tier restored for this sequence while it waited).

        Stops one token short of the end: the last token must be computed to produce logits."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        fetch, seq.host_fetch = seq.host_fetch, None
        if not self.pool.caching:
            return 0, 0
        hashes = self.lookup_hashes(seq)
        blocks = self.pool.cached_run(hashes)
        for block_id in blocks:
            self.pool.acquire_cached(block_id)
        restored = 0
        if fetch is not None:
            restored = sum(1 for block_id in blocks[len(fetch.prefix) :] if block_id in fetch.restored)
        seq.block_table = blocks
        seq.block_hashes = hashes[: len(blocks)]
        seq.num_computed_tokens = len(blocks) * self.block_size
        if fetch is not None:
            self._let_go(fetch)  # its blocks are the sequence's now (those of its run)
        return (len(blocks) - restored) * self.block_size, restored * self.block_size

    def drop_restore_hold(self, seq: Sequence) -> None:
        """A waiting sequence's answered restore stops holding its blocks (they stay in L0 as idle entries, and
        count as restored if still there at its admission): for when blocks run short, so it never holds up the
        sequences that would give blocks back."""
        fetch = seq.host_fetch
        if fetch is not None and fetch.done:
            release_held(self.pool, fetch)

    def _let_go(self, fetch: HostFetch) -> None:
        """A fetch its sequence is done with: under way, the tier gives it up; answered, what it holds is let go."""
        if not fetch.done:
            assert self.host_tier is not None
            self.host_tier.abandon(fetch)
        else:
            release_held(self.pool, fetch)

    def lookup_hashes(self, seq: Sequence) -> list[bytes]:
        """The sequence's cache keys: hashes of the full blocks of all its tokens but the last (which must be
        computed for logits). The chain is kept on the sequence and only extended (a preempted sequence has
        grown), since a long prompt's hashes cost milliseconds and the scheduler asks for them every step it
        waits. It may hold one block more (the client sent the hash of a prompt's last full block)."""
        hashes = seq.lookup_hashes
        wanted = lookup_block_count(seq.num_tokens, self.block_size)
        if len(hashes) < wanted:
            begin = len(hashes) * self.block_size
            tokens = seq.token_ids[begin : wanted * self.block_size]
            hashes.extend(prefix_block_hashes(self.namespace, tokens, self.block_size, hashes[-1] if hashes else None))
        return hashes if len(hashes) == wanted else hashes[:wanted]

    def peek_cached_tokens(self, seq: Sequence, enough: int | None = None) -> int:
        """Prompt tokens the caches hold for this sequence now (the L0 run, then the run the host tier is known
        to hold), taking no block and making no call: what warm-first scheduling ranks by. Counting stops once
        `enough` tokens are found."""
        return sum(self.peek_cached_split(seq, enough))

    def peek_cached_split(self, seq: Sequence, enough: int | None = None) -> tuple[int, int]:
        """peek_cached_tokens as (tokens in L0, tokens after them the host tier is known to hold): the rank's
        load counts the second kind at the cost of a restore, not of a prefill."""
        if not self.pool.caching:
            return 0, 0
        hashes = self.lookup_hashes(seq)
        limit = len(hashes) if enough is None else min(len(hashes), -(-enough // self.block_size))
        in_l0 = len(self.pool.cached_run(hashes, limit))
        in_l1 = 0
        if in_l0 < limit and self.host_tier is not None:
            in_l1 = self.host_tier.known_run(hashes[in_l0:limit])
        return in_l0 * self.block_size, in_l1 * self.block_size

    def _restore_room(self, rest_tokens: int, restorable: int, token_budget: int | None) -> int:
        """The most blocks to restore so that they plus the blocks of the next chunk to compute still fit
        the free pool (one block spare), less the blocks other lookups under way will take. Every restored block
        shortens what is left to compute, so a remainder that fits whole is restored whole."""
        free = self.pool.num_free - self.reserved_blocks()
        room = min(restorable, free - 1)
        while room > 0 and self._restore_blocks(rest_tokens, room, token_budget) > free - 1:
            room -= 1
        return room

    def _restore_blocks(self, rest_tokens: int, restored: int, token_budget: int | None) -> int:
        """Blocks taken by restoring `restored` blocks of rest_tokens plus the next chunk computed after them."""
        left = rest_tokens - restored * self.block_size
        chunk = left if token_budget is None else min(left, token_budget)
        return restored + -(-chunk // self.block_size)

    def allocate(self, seq: Sequence, num_new_tokens: int, *, spare: int = 0) -> bool:
        """Grow the sequence's block table to hold num_new_tokens more; False (nothing taken) if short, or if
        fewer than `spare` free blocks would be left (an admission leaves reserved_blocks)."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.pool.num_free - spare:
            return False
        if needed:
            seq.block_table.extend(self.pool.allocate(needed))
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash and register every block that has become full of computed tokens.

        Called right after each forward pass, so a finished sequence's blocks are cache entries before
        they are released."""
        num_full = seq.num_computed_tokens // self.block_size
        chain = seq.lookup_hashes  # same chain over the same tokens: reuse what lookups (or the client) hashed
        with_tokens = self.pool.record_stored_tokens  # vLLM-format KV events: each block's parent and tokens
        for index in range(len(seq.block_hashes), num_full):
            if index < len(chain):
                block_hash = chain[index]
            else:
                parent = seq.block_hashes[-1] if seq.block_hashes else self.namespace
                begin = index * self.block_size
                block_hash = chain_block_hash(parent, seq.token_ids[begin : begin + self.block_size])
                if index == len(chain):  # an output block: a recompute after preemption looks it up, not hashes it
                    chain.append(block_hash)
            if with_tokens:
                begin = index * self.block_size
                self.pool.register(
                    seq.block_table[index],
                    block_hash,
                    seq.block_hashes[-1] if seq.block_hashes else None,
                    tuple(seq.token_ids[begin : begin + self.block_size]),
                )
            else:
                self.pool.register(seq.block_table[index], block_hash)
            seq.block_hashes.append(block_hash)

    def offload(self, seq: Sequence, *, finished: bool = False) -> None:
        """Write the sequence's registered (full, immutable) blocks through to the host tier; finished: the
        sequence is ending and its blocks go idle."""
        if self.host_tier is not None and seq.block_hashes:
            self.host_tier.offload(seq.block_table[: len(seq.block_hashes)], seq.block_hashes, finished=finished)

    def free(self, seq: Sequence, *, finished: bool = False) -> None:
        """Let go of the sequence's blocks; finished: its request ended (not a preemption or an admission giving its
        prefix back for the next step, which would refresh L1 every step it waits: l1_refresh_finished)."""
        fetch, seq.host_fetch = seq.host_fetch, None
        if fetch is not None:
            self._let_go(fetch)  # it left while waiting for the host tier, or before its admission took the restore
        self.offload(seq, finished=finished)
        self.pool.release(list(reversed(seq.block_table)))
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
