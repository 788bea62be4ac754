"""The KV-cache manager: the one owner of which KV blocks each slot's sequence holds.

``BlockPool`` is the physical pool: reference-counted blocks, and with ``prefix_caching`` full
blocks addressable by content (vLLM's automatic prefix caching). ``KVCacheManager`` keeps, per
slot, the blocks of its sequence and how many tokens their KV holds; it maps a cached prefix
into a fresh sequence, registers blocks as they fill, reserves room for a step, and keeps the
swap bookkeeping (which host copy holds which sequence). The scheduler and the seed's slot API
(``QwenEngine``) both use one manager; neither touches the device: the runner writes the block
table from the block ids each step carries (``BatchedRequest.block_table``).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from qwen_ops.engine.batch import BlockCopy


def _sha256_key(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's key: SHA-256 over the parent block's key, the salt and the token ids."""
    h = hashlib.sha256(parent)
    h.update(salt)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    """Reference-counted KV blocks; with ``prefix_caching``, full-block contents are addressable
    by hash (vLLM's automatic prefix caching; nano-vllm and SGLang do the same).

    - A full block's key chains its parent's key with its token ids and a salt
      (``_sha256_key``): equal keys mean equal prefixes, so equal KV.
    - A block is shared by every sequence that maps it (``acquire``); ``free`` drops one
      reference. A block whose count reaches zero stays cached, in an LRU free list, until
      ``allocate`` needs it: allocation takes the least recently freed block and evicts its key.
      Unhashed blocks are freed to the front, so they go before any cached content.
    - Every cached block keeps its token ids and parent key: a lookup whose key matches but
      whose tokens do not (a hash collision) is a miss, counted in ``num_collisions``. A wrong
      block is never served, whatever the hash function.
    - Only full blocks are registered, and a sequence only writes past its full blocks, so a
      shared block is never written.

    Without ``prefix_caching``, ``lookup`` always misses and ``register`` keeps nothing.
    ``hash_fn(parent, salt, tokens) -> bytes`` is replaceable (tests force collisions with it).
    """

    def __init__(self, num_blocks: int, prefix_caching: bool = False, salt: bytes = b"",
                 hash_fn: Callable[[bytes, bytes, Sequence[int]], bytes] = _sha256_key):
        if num_blocks < 1:
            raise ValueError(f"num_blocks = {num_blocks}, expected >= 1")
        self.prefix_caching = prefix_caching
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
            if self._key[b] is not None:
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
        if not self.prefix_caching or key in self._cached or self._key[block] is not None:
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
        """Add blocks ``num_total .. num_blocks - 1``, free."""
        for b in range(self.num_total, num_blocks):
            self._ref.append(0)
            self._key.append(None)
            self._content.append(None)
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def check(self, block_lists: Sequence[Sequence[int]]) -> None:
        """Assert the accounting against every sequence's block list (tests and ``check_invariants``)."""
        counts = [0] * self.num_total
        for blocks in block_lists:
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


@dataclass(eq=False)
class SlotKV:
    """One slot's sequence in the pool (changed only by ``KVCacheManager``)."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0                    # tokens whose KV the blocks hold (computed)
    active: bool = False                   # holds a sequence
    owner: Any = None                      # request id from allocate_slot, if any
    # With prefix caching: the tokens whose KV the slot holds, and the keys of its full blocks.
    token_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    root: bytes = b""                      # the first block's parent key: what else keys the content (an adapter)


@dataclass(eq=False)
class SwappedSlot:
    """A sequence's KV in host memory: the runner holds the copy under ``handle``."""

    handle: int
    num_tokens: int
    nbytes: int                                          # host memory the copy takes
    token_ids: list[int] = field(default_factory=list)   # with prefix caching: what the KV is of
    root: bytes = b""                                    # and the slot's root key (SlotKV.root)


