"""KV events in vLLM's wire format (contracts/vllm_kv_events.py), decoded by a subscriber written from vLLM's
documented format (tests/vllm_kv_subscriber.py): the encoding (maps tagged by "type", or legacy arrays), the
PUB frames and sequences, the replay socket and its ring buffer, and a publisher that never blocks its caller."""

from __future__ import annotations

import time

import msgspec
import pytest
from service_processes import free_port
from vllm_kv_subscriber import (
    DECODER,
    LEGACY_DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    LegacyBlockStored,
    Subscriber,
    events_of,
)

from contracts.kv_events import KvEvent, KvEventKind
from contracts.vllm_kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    VllmKvEventPublisher,
    check_endpoint,
    encode_batch,
)

H = [bytes([i]) * 16 for i in range(8)]
STORED = KvEvent(KvEventKind.STORED, (H[1], H[2]), H[0], tuple(range(8)))


def test_a_batch_is_an_array_of_ts_events_rank_and_each_event_a_map_tagged_by_type() -> None:
    events = [KvEvent(KvEventKind.ALL_CLEARED), STORED, KvEvent(KvEventKind.REMOVED, (H[3],))]
    payload = encode_batch(events, medium=MEDIUM_GPU, block_size=4, ts=12.5)
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 12.5 and raw[2] == 0 and len(raw) == 3
    assert raw[1][0] == {"type": "AllBlocksCleared"}
    assert raw[1][1] == {
        "type": "BlockStored",
        "block_hashes": [H[1], H[2]],
        "parent_block_hash": H[0],
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [H[3]], "medium": "GPU"}
    batch = DECODER.decode(payload)
    cleared, stored, removed = batch.events
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == [H[1], H[2]] and stored.parent_block_hash == H[0]
    assert stored.token_ids == list(range(8)) and stored.block_size == 4 and stored.medium == "GPU"
    assert removed.block_hashes == [H[3]] and removed.medium == "GPU"


def test_the_legacy_array_encoding_puts_the_tag_first() -> None:
    payload = encode_batch([STORED], medium=MEDIUM_CPU, block_size=4, ts=1.0, encoding="array")
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][:5] == ["BlockStored", [H[1], H[2]], H[0], list(range(8)), 4]
    assert raw[1][0][5:7] == [None, "CPU"]
    (stored,) = LEGACY_DECODER.decode(payload).events
    assert isinstance(stored, LegacyBlockStored) and stored.medium == "CPU" and stored.parent_block_hash == H[0]


def test_stored_without_a_chain_has_no_parent_and_no_tokens_and_empty_runs_are_left_out() -> None:
    events = [
        KvEvent(KvEventKind.STORED, (H[4],)),
        KvEvent(KvEventKind.STORED, ()),
        KvEvent(KvEventKind.REMOVED, ()),
    ]
    (stored,) = DECODER.decode(encode_batch(events, medium=MEDIUM_CPU, block_size=16, ts=0.0)).events
    assert stored.block_hashes == [H[4]] and stored.parent_block_hash is None and stored.token_ids == []


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557", "tcp://h:0", "udp://h:1"])
def test_malformed_endpoints_are_refused(endpoint: str) -> None:
    with pytest.raises(ValueError):
        check_endpoint(endpoint)


def publisher(**options: object) -> VllmKvEventPublisher:
    return VllmKvEventPublisher(
        f"tcp://127.0.0.1:{free_port()}",
        medium=MEDIUM_GPU,
        block_size=4,
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic="kv@test",
        **options,  # type: ignore[arg-type]
    )


def wait_sent(pub: VllmKvEventPublisher, count: int) -> None:
    deadline = time.monotonic() + 10
    while pub.sequence < count:
        assert time.monotonic() < deadline, f"{pub.sequence} of {count} batches sent"
        time.sleep(0.01)


def wait_joined(pub: VllmKvEventPublisher, sub: Subscriber) -> int:
    """ZMQ's slow joiner: publish a marker batch until the SUB gets one live, then wait until every marker is
    sent and drain them; returns how many were published."""
    deadline = time.monotonic() + 10
    published = 0
    while time.monotonic() < deadline:
        pub.publish([KvEvent(KvEventKind.ALL_CLEARED)])
        published += 1
        if sub.receive(0.1) is not None:
            wait_sent(pub, published)
            while sub.receive(0.05) is not None:
                pass
            return published
    raise AssertionError("the subscriber never got a live batch")


def test_pub_frames_sequences_and_replay_follow_vllm() -> None:
    pub = publisher(buffer_steps=4)
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@")
    try:
        marker_count = wait_joined(pub, sub)
        pub.publish([STORED])
        pub.publish([KvEvent(KvEventKind.REMOVED, (H[1],))])
        live = [sub.receive(5), sub.receive(5)]
        assert [item.sequence for item in live if item] == [marker_count, marker_count + 1]

        # Replay from the start: the ring keeps the last 4 batches, in order, then the end marker.
        replayed = sub.replay_from(0)
        assert [item.sequence for item in replayed] == list(range(max(0, marker_count - 2), marker_count + 2))
        assert [type(e) for e in events_of(replayed)[-2:]] == [BlockStored, BlockRemoved]
        # From a later sequence: only those from there; past the end: the end marker alone.
        assert [item.sequence for item in sub.replay_from(marker_count + 1)] == [marker_count + 1]
        assert sub.replay_from(marker_count + 10) == []
    finally:
        sub.close()
        pub.close()


def test_publish_never_waits_and_every_batch_is_sent_or_counted_dropped() -> None:
    pub = publisher(max_queued=3)
    try:
        started = time.perf_counter()
        for _ in range(1000):
            pub.publish([STORED])
        pub.publish([])  # nothing to send: no batch
        assert time.perf_counter() - started < 1.0
    finally:
        pub.close()
    assert pub.sequence + pub.dropped_batches == 1000


def test_close_sends_what_is_queued_and_later_batches_are_ignored() -> None:
    pub = publisher()
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, topic="kv@")
    try:
        before = wait_joined(pub, sub)
        for _ in range(5):
            pub.publish([STORED])
        pub.close()
        assert pub.sequence == before + 5
        pub.publish([STORED])
        pub.close()  # idempotent
        assert pub.sequence == before + 5
    finally:
        sub.close()


def test_a_taken_port_is_an_os_error() -> None:
    pub = publisher()
    try:
        with pytest.raises(OSError, match="cannot bind"):
            VllmKvEventPublisher(pub.endpoint, medium=MEDIUM_GPU, block_size=4)
    finally:
        pub.close()
