"""The reuse a request may expect from the trace: its longest hash-id prefix shared with anything sent
before it (in the same step), whichever agent sent it. This is what an infinite cache would serve."""

from __future__ import annotations

from loadgen.traces import TraceTurn


class SentPrefixes:
    """A trie of the hash-id sequences sent so far."""

    def __init__(self) -> None:
        self._root: dict[int, dict] = {}

    def shared_blocks(self, hash_ids: tuple[int, ...]) -> int:
        """How many leading ids of hash_ids some earlier request already sent."""
        node = self._root
        depth = 0
        for hash_id in hash_ids:
            child = node.get(hash_id)
            if child is None:
                break
            node = child
            depth += 1
        return depth

    def add(self, hash_ids: tuple[int, ...]) -> None:
        node = self._root
        for hash_id in hash_ids:
            node = node.setdefault(hash_id, {})

    def expected_reuse(self, turn: TraceTurn) -> float:
        """The fraction of the turn's input tokens covered by an already-sent prefix of its ids (0 to 1)."""
        if turn.input_tokens <= 0:
            return 0.0
        return min(1.0, self.shared_blocks(turn.hash_ids) * turn.block_tokens / turn.input_tokens)