class KVCacheManager:
    """Slots and their KV blocks over one ``BlockPool`` (module docstring).

    ``host_bytes(num_blocks)``: host memory a swapped copy of that many blocks takes (the
    runner's ``host_copy_nbytes``)."""

    def __init__(self, num_blocks: int, block_size: int, max_slots: int, prefix_caching: bool = False,
                 salt: bytes = b"", host_bytes: Callable[[int], int] = lambda n: 0):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, prefix_caching, salt)
        self.slots = [SlotKV() for _ in range(max_slots)]
        self.host_bytes = host_bytes
        self.prefix_cache_queries = 0     # prompt tokens looked up (full blocks that could have hit)
        self.prefix_cache_hits = 0        # of those, tokens served from the cache
        self._handles = itertools.count()
        self.swap_bytes_used = 0          # host bytes held by swapped sequences
        self._freed_swaps: list[int] = []  # handles dropped since the last step (the runner frees them)

    @property
    def prefix_caching(self) -> bool:
        return self.pool.prefix_caching

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def grow(self, max_slots: int, num_blocks: int) -> None:
        self.slots.extend(SlotKV() for _ in range(max_slots - len(self.slots)))
        self.pool.grow(num_blocks)

    # ------------------------------------------------------------------ slots
    def allocate_slot(self, owner: Any) -> int:
        """A slot that holds no sequence and no owner, now owned by ``owner``."""
        for i, s in enumerate(self.slots):
            if not s.active and s.owner is None:
                s.owner = owner
                return i
        raise ValueError(f"no free slot for request {owner!r}: all {len(self.slots)} slots are in use")

    def free_slot(self, slot: int) -> None:
        """Release the slot, its sequence and its KV blocks."""
        self._release(slot)
        self.slots[slot].owner = None

    def _release(self, slot: int) -> None:
        s = self.slots[slot]
        self.pool.free(s.block_ids)
        s.block_ids, s.token_ids, s.block_keys, s.root = [], [], [], b""
        s.num_tokens, s.active = 0, False

    def begin(self, slot: int, tokens: Optional[Sequence[int]] = None, root: bytes = b"") -> int:
        """Start a fresh (empty) sequence in the slot; with prefix caching and the sequence's
        ``tokens``, map the longest cached run of its full blocks, leaving at least the last
        token to compute. Returns the tokens mapped: compute from there. ``root``: what else
        the KV depends on (a LoRA adapter's key), chained into every block's key and content, so
        blocks computed under different roots are never shared."""
        self._release(slot)
        s = self.slots[slot]
        s.active, s.root = True, root
        if tokens is None or not self.prefix_caching:
            return 0
        pool, bs = self.pool, self.block_size
        candidates = (len(tokens) - 1) // bs
        self.prefix_cache_queries += candidates * bs
        parent = root
        for j in range(candidates):
            key, block = pool.lookup(parent, tokens[j * bs:(j + 1) * bs])
            if block is None:
                break
            pool.acquire(block)
            s.block_ids.append(block)
            s.block_keys.append(key)
            parent = key
        n = len(s.block_ids) * bs
        s.token_ids = list(tokens[:n])
        s.num_tokens = n
        self.prefix_cache_hits += n
        return n

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Give the slot blocks for ``n_tokens`` tokens in total; False (and no change) if too few are free."""
        s = self.slots[slot]
        need = -(-n_tokens // self.block_size) - len(s.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        s.block_ids.extend(self.pool.allocate(need))
        return True

    def commit(self, slot: int, tokens: Sequence[int]) -> None:
        """The slot's KV now also holds ``tokens`` (a step ran): count them, and with prefix
        caching make its newly full blocks addressable."""
        s = self.slots[slot]
        s.num_tokens += len(tokens)
        if not self.pool.prefix_caching:
            return
        pool, bs = self.pool, self.block_size
        s.token_ids.extend(tokens)
        while len(s.block_keys) < len(s.token_ids) // bs:
            j = len(s.block_keys)
            parent = s.block_keys[-1] if j else s.root
            block_tokens = s.token_ids[j * bs:(j + 1) * bs]
            key = pool.key_of(parent, block_tokens)
            pool.register(s.block_ids[j], key, parent, block_tokens)   # no-op if another block holds it
            s.block_keys.append(key)

    def fork(self, src: int, dst: int) -> Optional[tuple[int, int]]:
        """``dst`` holds a copy of ``src``'s sequence (beam search): ``src``'s full blocks shared, one
        more reference each (a slot writes only past its full blocks, so neither ever writes them),
        its partial last block copied into a new block of ``dst``'s own. Returns ``(src block, dst
        block)`` for the runner to copy, or None when ``src`` ends on a block boundary."""
        s, d = self.slots[src], self.slots[dst]
        full = s.num_tokens // self.block_size
        partial = s.num_tokens % self.block_size != 0
        if partial and self.pool.num_free < 1:
            raise RuntimeError(f"out of KV blocks: a fork needs 1, {self.pool.num_free} are free of "
                               f"{self.pool.num_total} (num_kv_blocks)")
        self._release(dst)
        for b in s.block_ids[:full]:
            self.pool.acquire(b)
        d.block_ids = list(s.block_ids[:full])
        copy = None
        if partial:
            (new,) = self.pool.allocate(1)
            d.block_ids.append(new)
            copy = (s.block_ids[full], new)
        d.num_tokens, d.active = s.num_tokens, True
        d.token_ids, d.block_keys, d.root = list(s.token_ids), list(s.block_keys[:full]), s.root
        return copy

    def kept_blocks(self, slot: int, restart: bool) -> int:
        """Blocks of the slot that serve its next tokens; on a ``restart`` only those no other
        sequence shares come back to it."""
        blocks = self.slots[slot].block_ids
        if restart and self.prefix_caching:
            return sum(1 for b in blocks if self.pool.ref_count(b) == 1)
        return len(blocks)

    # ------------------------------------------------------------------ swap
    def swap_out_nbytes(self, slot: int) -> int:
        """Host bytes that ``swap_out(slot)`` would take."""
        return self.host_bytes(self.blocks_for(self.slots[slot].num_tokens))

    def swap_out(self, slot: int, request_id: Any = None):
        """Free the slot's blocks for a host copy of its KV; returns ``(SwappedSlot, BlockCopy)``:
        the runner makes the copy (of the blocks that hold tokens) before the step's forward."""
        s = self.slots[slot]
        n = self.blocks_for(s.num_tokens)
        saved = SwappedSlot(next(self._handles), s.num_tokens, self.host_bytes(n), list(s.token_ids), s.root)
        copy = BlockCopy(request_id, saved.handle, slot, tuple(s.block_ids[:n]))
        self.swap_bytes_used += saved.nbytes
        self._release(slot)
        return saved, copy

    def swap_in(self, slot: int, saved: SwappedSlot, n_tokens: int = 0, request_id: Any = None):
        """Blocks in the (empty) slot for ``max(saved.num_tokens, n_tokens)`` tokens, into which the
        runner copies the host copy back; returns the ``BlockCopy``, or None (no change) if
        blocks are short."""
        s = self.slots[slot]
        if s.active or s.block_ids:
            raise ValueError(f"slot_id = {slot} holds a sequence; swap_in needs an empty slot")
        if self.blocks_for(max(saved.num_tokens, n_tokens)) > self.pool.num_free:
            return None
        self.reserve(slot, max(saved.num_tokens, n_tokens))
        s.active, s.num_tokens, s.root = True, saved.num_tokens, saved.root
        if self.prefix_caching:
            s.num_tokens = 0
            self.commit(slot, saved.token_ids)
        self._forget_swap(saved, freed=False)
        return BlockCopy(request_id, saved.handle, slot, tuple(s.block_ids[:self.blocks_for(saved.num_tokens)]))

    def drop_swap(self, saved: SwappedSlot) -> None:
        """The host copy will never come back (recompute, abort): the runner frees it next step."""
        self._forget_swap(saved, freed=True)

    def _forget_swap(self, saved: SwappedSlot, freed: bool) -> None:
        self.swap_bytes_used -= saved.nbytes
        if freed:
            self._freed_swaps.append(saved.handle)

    def take_freed_swaps(self) -> list[int]:
        out, self._freed_swaps = self._freed_swaps, []
        return out

    # ------------------------------------------------------------------ checks and figures
    def reset_cache(self) -> None:
        self.pool.reset_cache()

    def check(self) -> None:
        """Assert that reference counts, free list and every slot's blocks agree (tests, invariants)."""
        lists = [s.block_ids for s in self.slots]
        self.pool.check(lists)
        for i, s in enumerate(self.slots):
            if len(set(s.block_ids)) != len(s.block_ids):
                raise AssertionError(f"slot {i} maps a block twice: {s.block_ids}")
            if not self.prefix_caching and any(self.pool.ref_count(b) != 1 for b in s.block_ids):
                raise AssertionError("a block is owned by two slots without prefix caching")

    def stats(self) -> dict:
        """Whether prefix caching is on, and its lookups, in tokens: queried (full prompt blocks
        that could have hit), hits, hit rate; cached blocks, evictions and detected collisions."""
        pool = self.pool
        on = self.prefix_caching
        return {
            "prefix_caching": on,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0,
            "cached_blocks": pool.num_cached if on else 0,
            "prefix_cache_evictions": pool.num_evictions if on else 0,
            "prefix_cache_collisions": pool.num_collisions if on else 0,
        }
