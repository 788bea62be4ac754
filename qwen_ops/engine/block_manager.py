"""Physical KV-block allocator: a free list of block ids, lowest ids first."""

from __future__ import annotations

import heapq
from typing import Iterable


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks = {num_blocks}, expected >= 1")
        self._total = num_blocks
        self._free = list(range(num_blocks))  # a heap
        self._is_free = [True] * num_blocks

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free of {self._total}")
        out = [heapq.heappop(self._free) for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._is_free[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._is_free[b] = True
            heapq.heappush(self._free, b)

    def grow(self, num_blocks: int) -> None:
        """Add blocks ``num_total .. num_blocks - 1`` to the free list."""
        for b in range(self._total, num_blocks):
            self._is_free.append(True)
            heapq.heappush(self._free, b)
        self._total = max(self._total, num_blocks)
