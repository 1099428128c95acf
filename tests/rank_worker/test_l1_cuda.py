"""The L1 path on CUDA: offloads run on a side stream and are committed once their event fires, restores
land in the pool before the step that reads them, and the arena is pinned. The kvstore here is an in-memory
stand-in for its contract (the machines with GPUs in CI-less runs may lack the service's dependencies); the
real one is exercised by the CPU tests. Its calls run on the tier's worker thread, as the real ones do."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_fixtures import generate_one, greedy, random_prompt
from l1_fixtures import tiny_model

from contracts.config import EngineConfig
from contracts.kv_events import KvEvent, KvEventBatch, KvEventKind
from rank_worker.engine.paged_engine import EngineSettings, PagedEngine
from rank_worker.l1.arena import ArenaLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = 16


class InMemoryKvStore:
    """One rank's view of the kvstore contract: slots with write and read pins, no eviction."""

    def __init__(self, directory: Path, num_slots: int) -> None:
        self.directory = directory
        self.num_slots = num_slots
        self.layout: ArenaLayout | None = None
        self.stored: dict[bytes, int] = {}
        self.writing: dict[int, bytes] = {}
        self.reserved: set[int] = set()
        self.read_pins: dict[int, int] = {}
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def address(self) -> str:
        return "in-memory"

    def attach(self, slot_bytes: int, hash_namespace: bytes) -> ArenaLayout:
        path = self.directory / "arena"
        with path.open("wb") as file:
            file.truncate(self.num_slots * slot_bytes)
        self.layout = ArenaLayout("arena", str(path), self.num_slots * slot_bytes, slot_bytes, self.num_slots)
        return self.layout

    def allocate(self, arena_id: str, block_hashes: list[bytes]) -> list[int]:
        slots = []
        for block_hash in block_hashes:
            if block_hash in self.stored or block_hash in self.writing.values() or not self.free:
                slots.append(-1)
            else:
                slots.append(self.free.pop())
                self.writing[slots[-1]] = block_hash
        return slots

    def reserve(self, arena_id: str, count: int) -> list[int]:
        slots = [self.free.pop() for _ in range(min(count, len(self.free)))]
        self.reserved.update(slots)
        return slots

    def commit(
        self, arena_id: str, slots: list[int], *, gpu_holds: bool = False, block_hashes: list[bytes] | None = None
    ) -> None:
        if block_hashes:
            for slot, block_hash in zip(slots, block_hashes, strict=True):
                self.reserved.remove(slot)
                if block_hash in self.stored or block_hash in self.writing.values():
                    self.free.append(slot)  # a copy L1 already has
                else:
                    self.stored[block_hash] = slot
            return
        for slot in slots:
            self.stored[self.writing.pop(slot)] = slot

    def lookup(self, arena_id: str, block_hashes: list[bytes]) -> list[int]:
        slots = []
        for block_hash in block_hashes:
            if block_hash not in self.stored:
                break
            slots.append(self.stored[block_hash])
            self.read_pins[slots[-1]] = self.read_pins.get(slots[-1], 0) + 1
        return slots

    def release(self, arena_id: str, slots: list[int], *, restored: bool = False) -> None:
        for slot in slots:
            if slot in self.reserved:  # a reservation given up
                self.reserved.remove(slot)
                self.free.append(slot)
                continue
            self.read_pins[slot] -= 1
            if not self.read_pins[slot]:
                del self.read_pins[slot]

    def current_arena_id(self) -> str:
        return "arena"

    def kv_events(self) -> IdleEventStream:
        return IdleEventStream()

    def close(self) -> None:
        pass


