"""The real kvstore process over real gRPC: two "ranks" share blocks through the mapped arena file,
events reach subscribers, bad input is refused while the service keeps serving, restarts void old
arenas, SIGTERM removes the arena and a SIGKILLed kvstore's arena is removed by the next start."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from contracts import internal_auth
from contracts.block_hash import BLOCK_HASH_BYTES
from protos import kv_events_pb2 as events_pb
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from tests.service_processes import ROOT, free_port, service_env, start_kvstore

ARENA_GB = "0.05"
SLOT_BYTES = 1 << 20
NAMESPACE = b"test-namespace-1"
STORED = events_pb.KV_EVENT_KIND_STORED
REMOVED = events_pb.KV_EVENT_KIND_REMOVED
ALL_CLEARED = events_pb.KV_EVENT_KIND_ALL_CLEARED
TIMEOUT_S = 10


def h(n: int) -> bytes:
    return n.to_bytes(BLOCK_HASH_BYTES, "big")


def kvstore_settings(arena_dir: Path) -> dict[str, str]:
    return {"KVSERVE_L1_HOST_GB": ARENA_GB, "KVSERVE_L1_ARENA_DIR": str(arena_dir), "KVSERVE_L1_HEADROOM_GB": "0"}


def arena_files(arena_dir: Path) -> list[Path]:
    return sorted(arena_dir.glob("kvserve-l1-*"))


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[pb_grpc.KvStoreStub]:
    port = free_port()
    with (
        start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(tmp_path)),
        internal_auth.channel(f"127.0.0.1:{port}") as channel,
    ):
        yield pb_grpc.KvStoreStub(channel)


class EventReader:
    """A KvEvents stream read on a thread, so a test can wait for each batch with a deadline."""

    def __init__(self, stub: pb_grpc.KvStoreStub) -> None:
        self._call = stub.KvEvents(events_pb.KvEventsRequest(), timeout=60)
        self._batches: queue.Queue[events_pb.KvEventBatch] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self._call:
                self._batches.put(batch)
        except grpc.RpcError:
            pass  # cancelled at the end of the test

    def next(self) -> events_pb.KvEventBatch:
        return self._batches.get(timeout=TIMEOUT_S)

    def close(self) -> None:
        self._call.cancel()


def attach(stub: pb_grpc.KvStoreStub, rank_id: str, incarnation: str = "1") -> pb.AttachResponse:
    request = pb.AttachRequest(
        rank_id=rank_id, incarnation=incarnation, slot_bytes=SLOT_BYTES, hash_namespace=NAMESPACE
    )
    return stub.Attach(request, timeout=TIMEOUT_S)


def expect_error(code: grpc.StatusCode, call: object, *args: object, match: str = "") -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, timeout=TIMEOUT_S)  # type: ignore[operator]
    assert caught.value.code() == code, caught.value.details()
    assert match in caught.value.details()


def test_two_ranks_share_blocks_through_the_arena(stub: pb_grpc.KvStoreStub, tmp_path: Path) -> None:
    stats = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S)
    assert stats.slot_bytes == 0 and stats.num_slots == 0  # no rank attached yet
    assert stats.budget_requested_bytes == stats.arena_bytes > 0 and stats.budget_reason == ""
    events = EventReader(stub)
    snapshot = events.next()
    assert snapshot.sequence == 1 and [event.kind for event in snapshot.events] == [ALL_CLEARED, STORED]
    try:
        writer = attach(stub, "rank-a")
        assert writer.arena_id == stats.arena_id and writer.slot_bytes == SLOT_BYTES
        assert writer.num_slots == writer.arena_bytes // SLOT_BYTES
        arena_path = Path(writer.arena_path)
        assert arena_files(tmp_path) == [arena_path] and arena_path.stat().st_size == writer.arena_bytes

        hashes = [h(1), h(2), h(3)]
        slots = list(
            stub.Allocate(pb.AllocateRequest(rank_id="rank-a", arena_id=writer.arena_id, block_hashes=hashes)).slots
        )
        assert len(set(slots)) == 3 and all(0 <= slot < writer.num_slots for slot in slots)
        # The rank copies its blocks into the shared file itself; the kvstore never touches the bytes.
        rank_a_view = np.memmap(arena_path, dtype=np.uint8, mode="r+", shape=(writer.arena_bytes,))
        blocks = [np.full(SLOT_BYTES, 10 + i, dtype=np.uint8) for i in range(3)]
        for slot, block in zip(slots, blocks, strict=True):
            rank_a_view[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES] = block
        rank_a_view.flush()
        stub.Commit(pb.CommitRequest(rank_id="rank-a", arena_id=writer.arena_id, slots=slots), timeout=TIMEOUT_S)
        stored = events.next()
        assert stored.sequence == 2
        assert [(event.kind, list(event.block_hashes)) for event in stored.events] == [(STORED, hashes)]

        reader = attach(stub, "rank-b")
        assert reader.arena_id == writer.arena_id and reader.num_slots == writer.num_slots
        lookup = pb.LookupRequest(rank_id="rank-b", arena_id=reader.arena_id, block_hashes=[*hashes, h(99), h(4)])
        found = list(stub.Lookup(lookup, timeout=TIMEOUT_S).slots)
        assert found == slots
        rank_b_view = np.memmap(reader.arena_path, dtype=np.uint8, mode="r", shape=(reader.arena_bytes,))
        for slot, block in zip(found, blocks, strict=True):
            assert np.array_equal(rank_b_view[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES], block)
        pinned = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S)
        assert (pinned.stored_slots, pinned.pinned_slots, pinned.lookup_blocks, pinned.hit_blocks) == (3, 3, 5, 3)
        # Dedup across ranks: what rank-a stored (and rank-b is reading) is not written again by rank-b.
        again = stub.Allocate(pb.AllocateRequest(rank_id="rank-b", arena_id=reader.arena_id, block_hashes=hashes))
        assert list(again.slots) == [-1, -1, -1]

        # h3 read and not copied: the most recent; h1, h2 copied into rank-b's pool (restored): evicted first
        release = pb.ReleaseRequest(rank_id="rank-b", arena_id=reader.arena_id, slots=found[2:])
        stub.Release(release, timeout=TIMEOUT_S)
        release = pb.ReleaseRequest(rank_id="rank-b", arena_id=reader.arena_id, slots=found[:2], restored=True)
        stub.Release(release, timeout=TIMEOUT_S)

        # Filling the arena evicts the unpinned blocks, least recently used first, announced as REMOVED: the
        # restored ones first, the last of their run first (h2, h1), then h3.
        filled: list[int] = []
        for fill in ([h(1000 + i) for i in range(writer.num_slots - 2)], [h(2000), h(2001)]):
            request = pb.AllocateRequest(rank_id="rank-b", arena_id=reader.arena_id, block_hashes=fill)
            filled += list(stub.Allocate(request).slots)
        assert filled.count(-1) == 0
        removed = [events.next(), events.next()]
        assert [[(event.kind, list(event.block_hashes)) for event in batch.events] for batch in removed] == [
            [(REMOVED, [h(2)])],
            [(REMOVED, [h(1), h(3)])],
        ]
        stub.Release(pb.ReleaseRequest(rank_id="rank-b", arena_id=reader.arena_id, slots=filled), timeout=TIMEOUT_S)

        final = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S)
        assert (final.free_slots, final.stored_slots, final.writing_slots, final.pinned_slots) == (
            final.num_slots,
            0,
            0,
            0,
        )
        assert (final.stored_total, final.evicted_total, final.slot_bytes) == (3, 3, SLOT_BYTES)

        # A late subscriber (a restarted router) starts from a snapshot with its own sequence numbers.
        late = EventReader(stub)
        assert late.next().sequence == 1
        late.close()
        del rank_a_view, rank_b_view
    finally:
        events.close()


def test_bad_input_is_refused_and_the_service_keeps_serving(stub: pb_grpc.KvStoreStub) -> None:
    arena = attach(stub, "rank-a")
    arena_id = arena.arena_id
    invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

    expect_error(
        invalid,
        stub.Allocate,
        pb.AllocateRequest(rank_id="rank-a", arena_id=arena_id, block_hashes=[b"short"]),
        match=f"{BLOCK_HASH_BYTES} bytes",
    )
    expect_error(
        invalid, stub.Lookup, pb.LookupRequest(rank_id="rank-a", arena_id=arena_id, block_hashes=[h(1) + b"x"])
    )
    expect_error(
        invalid,
        stub.Release,
        pb.ReleaseRequest(rank_id="rank-a", arena_id=arena_id, slots=[arena.num_slots]),
        match="out of range",
    )
    expect_error(
        invalid, stub.Commit, pb.CommitRequest(rank_id="rank-a", arena_id=arena_id, slots=[-5]), match="out of range"
    )
    expect_error(
        invalid, stub.Release, pb.ReleaseRequest(rank_id="rank-a", arena_id=arena_id, slots=[0]), match="not pinned"
    )
    expect_error(
        invalid,
        stub.Commit,
        pb.CommitRequest(rank_id="rank-a", arena_id=arena_id, slots=[0]),
        match="not being written",
    )
    expect_error(
        invalid,
        stub.Attach,
        pb.AttachRequest(rank_id="", incarnation="1", slot_bytes=SLOT_BYTES, hash_namespace=NAMESPACE),
    )
    expect_error(
        invalid,
        stub.Attach,
        pb.AttachRequest(rank_id="rank-x", incarnation="1", slot_bytes=0, hash_namespace=NAMESPACE),
    )
    mismatch = pb.AttachRequest(rank_id="rank-x", incarnation="1", slot_bytes=SLOT_BYTES // 2, hash_namespace=NAMESPACE)
    expect_error(precondition, stub.Attach, mismatch, match="slot_bytes")
    other_model = pb.AttachRequest(
        rank_id="rank-x", incarnation="1", slot_bytes=SLOT_BYTES, hash_namespace=b"another-model-ns"
    )
    expect_error(precondition, stub.Attach, other_model, match="hash_namespace")
    expect_error(
        precondition,
        stub.Allocate,
        pb.AllocateRequest(rank_id="rank-a", arena_id="old", block_hashes=[h(1)]),
        match="attach again",
    )
    expect_error(
        precondition,
        stub.Lookup,
        pb.LookupRequest(rank_id="nobody", arena_id=arena_id, block_hashes=[h(1)]),
        match="Attach first",
    )

    expect_error(
        invalid,
        stub.Reserve,
        pb.ReserveRequest(rank_id="rank-a", arena_id=arena_id, count=arena.num_slots + 1),
        match=f"must be 0 to {arena.num_slots}",
    )
    expect_error(
        precondition, stub.Reserve, pb.ReserveRequest(rank_id="rank-a", arena_id="old", count=1), match="attach again"
    )

    # Still serving, and nothing changed.
    slots = list(stub.Allocate(pb.AllocateRequest(rank_id="rank-a", arena_id=arena_id, block_hashes=[h(1)])).slots)
    assert slots == [0]
    reserved = list(stub.Reserve(pb.ReserveRequest(rank_id="rank-a", arena_id=arena_id, count=1)).slots)
    assert reserved == [1]
    mixed = pb.CommitRequest(rank_id="rank-a", arena_id=arena_id, slots=[*slots, *reserved], block_hashes=[h(2), h(3)])
    expect_error(invalid, stub.Commit, mixed, match="came from Allocate")
    stats = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S)
    assert (stats.writing_slots, stats.stored_slots, stats.pinned_slots) == (2, 0, 2)
    # A restarted rank (a new incarnation) drops its old write pins, reserved or not.
    attach(stub, "rank-a", incarnation="2")
    assert stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S).writing_slots == 0


def test_restarts_void_old_arenas_and_clean_up_their_files(tmp_path: Path) -> None:
    settings = kvstore_settings(tmp_path)
    port = free_port()
    with (
        start_kvstore(tmp_path / "first.log", port, **settings) as first,
        internal_auth.channel(f"127.0.0.1:{port}") as channel,
    ):
        old = attach(pb_grpc.KvStoreStub(channel), "rank-a")
        first.kill()  # SIGKILL: no chance to remove its arena
        first.wait(timeout=TIMEOUT_S)
    assert arena_files(tmp_path) == [Path(old.arena_path)]

    with (
        start_kvstore(tmp_path / "second.log", port, **settings) as second,
        internal_auth.channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = pb_grpc.KvStoreStub(channel)
        new_arena = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S)
        assert new_arena.arena_id != old.arena_id
        assert [path.name for path in arena_files(tmp_path)] == [
            f"kvserve-l1-{new_arena.arena_id}"
        ]  # the stale one is gone
        stale = pb.AllocateRequest(rank_id="rank-a", arena_id=old.arena_id, block_hashes=[h(1)])
        expect_error(grpc.StatusCode.FAILED_PRECONDITION, stub.Allocate, stale, match="attach again")
        assert attach(stub, "rank-a").arena_id == new_arena.arena_id
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=TIMEOUT_S) == 0
    assert arena_files(tmp_path) == []
    assert "removed a stale arena" in (tmp_path / "second.log").read_text()


def test_pins_nobody_releases_expire(tmp_path: Path) -> None:
    port = free_port()
    settings = {**kvstore_settings(tmp_path), "KVSERVE_L1_PIN_TTL_SECS": "0.3"}
    with (
        start_kvstore(tmp_path / "kvstore.log", port, **settings),
        internal_auth.channel(f"127.0.0.1:{port}") as channel,
    ):
        stub = pb_grpc.KvStoreStub(channel)
        arena = attach(stub, "rank-a")
        stub.Allocate(pb.AllocateRequest(rank_id="rank-a", arena_id=arena.arena_id, block_hashes=[h(1)]))
        assert stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S).pinned_slots == 1
        deadline = time.monotonic() + TIMEOUT_S
        while stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S).pinned_slots and time.monotonic() < deadline:
            time.sleep(0.1)  # the copier "died": the sweep drops its pin after the TTL
        stats = stub.Stats(pb.StatsRequest(), timeout=TIMEOUT_S)
        assert (stats.pinned_slots, stats.writing_slots, stats.free_slots) == (0, 0, stats.num_slots)


def test_a_missing_arena_dir_is_created_private(tmp_path: Path) -> None:
    arena_dir = tmp_path / "made" / "l1"
    port = free_port()
    with (
        start_kvstore(tmp_path / "kvstore.log", port, **kvstore_settings(arena_dir)),
        internal_auth.channel(f"127.0.0.1:{port}") as channel,
    ):
        arena = attach(pb_grpc.KvStoreStub(channel), "rank-a")
        assert Path(arena.arena_path).parent == arena_dir
        assert arena_dir.stat().st_mode & 0o777 == 0o700
    assert f"created the arena dir {arena_dir}" in (tmp_path / "kvstore.log").read_text()


def test_an_arena_dir_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    arena_dir = tmp_path / "a-file" / "l1"  # under a regular file: no directory can be made there
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "--port", str(free_port())],
        cwd=ROOT,
        env=service_env(**kvstore_settings(arena_dir)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"l1_arena_dir {arena_dir} does not exist and cannot be created" in result.stderr, result.stderr
    assert "KVSERVE_L1_ARENA_DIR" in result.stderr


def test_no_ram_exits_1_and_l1_disabled_exits_2(tmp_path: Path) -> None:
    env = service_env(KVSERVE_L1_ARENA_DIR=str(tmp_path), KVSERVE_L1_HOST_GB=ARENA_GB, KVSERVE_L1_HEADROOM_GB="1000000")
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "no RAM for the L1 arena" in result.stderr and "l1_headroom_gb" in result.stderr

    for settings in ({"KVSERVE_L1_HOST_GB": "0"}, {"KVSERVE_L1_CACHE": "false", "KVSERVE_L1_HOST_GB": ARENA_GB}):
        env = service_env(KVSERVE_L1_ARENA_DIR=str(tmp_path), **settings)
        result = subprocess.run(
            [sys.executable, "-m", "kvstore", "--port", str(free_port())],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and "L1 disabled" in result.stderr
    assert arena_files(tmp_path) == []
