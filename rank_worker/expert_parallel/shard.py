"""Which routed experts a rank of an expert-parallel group holds: a contiguous 1/size of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of a group of `size` holds routed experts [rank * n / size, (rank + 1) * n / size)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"expert-parallel rank {self.rank} is outside a group of {self.size}")

    def check(self, n_routed: int) -> None:
        """Refuse a model whose routed experts do not split evenly (every rank must hold as many)."""
        if n_routed % self.size:
            raise ValueError(f"expert_parallel_size {self.size} does not divide the model's {n_routed} routed experts")

    def experts(self, n_routed: int) -> range:
        """The global ids of the routed experts this rank holds."""
        self.check(n_routed)
        count = n_routed // self.size
        return range(self.rank * count, (self.rank + 1) * count)

    @property
    def whole(self) -> bool:
        return self.size == 1


WHOLE = ExpertShard()
