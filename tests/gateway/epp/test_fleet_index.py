"""The EPP's index of what each node caches, fed by real vLLM-format publishers (contracts/vllm_kv_events.py) over
loopback TCP: stores and removals, a gap filled from the replay socket, a restarted publisher forgotten, and the
per-node match (the best rank's L0 run, then the node's L1)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import zmq.asyncio
from service_processes import free_port

from contracts.kv_events import KvEvent, KvEventKind
from contracts.vllm_kv_events import MEDIUM_CPU, MEDIUM_GPU, VllmKvEventPublisher
from gateway.epp.fleet_config import KvEventSource
from gateway.epp.fleet_index import FleetIndex
from gateway.epp.kv_event_subscriber import KvEventSubscriber

H = [bytes([n]) * 16 for n in range(10)]  # ten chained block hashes of one prompt


def stored(*hashes: bytes) -> KvEvent:
    return KvEvent(KvEventKind.STORED, tuple(hashes))


def removed(*hashes: bytes) -> KvEvent:
    return KvEvent(KvEventKind.REMOVED, tuple(hashes))


def test_match_takes_the_best_rank_then_the_nodes_l1() -> None:
    index = FleetIndex()
    for source, node in (("rank-a0", "a"), ("rank-a1", "a"), ("l1-a", "a"), ("rank-b0", "b")):
        index.add_source(source, node)
    index.stored("rank-a0", H[:2], MEDIUM_GPU)
    index.stored("rank-a1", H[:4], MEDIUM_GPU)
    index.stored("l1-a", [*H[:7], H[8]], MEDIUM_CPU)  # H[7] missing: the run ends there
    index.stored("rank-b0", [H[0], H[2]], MEDIUM_GPU)  # H[1] missing: only one block counts
    assert index.match("a", H) == (m := index.match("a", H)) and (m.l0_blocks, m.l1_blocks) == (4, 3)
    assert (index.match("b", H).l0_blocks, index.match("b", H).l1_blocks) == (1, 0)
    index.removed("rank-a1", [H[3]])
    assert (index.match("a", H).l0_blocks, index.match("a", H).l1_blocks) == (3, 4)
    index.cleared("l1-a")
    assert (index.match("a", H).l0_blocks, index.match("a", H).l1_blocks) == (3, 0)
    assert index.blocks("a") == 2 + 3 and index.match("c", H).l0_blocks == 0


def test_vllm_int_hashes_are_indexed_too() -> None:
    index = FleetIndex()
    index.add_source("vllm", "v")
    index.stored("vllm", [12345, -7], MEDIUM_GPU)
    keys = [(12345).to_bytes(8, "big"), (-7).to_bytes(8, "big", signed=True)]
    assert index.match("v", keys).l0_blocks == 2


async def _until(check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


def _publisher(port: int, replay: int, medium: str = MEDIUM_GPU) -> VllmKvEventPublisher:
    return VllmKvEventPublisher(
        f"tcp://127.0.0.1:{port}", medium=medium, block_size=16, replay_endpoint=f"tcp://127.0.0.1:{replay}"
    )


async def _rebound(port: int, replay: int) -> VllmKvEventPublisher:
    """A new publisher on the same ports, once the closed one's sockets have let go of them."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            return _publisher(port, replay)
        except OSError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _following(port: int, replay: int) -> AsyncIterator[tuple[FleetIndex, KvEventSubscriber]]:
    """A subscriber (node "a") following the publisher at these ports into a fresh index, while in the block."""
    index = FleetIndex()
    context = zmq.asyncio.Context()
    source = KvEventSource(endpoint=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{replay}")
    subscriber = KvEventSubscriber(context, source, "a", index)
    task = asyncio.create_task(subscriber.run())
    try:
        yield index, subscriber
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        context.term()


@pytest.mark.parametrize("medium", [MEDIUM_GPU, MEDIUM_CPU])
def test_subscriber_follows_a_publisher_from_before_it_connected(medium: str) -> None:
    async def scenario() -> None:
        port, replay = free_port(), free_port()
        publisher = _publisher(port, replay, medium)
        try:
            publisher.publish([stored(*H[:3])])  # before the subscriber exists: only replay can bring it
            await _until(lambda: publisher.sequence >= 1)
            async with _following(port, replay) as (index, subscriber):
                await _until(lambda: index.blocks("a") == 3)
                match = index.match("a", H)
                assert (match.l0_blocks, match.l1_blocks) == ((3, 0) if medium == MEDIUM_GPU else (0, 3))
                publisher.publish([stored(H[3])])  # live events after that
                publisher.publish([removed(H[0])])
                await _until(
                    lambda: (
                        index.blocks("a") == 3
                        and index.match("a", H[1:]).l0_blocks + index.match("a", H[1:]).l1_blocks == 3
                    )
                )
                assert subscriber.counts.gaps == 0
        finally:
            publisher.close()

    asyncio.run(scenario())


def test_a_restarted_publisher_is_forgotten() -> None:
    async def scenario() -> None:
        port, replay = free_port(), free_port()
        publisher = _publisher(port, replay)
        try:
            async with _following(port, replay) as (index, subscriber):
                for n in range(5):
                    publisher.publish([stored(H[n])])
                await _until(lambda: index.blocks("a") == 5)
                publisher.close()
                publisher = await _rebound(port, replay)  # the node restarted: its sequence starts again at 0
                # A batch sent before the SUB socket has reconnected is lost: send one at a time until one arrives
                # (while its sequence is still below the old publisher's last, which is what shows a restart).
                for _ in range(4):
                    publisher.publish([stored(H[9])])
                    await asyncio.sleep(0.3)
                    if subscriber.counts.restarts:
                        break
                await _until(lambda: subscriber.counts.restarts == 1 and index.blocks("a") == 1)
                assert index.match("a", [H[9]]).l0_blocks == 1 and index.match("a", H).l0_blocks == 0
        finally:
            publisher.close()

    asyncio.run(scenario())