class IdleEventStream:
    """A KvEvents subscription that announces nothing until cancelled (this store tells no one what it holds:
    the tier knows what it committed itself)."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[KvEventBatch]:
        yield KvEventBatch(1, (KvEvent(KvEventKind.ALL_CLEARED),))
        self._cancelled.wait()

    def cancel(self) -> None:
        self._cancelled.set()


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """The arena where production puts it: CUDA registers /dev/shm mappings as pinned memory."""
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory)


def test_cuda_offload_is_asynchronous_and_restore_gives_back_the_same_bytes(shm_dir: Path) -> None:
    model = tiny_model("cuda")
    store = InMemoryKvStore(shm_dir, num_slots=256)
    settings = EngineSettings(num_blocks=20, max_model_len=320, engine=EngineConfig(block_size=BLOCK))
    engine = PagedEngine(model, settings, None, l1_client=store)
    assert engine.l1 is not None and engine.l1.arena is not None and engine.l1.arena.pinned

    a1_prompt = random_prompt(8 * BLOCK + 5, 128, seed=1)
    a1 = generate_one(engine, a1_prompt, greedy(8), "a1")  # steps until every offload is committed too
    assert not store.writing and len(store.stored) == 8 and engine.stats().l1_offloaded_blocks == 8
    computed = {h: engine.kv_cache[engine.pool.lookup(h)].clone() for h in store.stored}
    arena = engine.l1.arena.slots
    for block_hash, slot in store.stored.items():
        assert torch.equal(arena[slot], computed[block_hash].cpu())  # the side-stream copy landed whole

    generate_one(engine, random_prompt(300, 128, seed=2), greedy(2), "b")
    a2 = generate_one(engine, a1_prompt + a1.new_token_ids + random_prompt(20, 128, seed=3), greedy(8), "a2")
    assert a2.stats.l1_cached_tokens >= 6 * BLOCK
    for block_hash, data in computed.items():
        block_id = engine.pool.lookup(block_hash)
        assert block_id is not None and torch.equal(engine.kv_cache[block_id], data)

    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.l1_copies_in_flight == 0
    assert not store.read_pins and not store.writing
    engine.close()
    assert engine.l1.arena is None


def test_cuda_on_evict_copies_an_evicted_block_before_the_step_that_reuses_it_writes_it(shm_dir: Path) -> None:
    """l1_write_through on_evict: nothing written through; the blocks a later prompt's allocation evicts are copied
    on the compute stream into reserved slots before that prompt's step overwrites them, and come back exact."""
    model = tiny_model("cuda")
    store = InMemoryKvStore(shm_dir, num_slots=256)
    engine_config = EngineConfig(
        block_size=BLOCK, l1_write_through="on_evict", l1_eviction_horizon_blocks=0, l1_reserved_slots=64
    )
    settings = EngineSettings(num_blocks=20, max_model_len=320, engine=engine_config)
    engine = PagedEngine(model, settings, None, l1_client=store)
    assert engine.l1 is not None and engine.l1.arena is not None and engine.l1.arena.pinned

    a1_prompt = random_prompt(8 * BLOCK + 5, 128, seed=1)
    a1 = generate_one(engine, a1_prompt, greedy(8), "a1")
    assert not store.stored and not store.writing  # nothing written through
    assert len(store.reserved) == 64  # a quarter of the arena, asked once the first step ran
    computed = {h: engine.kv_cache[engine.pool.lookup(h)].clone() for h in engine.pool.cached_hashes()}
    assert len(computed) == 8

    generate_one(engine, random_prompt(300, 128, seed=2), greedy(2), "b")  # 19 of the 20 blocks: a1's evicted
    while engine.l1.has_pending:
        engine.l1.wait_pending()
    assert engine.stats().l0_evicted_unsaved_blocks == 0
    arena = engine.l1.arena.slots
    evicted = [h for h in computed if engine.pool.lookup(h) is None]  # b's 19 blocks: 7 of a1's (its head stays)
    assert len(evicted) >= 6 and set(store.stored) == set(evicted), (len(evicted), len(store.stored))
    for block_hash in evicted:
        data = computed[block_hash]
        assert torch.equal(arena[store.stored[block_hash]], data.cpu())  # read before b's step wrote the block

    a2 = generate_one(engine, a1_prompt + a1.new_token_ids + random_prompt(20, 128, seed=3), greedy(8), "a2")
    assert a2.stats.l1_cached_tokens >= 6 * BLOCK
    for block_hash, data in computed.items():
        block_id = engine.pool.lookup(block_hash)
        assert block_id is not None and torch.equal(engine.kv_cache[block_id], data)
    engine.close()
