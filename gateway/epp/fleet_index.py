"""Which node holds which prefix: the blocks each publisher of each node reported stored and not yet removed.

One set of block hashes per KV event source (a rank's L0, medium GPU; the node's kvstore, medium CPU). A prompt
matches a source by the leading run of its block hashes found there (a chain hash stands for its whole prefix,
so the run ends at the first miss). A node offers the longest L0 run of any of its ranks (the node router sends
the request to that rank) and, after it, what its L1 holds.

The index is a hint: a block reported removed late, or a gap in a source's events, only makes a choice
worse, never wrong (the node's own router and ranks look up what they really hold). A gap that replay cannot
fill, or a publisher that restarted (its sequence went back), clears that source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from contracts.vllm_kv_events import MEDIUM_CPU


@dataclass(frozen=True)
class NodeMatch:
    l0_blocks: int  # leading blocks the node's best rank holds
    l1_blocks: int  # the blocks after those that its L1 holds


@dataclass
class _Source:
    node: str
    medium: str  # "" until its first stored event names one
    blocks: set[bytes]


def _key(block_hash: bytes | int) -> bytes:
    # vLLM sends ints (the low 8 bytes of its hash); we send our 16-byte hashes as bytes. Index what came.
    return block_hash if isinstance(block_hash, bytes) else block_hash.to_bytes(8, "big", signed=block_hash < 0)


class FleetIndex:
    def __init__(self) -> None:
        self._sources: dict[str, _Source] = {}  # source id (the publisher's endpoint) -> its blocks

    def add_source(self, source_id: str, node: str) -> None:
        self._sources.setdefault(source_id, _Source(node, "", set()))

    def stored(self, source_id: str, block_hashes: Iterable[bytes | int], medium: str | None) -> None:
        source = self._sources[source_id]
        if medium:
            source.medium = medium
        source.blocks.update(_key(h) for h in block_hashes)

    def removed(self, source_id: str, block_hashes: Iterable[bytes | int]) -> None:
        blocks = self._sources[source_id].blocks
        for block_hash in block_hashes:
            blocks.discard(_key(block_hash))

    def cleared(self, source_id: str) -> None:
        self._sources[source_id].blocks.clear()

    def blocks(self, node: str) -> int:
        return sum(len(source.blocks) for source in self._sources.values() if source.node == node)

    def match(self, node: str, prompt_hashes: Sequence[bytes]) -> NodeMatch:
        """The node's cached prefix of a prompt whose full blocks hash to `prompt_hashes` (in order)."""
        l0 = 0
        host: list[set[bytes]] = []
        for source in self._sources.values():
            if source.node != node:
                continue
            if source.medium == MEDIUM_CPU:
                host.append(source.blocks)
                continue
            l0 = max(l0, _leading(source.blocks, prompt_hashes))
        end = l0
        while end < len(prompt_hashes) and any(prompt_hashes[end] in blocks for blocks in host):
            end += 1
        return NodeMatch(l0, end - l0)


def _leading(blocks: set[bytes], hashes: Sequence[bytes]) -> int:
    count = 0
    for block_hash in hashes:
        if block_hash not in blocks:
            break
        count += 1
    return count
