"""Token ids for a trace turn with exactly the trace's reuse pattern, sized as the load generator sizes them.

Every hash id maps to its own run of token ids (equal ids -> equal tokens, different ids -> different
tokens), so the real prefix cache finds exactly the reuse the trace describes. Sizes follow
loadgen/content.py: a block holds block_tokens * context_scale tokens (floor or ceil, dithered by the id
with the load generator's own function, so the mean is exact) and the last block is cut to the turn's
scaled input size. No model runs in the simulator, so the ids only need to be distinct integers: a
block's run starts at a compact index per hash id (trace ids reach 10^19, beyond int64).
"""

from __future__ import annotations

from loadgen.content import block_word_count
from loadgen.traces import TraceTurn

RUN_STRIDE = 1 << 20  # token ids per hash id: more than any block holds


class PromptTokens:
    """Builds prompts for one replay; the id -> token-run mapping is shared by all agents of the replay."""

    def __init__(self, context_scale: float = 1.0) -> None:
        if context_scale <= 0:
            raise ValueError("context_scale must be positive")
        self.context_scale = context_scale
        self._runs: dict[int, int] = {}

    def block_lengths(self, turn: TraceTurn) -> list[int]:
        """Tokens per hash id of the turn: full blocks, the last one cut to the scaled input size."""
        per_block = turn.block_tokens * self.context_scale
        counts = [block_word_count(h, per_block) for h in turn.hash_ids]
        if counts:
            wanted = turn.input_tokens * self.context_scale
            counts[-1] = max(0, min(counts[-1], round(wanted - sum(counts[:-1]))))
        return counts

    def tokens(self, turn: TraceTurn) -> list[int]:
        """The turn's prompt token ids (at least one token: an empty prompt is not a request)."""
        tokens: list[int] = []
        for hash_id, count in zip(turn.hash_ids, self.block_lengths(turn), strict=True):
            base = self._runs.setdefault(hash_id, len(self._runs) + 1) * RUN_STRIDE
            tokens.extend(range(base, base + count))
        return tokens or [0]
