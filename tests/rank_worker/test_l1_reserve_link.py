"""Reserved slots through the rank's kvstore link and a real kvstore process: a rank reserves slots before it
knows their blocks, writes the bytes, names the blocks at Commit; another rank finds them by hash and reads the
same bytes, a copy L1 already had goes back to free, the tier's call thread makes both calls, and the kvstore's
refusals reach the rank as the two errors the tier understands."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from l1_fixtures import kvstore_settings, kvstore_stats
from service_processes import free_port, start_kvstore

from contracts.block_hash import BLOCK_HASH_BYTES
from contracts.kv_events import KvEventKind
from rank_worker.l1.kvstore_client import L1StaleArenaError, L1UnavailableError
from rank_worker.l1.kvstore_link import KvStoreLink
from rank_worker.l1.l1_calls import CallKind, L1Call, L1Calls, Mailbox

SLOT_BYTES = 1 << 20
NAMESPACE = b"reserve-test-ns!"
TIMEOUT_S = 10.0


def h(n: int) -> bytes:
    return n.to_bytes(BLOCK_HASH_BYTES, "big")


@pytest.fixture
def kvstore_port(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    with start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)):
        yield port


def link(port: int, rank_id: str) -> KvStoreLink:
    return KvStoreLink(f"127.0.0.1:{port}", rank_id, uuid.uuid4().hex, timeout_s=TIMEOUT_S)


def test_reserved_slots_take_blocks_named_at_commit(kvstore_port: int) -> None:
    writer, reader = link(kvstore_port, "rank-a"), link(kvstore_port, "rank-b")
    try:
        layout = writer.attach(SLOT_BYTES, NAMESPACE)
        assert reader.attach(SLOT_BYTES, NAMESPACE) == layout
        slots = writer.reserve(layout.arena_id, 3)
        assert len(set(slots)) == 3 and all(0 <= slot < layout.num_slots for slot in slots)
        held = kvstore_stats(kvstore_port)
        assert (held.writing_slots, held.pinned_slots, held.stored_slots) == (3, 3, 0)
        assert reader.lookup(layout.arena_id, [h(1)]) == []  # nothing is named yet

        # The bytes go in before the kvstore learns which blocks they are.
        arena = np.memmap(layout.path, dtype=np.uint8, mode="r+", shape=(layout.arena_bytes,))
        blocks = [np.full(SLOT_BYTES, 40 + i, dtype=np.uint8) for i in range(3)]
        for slot, block in zip(slots, blocks, strict=True):
            arena[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES] = block
        arena.flush()
        writer.commit(layout.arena_id, slots, block_hashes=[h(1), h(2), h(3)])

        found = reader.lookup(layout.arena_id, [h(1), h(2), h(3), h(4)])
        assert found == slots
        for slot, block in zip(found, blocks, strict=True):
            assert np.array_equal(arena[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES], block)
        reader.release(layout.arena_id, found, restored=True)
        events = reader.kv_events()
        try:
            snapshot = next(iter(events))
        finally:
            events.cancel()
        stored = {
            block_hash
            for event in snapshot.events
            if event.kind is KvEventKind.STORED
            for block_hash in event.block_hashes
        }
        assert stored == {h(1), h(2), h(3)}

        # The reader copied h2 too (the writer got there first): its slot goes back to free, h2 keeps the first.
        spare = reader.reserve(layout.arena_id, 2)
        assert not set(spare) & set(slots)
        reader.commit(layout.arena_id, spare, block_hashes=[h(2), h(5)])
        assert reader.lookup(layout.arena_id, [h(2), h(5)]) == [slots[1], spare[1]]
        reader.release(layout.arena_id, [slots[1], spare[1]])
        stats = kvstore_stats(kvstore_port)
        assert (stats.stored_slots, stats.writing_slots, stats.pinned_slots) == (4, 0, 0)
        assert stats.free_slots == layout.num_slots - 4 and stats.stored_total == 4

        # A reservation given up is free again.
        given_up = writer.reserve(layout.arena_id, 1)
        writer.release(layout.arena_id, given_up)
        assert kvstore_stats(kvstore_port).free_slots == layout.num_slots - 4
        del arena
    finally:
        writer.close()
        reader.close()


def test_the_tiers_call_thread_reserves_and_commits_named_blocks(kvstore_port: int) -> None:
    client = link(kvstore_port, "rank-a")
    mailbox = Mailbox()
    calls = L1Calls(client, mailbox)
    try:
        layout = client.attach(SLOT_BYTES, NAMESPACE)
        reserve = L1Call(CallKind.RESERVE, epoch=0, arena_id=layout.arena_id, count=2)
        calls.submit(reserve)
        assert wait_for(mailbox) == [reserve] and reserve.error is None and len(reserve.answer) == 2
        commit = L1Call(CallKind.COMMIT, epoch=0, arena_id=layout.arena_id, slots=reserve.answer, hashes=[h(7), h(8)])
        calls.submit(commit)
        assert wait_for(mailbox) == [commit] and commit.error is None
        assert client.lookup(layout.arena_id, [h(7), h(8)]) == reserve.answer
    finally:
        calls.close()
        client.close()


def wait_for(mailbox: Mailbox) -> list[object]:
    deadline = time.monotonic() + TIMEOUT_S
    while not mailbox and time.monotonic() < deadline:
        mailbox.wait(deadline - time.monotonic())
    return mailbox.take()


def test_refusals_reach_the_rank_as_unavailable_or_stale(kvstore_port: int) -> None:
    client = link(kvstore_port, "rank-a")
    try:
        layout = client.attach(SLOT_BYTES, NAMESPACE)
        with pytest.raises(L1UnavailableError, match=rf"INVALID_ARGUMENT: count {layout.num_slots + 1} must be 0"):
            client.reserve(layout.arena_id, layout.num_slots + 1)
        with pytest.raises(L1UnavailableError, match="INVALID_ARGUMENT: count -1"):
            client.reserve(layout.arena_id, -1)
        with pytest.raises(L1StaleArenaError, match="attach again"):
            client.reserve("an-old-arena", 1)
        reserved = client.reserve(layout.arena_id, 1)
        allocated = client.allocate(layout.arena_id, [h(1)])
        with pytest.raises(L1UnavailableError, match="came from Reserve"):
            client.commit(layout.arena_id, reserved)
        with pytest.raises(L1UnavailableError, match="came from Allocate"):
            client.commit(layout.arena_id, [*reserved, *allocated], block_hashes=[h(2), h(3)])
        with pytest.raises(L1UnavailableError, match="2 block_hashes for 1 slots"):
            client.commit(layout.arena_id, reserved, block_hashes=[h(2), h(3)])
        with pytest.raises(L1UnavailableError, match="block_hashes"):
            client.commit(layout.arena_id, reserved, block_hashes=[b"short"])
        stats = kvstore_stats(kvstore_port)
        assert (stats.writing_slots, stats.stored_slots) == (2, 0)  # every refusal changed nothing
        assert client.reserve(layout.arena_id, 0) == []  # renews, takes nothing
        client.commit(layout.arena_id, reserved, block_hashes=[h(2)])
        client.commit(layout.arena_id, allocated)
        assert client.lookup(layout.arena_id, [h(1), h(2)]) == [*allocated, *reserved]
    finally:
        client.close()
