"""Physical KV-block allocators: a plain free list (lowest ids first), and the reference-counted,
content-addressed one behind automatic prefix caching."""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from typing import Callable, Iterable, Optional, Sequence


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


def _sha256_key(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's key: SHA-256 over the parent block's key, the salt and the token ids."""
    h = hashlib.sha256(parent)
    h.update(salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class PrefixCachingAllocator:
    """Reference-counted KV blocks whose full-block contents are addressable by hash (vLLM's
    automatic prefix caching; nano-vllm and SGLang do the same with hashed blocks or a radix tree).

    - A full block's key chains its parent's key with its token ids and a salt
      (``_sha256_key``): equal keys mean equal prefixes, so equal KV.
    - A block is shared by every slot that maps it (``acquire``); ``free`` drops one reference.
      A block whose count reaches zero stays cached, in an LRU free list, until ``allocate``
      needs it: allocation takes the least recently freed block and evicts its key.
      Unhashed blocks are freed to the front, so they go before any cached content.
    - Every cached block keeps its token ids and parent key: a lookup whose key matches but
      whose tokens do not (a hash collision) is a miss, counted in ``num_collisions``. A wrong
      block is never served, whatever the hash function.
    - Only full blocks are registered, and a slot only writes past its full blocks, so a
      shared block is never written.

    ``hash_fn(parent, salt, tokens) -> bytes`` is replaceable (tests force collisions with it).
    """

    def __init__(self, num_blocks: int, salt: bytes = b"", hash_fn: Callable[[bytes, bytes, Sequence[int]], bytes] = _sha256_key):
        if num_blocks < 1:
            raise ValueError(f"num_blocks = {num_blocks}, expected >= 1")
        self.salt = salt
        self.hash_fn = hash_fn
        self._ref = [0] * num_blocks
        self._key: list[Optional[bytes]] = [None] * num_blocks
        self._content: list[Optional[tuple[bytes, tuple[int, ...]]]] = [None] * num_blocks   # (parent, tokens)
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))   # LRU first
        self._cached: dict[bytes, int] = {}
        self.num_collisions = 0
        self.num_evictions = 0

    @property
    def num_total(self) -> int:
        return len(self._ref)

    @property
    def num_free(self) -> int:
        """Blocks with no reference: never used, or holding cached content that allocation may evict."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is addressable (referenced or not)."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def key_of(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        return self.hash_fn(parent, self.salt, tokens)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: asked for {n}, {len(self._free)} free of {self.num_total}")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._forget(b, evicted=True)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        # The tail of a sequence is the least likely to be shared: free it first, so it is evicted first.
        for b in reversed(list(blocks)):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._key[b] is None:
                    self._free.move_to_end(b, last=False)

    def lookup(self, parent: bytes, tokens: Sequence[int]) -> tuple[bytes, Optional[int]]:
        """``(key, block)`` of the full block ``tokens`` after the prefix ``parent``; block None on a miss."""
        key = self.key_of(parent, tokens)
        b = self._cached.get(key)
        if b is None:
            return key, None
        if self._content[b] != (parent, tuple(tokens)):
            self.num_collisions += 1
            return key, None
        return key, b

    def acquire(self, block: int) -> None:
        """One more reference to a cached block (taking it off the free list if it was there)."""
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def register(self, block: int, key: bytes, parent: bytes, tokens: Sequence[int]) -> bool:
        """Make a full, written block addressable under ``key``; False if that key is cached already."""
        if key in self._cached or self._key[block] is not None:
            return False
        self._cached[key] = block
        self._key[block] = key
        self._content[block] = (parent, tuple(tokens))
        return True

    def reset_cache(self) -> None:
        """Forget every cached content (the weights changed); references are untouched."""
        for b in list(self._cached.values()):
            self._forget(b, evicted=False)

    def _forget(self, block: int, evicted: bool) -> None:
        key = self._key[block]
        if key is not None:
            del self._cached[key]
            self._key[block] = None
            self._content[block] = None
            self.num_evictions += evicted

    def grow(self, num_blocks: int) -> None:
        for b in range(self.num_total, num_blocks):
            self._ref.append(0)
            self._key.append(None)
            self._content.append(None)
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def check(self, slot_blocks: Sequence[Sequence[int]]) -> None:
        """Assert the accounting against every slot's block list (tests and ``check_invariants``)."""
        counts = [0] * self.num_total
        for blocks in slot_blocks:
            for b in blocks:
                counts[b] += 1
        if counts != self._ref:
            bad = next(b for b in range(self.num_total) if counts[b] != self._ref[b])
            raise AssertionError(f"block {bad}: {counts[bad]} slot references, ref count {self._ref[bad]}")
        if sorted(self._free) != [b for b in range(self.num_total) if self._ref[b] == 0]:
            raise AssertionError("the free list is not exactly the unreferenced blocks")
        for key, b in self._cached.items():
            if self._key[b] != key:
                raise AssertionError(f"cached key of block {b} does not match")
