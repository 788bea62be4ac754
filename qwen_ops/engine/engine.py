"""QwenEngine: explicit per-request slots over a paged KV cache (the seed's slot plan, batched).

Every length is kept per slot; there is no engine-wide position. ``prefill``/``decode_step``
drive one slot; ``batch_prefill``/``batch_decode_step`` run ONE forward pass for all their
requests (prompts longer than ``chunk_size`` take one pass per chunk round). Forward passes
are serialized by a lock, so calls on different slots from several threads are safe.

Slot ``s`` owns a list of physical KV blocks; ``block_table[s]`` names them. A slot holds a
sequence after ``prefill`` and until ``free_slot`` (or the next ``prefill`` restarts it).

With ``enable_prefix_caching=True`` full blocks are content-addressed and shared
(``PrefixCachingAllocator``): ``prefill``/``batch_prefill`` (and the scheduler, through
``begin_sequence(..., tokens=)``) map the longest cached run of full blocks of a prompt into the
slot and compute only the rest. The last prompt token is always computed, so its logits exist.
A slot writes only past its full blocks, so a shared block is never written; ``free_slot``
drops references and keeps the content cached until allocation evicts it (LRU). Models with
linear-attention layers keep per-slot recurrent state that a block does not capture, so for
them prefix caching stays off (a warning says so, and ``prefix_caching`` reads False).
"""

from __future__ import annotations

import logging
import threading
import weakref
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from qwen_ops.engine.block_manager import BlockAllocator, PrefixCachingAllocator
from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.runner import ModelRunner
from qwen_ops.engine.sampling import GREEDY, SamplingParams, SeededNoise, sample
from qwen_ops.engine.threads import configure_cpu_threads
from qwen_ops.models.config import QwenConfig
from qwen_ops.ops.memory import check_fits


@dataclass
class QwenForwardResult:
    next_token: int
    logits: torch.Tensor  # [vocab] fp32 logits of the last position


@dataclass
class QwenBatchedRequest:
    request_id: Any
    prompt_tokens: list[int]
    slot_id: Optional[int] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    finished: bool = False
    seq_len: int = 0                     # tokens in the slot's KV cache
    last_token: Optional[int] = None     # newest generated token (not yet in the cache)
    generated_tokens: list[int] = field(default_factory=list)
    last_result: Optional[QwenForwardResult] = None


@dataclass
class QwenBatchPrefillResult:
    last_tokens: list[int]
    prompt_lengths: list[int]


@dataclass
class QwenBatchDecodeResult:
    next_tokens: list[int]
    finished: list[bool]


logger = logging.getLogger(__name__)


@dataclass
class _SlotState:
    blocks: list[int] = field(default_factory=list)
    seq_len: int = 0
    # With prefix caching: the tokens whose KV the slot holds, and the keys of its full blocks.
    token_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)
    active: bool = False                     # holds a sequence
    owner: Any = None                        # request id from allocate_slot, if any
    generator: Optional[SeededNoise] = None      # seeded sampling: the request's own noise


@dataclass
class SwappedSlot:
    """A slot's KV blocks (and linear-layer state) in host memory, with its length (``QwenEngine.swap_out``)."""

    seq_len: int
    blocks: list[tuple[torch.Tensor, torch.Tensor]]   # per layer, as ModelRunner.copy_out returns
    token_ids: list[int] = field(default_factory=list)   # with prefix caching: what the KV is of

    @property
    def nbytes(self) -> int:
        """Host memory held by the copy."""
        return sum(a.nbytes + b.nbytes for a, b in self.blocks)


def _compile_backend(compile_backend: str, backend: Optional[str]) -> str:
    """``compile_backend``, or the older name ``backend`` (deprecated: it is also the op backend's word)."""
    if backend is None:
        return compile_backend
    warnings.warn("backend= is deprecated; pass compile_backend= ('inductor' or 'tensorrt')", DeprecationWarning,
                  stacklevel=3)
    return backend


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class QwenEngine:
    def __init__(self, model: torch.nn.Module, config: Any, *, max_slots: int = 8, max_seq_len: int = 2048,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, chunk_size: int = 512,
                 tokenizer: Any = None, eos_token_ids: Sequence[int] = (), compile: Optional[bool] = None,
                 decode_buckets: Optional[Sequence[int]] = None, cuda_graphs: Optional[bool] = None,
                 compile_backend: str = "inductor", backend: Optional[str] = None, native_cpu: bool = True,
                 enable_prefix_caching: bool = False):
        for name, value, low in (("max_slots", max_slots, 1), ("max_seq_len", max_seq_len, 1),
                                 ("block_size", block_size, 1), ("chunk_size", chunk_size, 1)):
            if not _is_int(value) or value < low:
                raise ValueError(f"{name} = {value!r}, expected an int >= {low}")
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and max_seq_len > limit:
            raise ValueError(f"max_seq_len = {max_seq_len}, but the model supports "
                             f"max_position_embeddings = {limit}")
        rope = getattr(getattr(getattr(model, "model", None), "rotary_emb", None), "cos_sin", None)
        if rope is not None and max_seq_len > rope.shape[0]:
            raise ValueError(f"max_seq_len = {max_seq_len}, but the model's RoPE table holds {rope.shape[0]} positions "
                             f"(it was loaded with max_positions = {rope.shape[0]}); expected at most that")
        param = next(model.parameters())
        self.model = model.eval()
        self.config = config
        self.device = param.device
        if self.device.type == "cpu":
            configure_cpu_threads()          # once, here: see engine/threads.py
        self.dtype = param.dtype
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = int(config.vocab_size)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.max_blocks_per_slot = -(-max_seq_len // block_size)
        self._auto_blocks = num_kv_blocks is None
        if num_kv_blocks is None:
            num_kv_blocks = max_slots * self.max_blocks_per_slot
        if not _is_int(num_kv_blocks) or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks = {num_kv_blocks!r}, expected an int >= 1")
        self._check_memory(model, num_kv_blocks, block_size, max_slots, self.max_blocks_per_slot,
                           f"num_kv_blocks = {num_kv_blocks} of block_size = {block_size}, max_slots = {max_slots} "
                           f"and max_seq_len = {max_seq_len}")
        self.runner = ModelRunner(
            model, num_blocks=num_kv_blocks, block_size=block_size, max_slots=max_slots,
            max_blocks_per_slot=self.max_blocks_per_slot, dtype=self.dtype, device=self.device,
            compile=(self.device.type == "cuda") if compile is None else bool(compile), buckets=decode_buckets,
            cuda_graphs=(self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs),
            compile_backend=_compile_backend(compile_backend, backend), native_cpu=native_cpu)
        self.tp = None                    # this rank's TPGroup under tensor parallelism (from_pretrained)
        self.prefix_caching = bool(enable_prefix_caching)
        self.prefix_caching_disabled_reason: Optional[str] = None
        if self.prefix_caching and "linear" in self.runner.layer_kinds:
            self.prefix_caching = False
            self.prefix_caching_disabled_reason = (
                "the model has linear-attention (Gated DeltaNet) layers, whose per-slot recurrent state a "
                "cached KV block does not capture")
            logger.warning("prefix caching is off: %s", self.prefix_caching_disabled_reason)
        if self.prefix_caching:
            # Anything that changes the KV of a token run: model, cache dtype, block size.
            salt = f"{type(model).__name__}|{getattr(config, 'model_type', '')}|{self.dtype}|{block_size}".encode()
            self.allocator = PrefixCachingAllocator(num_kv_blocks, salt)
        else:
            self.allocator = BlockAllocator(num_kv_blocks)
        self.prefix_cache_queries = 0     # prompt tokens looked up (full blocks that could have hit)
        self.prefix_cache_hits = 0        # of those, tokens served from the cache
        self._slots = [_SlotState() for _ in range(max_slots)]
        self._lock = threading.RLock()

    # Host memory the engine keeps per KV block and per slot beside the tensors (allocator lists,
    # slot records): a count of 10**12 blocks is refused, not built.
    _HOST_BYTES_PER_BLOCK = 64
    _HOST_BYTES_PER_SLOT = 1024

    def _check_memory(self, model: torch.nn.Module, num_blocks: int, block_size: int, max_slots: int,
                      max_blocks_per_slot: int, what: str) -> None:
        """Refuse, before anything is allocated, a cache that does not fit the device's free memory:
        its size is measured by building it on the meta device (no storage), so every model kind
        (paged KV, per-slot linear-attention state) is counted by its own ``allocate_caches``."""
        caches = model.allocate_caches(num_blocks, block_size, max_slots, self.dtype, torch.device("meta"))
        device_bytes = sum(t.numel() * t.element_size() for pair in caches for t in pair)
        device_bytes += 4 * max_slots * max_blocks_per_slot                    # the block table (int32)
        host_bytes = self._HOST_BYTES_PER_BLOCK * num_blocks + self._HOST_BYTES_PER_SLOT * max_slots
        fix = "lower num_kv_blocks, block_size, max_slots (max_num_seqs) or max_seq_len (max_model_len)"
        if self.device.type == "cpu":
            check_fits(device_bytes + host_bytes, self.device, f"the KV cache ({what})", fix)
        else:
            check_fits(device_bytes, self.device, f"the KV cache ({what})", fix)
            check_fits(host_bytes, torch.device("cpu"), f"the KV block bookkeeping ({what})", fix)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: Union[str, Path, None] = None, *, dtype: Union[str, torch.dtype] = torch.float32,
                        device: Union[str, torch.device] = "cpu", tensor_parallel_size: int = 1,
                        tp_port: Optional[int] = None, **kwargs: Any) -> "QwenEngine":
        """Load a Hugging Face Qwen checkpoint directory (``None``: the embedded default model).

        ``tensor_parallel_size=N > 1`` splits the model over N processes (``engine/distributed.py``):
        under torchrun every rank joins its group; otherwise this process becomes rank 0 and
        spawns N-1 workers (on ``tp_port``, default a free one), stopped by ``shutdown()``."""
        from qwen_ops.engine import distributed as D
        from qwen_ops.models.defaults import default_model_path
        from qwen_ops.models.loader import load_checkpoint, resolve_dtype
        from qwen_ops.models.parallel import check_tp_config

        path = default_model_path() if path is None else path
        if tensor_parallel_size == 1:
            # The RoPE table needs only max_seq_len rows (the default 2048, as __init__'s).
            max_positions = kwargs.get("max_seq_len", 2048)
            if _is_int(max_positions) and max_positions >= 1:
                max_positions = min(max_positions, QwenConfig.from_pretrained(path).max_position_embeddings)
            else:
                max_positions = None             # __init__ names the bad value
            ckpt = load_checkpoint(path, dtype=dtype, device=device, max_positions=max_positions)
            return cls(ckpt.model, ckpt.config, tokenizer=ckpt.tokenizer, eos_token_ids=ckpt.eos_token_ids, **kwargs)
        config = QwenConfig.from_pretrained(path)
        check_tp_config(config, tensor_parallel_size)
        device = torch.device(device)
        workers = None
        if D.external_launch() is not None:
            rank, size = D.external_launch()
            if size != tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size = {tensor_parallel_size}, but the launcher started "
                                 f"WORLD_SIZE = {size} processes; expected them equal")
            tp = D.init_external(device, config, kwargs, resolve_dtype(dtype, config))
        else:
            workers = D.start_workers(path, size=tensor_parallel_size, dtype=resolve_dtype(dtype, config),
                                      device=device, engine_kwargs=kwargs, port=tp_port)
            tp = workers.group
        try:
            ckpt = load_checkpoint(path, dtype=dtype, device=device if device.type != "cuda" else
                                   torch.device("cuda", tp.rank), tp=tp)
            engine = cls(ckpt.model, ckpt.config, tokenizer=ckpt.tokenizer, eos_token_ids=ckpt.eos_token_ids, **kwargs)
        except BaseException:
            if workers is not None:
                workers.shutdown()
            raise
        engine.tp = tp
        if workers is not None:
            engine.runner = D.TPRunnerProxy(engine.runner, workers)
            engine._tp_workers = workers
            engine._tp_finalizer = weakref.finalize(engine, workers.shutdown)
        return engine

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if this engine spawned any (a no-op otherwise)."""
        workers = getattr(self, "_tp_workers", None)
        if workers is not None:
            workers.shutdown()

    # ----------------------------------------------------------------- slots
    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    def slot_blocks(self, slot_id: int) -> list[int]:
        return list(self._slots[self._check_slot(slot_id)].blocks)

    def slot_seq_len(self, slot_id: int) -> int:
        return self._slots[self._check_slot(slot_id)].seq_len

    def allocate_batch_slots(self, n: int) -> list[int]:
        """Make slots ``0 .. n-1`` usable, growing the slot table (and an auto-sized cache) if needed."""
        if not _is_int(n) or n < 1:
            raise ValueError(f"n = {n!r}, expected an int >= 1")
        with self._lock:
            if n > len(self._slots):
                extra = n - len(self._slots)
                blocks = self.allocator.num_total + extra * self.max_blocks_per_slot if self._auto_blocks \
                    else self.allocator.num_total
                self._check_memory(self.model, blocks, self.block_size, n, self.max_blocks_per_slot,
                                   f"allocate_batch_slots(n = {n}) with max_seq_len = {self.max_seq_len}")
                self.runner.grow_slots(n)
                if self._auto_blocks:
                    total = self.allocator.num_total + extra * self.max_blocks_per_slot
                    self.runner.grow_blocks(total)
                    self.allocator.grow(total)
                self._slots.extend(_SlotState() for _ in range(extra))
            return list(range(n))

    def allocate_slot(self, request_id: Any) -> int:
        """A slot that holds no sequence and no owner, now owned by ``request_id``."""
        with self._lock:
            for i, s in enumerate(self._slots):
                if not s.active and s.owner is None:
                    s.owner = request_id
                    return i
            raise ValueError(f"no free slot for request {request_id!r}: all {len(self._slots)} slots are in use")

    def free_slot(self, slot_id: int) -> None:
        """Release the slot, its sequence and its KV blocks."""
        with self._lock:
            s = self._slots[self._check_slot(slot_id)]
            self._release_blocks(slot_id)
            s.active, s.owner, s.generator, s.seq_len = False, None, None, 0

    # ----------------------------------------------------------------- validation
    def _check_slot(self, slot_id: Any, name: str = "slot_id") -> int:
        if not _is_int(slot_id) or not 0 <= slot_id < len(self._slots):
            raise ValueError(f"{name} = {slot_id!r}, expected an int in [0, {len(self._slots)})")
        return slot_id

    def _check_token(self, token: Any, name: str) -> int:
        if not _is_int(token) or not 0 <= token < self.vocab_size:
            raise ValueError(f"{name} = {token!r}, expected a token id in [0, {self.vocab_size})")
        return token

    def check_prompt(self, tokens: Any, name: str = "tokens") -> list[int]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.flatten().tolist()
        tokens = list(tokens)
        if not tokens:
            raise ValueError(f"{name} is empty; expected at least one token id")
        if len(tokens) > self.max_seq_len:
            raise ValueError(f"{name} has {len(tokens)} tokens, more than max_seq_len = {self.max_seq_len}")
        for i, t in enumerate(tokens):
            self._check_token(t, f"{name}[{i}]")
        return tokens

    def _check_sampling(self, sampling: Any, name: str = "sampling") -> SamplingParams:
        if sampling is None:
            return GREEDY
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"{name} = {sampling!r}, expected a qwen_ops.SamplingParams")
        if sampling.n != 1:
            raise ValueError(f"{name}.n = {sampling.n}: a slot holds one sequence, expected n = 1 "
                             "(LLM.generate runs n completions per prompt)")
        sampling.check_vocab(self.vocab_size)
        return sampling

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _check_blocks(self, needs: dict[int, int], restart: bool = False) -> None:
        """``needs``: slot -> tokens it must hold. Raise before anything changes if blocks run short.

        ``restart``: the slots start afresh, so only the blocks that no other slot shares come
        back (and a cached prefix may save some, which this bound does not count on)."""
        def kept(slot: int) -> int:
            blocks = self._slots[slot].blocks
            if restart and self.prefix_caching:
                return sum(1 for b in blocks if self.allocator.ref_count(b) == 1)
            return len(blocks)

        extra = sum(max(0, self._blocks_for(n) - kept(s)) for s, n in needs.items())
        if extra > self.allocator.num_free:
            raise RuntimeError(f"out of KV blocks: this call needs {extra} more, {self.allocator.num_free} "
                               f"are free of {self.allocator.num_total} (num_kv_blocks)")

    # ----------------------------------------------------------------- block bookkeeping
    def _release_blocks(self, slot_id: int) -> None:
        s = self._slots[slot_id]
        self.allocator.free(s.blocks)
        s.blocks = []
        s.token_ids, s.block_keys = [], []

    def _map_cached_prefix(self, slot_id: int, tokens: Sequence[int]) -> int:
        """Map the longest cached run of ``tokens``' full blocks into the (empty) slot, leaving at
        least the last token to compute; returns the tokens mapped (0 without prefix caching)."""
        if not self.prefix_caching:
            return 0
        s, pc, bs = self._slots[slot_id], self.allocator, self.block_size
        candidates = (len(tokens) - 1) // bs
        self.prefix_cache_queries += candidates * bs
        parent = b""
        for j in range(candidates):
            key, block = pc.lookup(parent, tokens[j * bs:(j + 1) * bs])
            if block is None:
                break
            pc.acquire(block)
            s.blocks.append(block)
            s.block_keys.append(key)
            parent = key
        n = len(s.blocks) * bs
        s.token_ids = list(tokens[:n])
        s.seq_len = n
        self.prefix_cache_hits += n
        if s.blocks:
            self.runner.set_block_row(slot_id, s.blocks)
        return n

    def _record_tokens(self, slot_id: int, tokens: Sequence[int]) -> None:
        """The slot's KV now also holds ``tokens``: make its newly full blocks addressable."""
        s, pc, bs = self._slots[slot_id], self.allocator, self.block_size
        s.token_ids.extend(tokens)
        while len(s.block_keys) < len(s.token_ids) // bs:
            j = len(s.block_keys)
            parent = s.block_keys[-1] if j else b""
            block_tokens = s.token_ids[j * bs:(j + 1) * bs]
            key = pc.key_of(parent, block_tokens)
            pc.register(s.blocks[j], key, parent, block_tokens)   # no-op if another block holds it
            s.block_keys.append(key)

    def prefix_cache_stats(self) -> dict:
        """Whether prefix caching is on, and its lookups, in tokens: queried (full prompt blocks
        that could have hit), hits, hit rate; cached blocks, evictions and detected collisions."""
        pc = self.allocator if self.prefix_caching else None
        return {
            "prefix_caching": self.prefix_caching,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0,
            "cached_blocks": pc.num_cached if pc else 0,
            "prefix_cache_evictions": pc.num_evictions if pc else 0,
            "prefix_cache_collisions": pc.num_collisions if pc else 0,
        }

    def check_block_accounting(self) -> None:
        """Assert that reference counts, free list and every slot's blocks agree (tests, invariants)."""
        with self._lock:
            lists = [s.blocks for s in self._slots]
            if isinstance(self.allocator, PrefixCachingAllocator):
                self.allocator.check(lists)
                for i, s in enumerate(self._slots):
                    if len(set(s.blocks)) != len(s.blocks):
                        raise AssertionError(f"slot {i} maps a block twice: {s.blocks}")
                return
            owned = [b for blocks in lists for b in blocks]
            if len(set(owned)) != len(owned):
                raise AssertionError("a block is owned by two slots without prefix caching")
            if len(owned) + self.allocator.num_free != self.allocator.num_total:
                raise AssertionError(f"blocks leaked: {len(owned)} owned + {self.allocator.num_free} free "
                                     f"!= {self.allocator.num_total}")

    def reserve(self, slot_id: int, n_tokens: int) -> bool:
        """Give the slot blocks for ``n_tokens`` tokens in total; False (and no change) if too few are free."""
        with self._lock:
            s = self._slots[self._check_slot(slot_id)]
            if n_tokens > self.max_seq_len:
                raise ValueError(f"n_tokens = {n_tokens}, more than max_seq_len = {self.max_seq_len}")
            need = self._blocks_for(n_tokens) - len(s.blocks)
            if need <= 0:
                return True
            if need > self.allocator.num_free:
                return False
            new = self.allocator.allocate(need)
            s.blocks.extend(new)
            self.runner.set_block_row(slot_id, s.blocks)
            return True

    def _restart(self, slot_id: int, n_tokens: int, sampling: SamplingParams,
                 tokens: Optional[Sequence[int]] = None) -> int:
        """Start a fresh sequence in the slot (blocks must have been checked), mapping the cached
        prefix of ``tokens`` when given; returns the tokens mapped."""
        s = self._slots[slot_id]
        self._release_blocks(slot_id)
        s.seq_len, s.active = 0, True
        s.generator = sampling.make_generator(self.device)
        mapped = self._map_cached_prefix(slot_id, tokens) if tokens is not None else 0
        ok = self.reserve(slot_id, n_tokens)
        assert ok, "blocks were checked before the restart"
        return mapped

    def begin_sequence(self, slot_id: int, sampling: Optional[SamplingParams] = None,
                       tokens: Optional[Sequence[int]] = None) -> int:
        """Empty the slot and mark it as holding a (still empty) sequence; used by the scheduler.

        With prefix caching and the sequence's ``tokens``, the longest cached prefix of full blocks
        is mapped in; returns how many tokens that covers (0 otherwise): compute from there."""
        with self._lock:
            return self._restart(self._check_slot(slot_id), 0, self._check_sampling(sampling), tokens)

    def swap_out(self, slot_id: int) -> SwappedSlot:
        """Copy the slot's KV to host memory and free its blocks (the slot keeps no sequence)."""
        with self._lock:
            s = self._slots[slot_id]
            # Only the blocks that hold tokens: a slot may have reserved room for a step it never ran.
            saved = SwappedSlot(s.seq_len, self.runner.copy_out(slot_id, s.blocks[:self._blocks_for(s.seq_len)]),
                                list(s.token_ids))
            self._release_blocks(slot_id)
            s.active, s.seq_len = False, 0
            return saved

    def swap_out_nbytes(self, slot_id: int) -> int:
        """Host bytes that ``swap_out(slot_id)`` would take, without copying anything."""
        return self.runner.host_copy_nbytes(self._blocks_for(self._slots[self._check_slot(slot_id)].seq_len))

    def swap_in(self, slot_id: int, saved: SwappedSlot, n_tokens: int = 0) -> bool:
        """Restore a swapped sequence into ``slot_id`` with blocks for ``max(saved.seq_len, n_tokens)``
        tokens (room for its next step); False (and no change) if blocks are short."""
        with self._lock:
            s = self._slots[self._check_slot(slot_id)]
            if s.active or s.blocks:
                raise ValueError(f"slot_id = {slot_id} holds a sequence; swap_in needs an empty slot")
            if self._blocks_for(max(saved.seq_len, n_tokens)) > self.allocator.num_free:
                return False
            self.reserve(slot_id, saved.seq_len)
            self.runner.copy_in(slot_id, s.blocks, saved.blocks)
            self.reserve(slot_id, max(saved.seq_len, n_tokens))
            s.active, s.seq_len = True, saved.seq_len
            if self.prefix_caching:
                self._record_tokens(slot_id, saved.token_ids)
            return True

    def refresh_weights(self) -> None:
        """Call after changing the model's weights: the layers repack the copies their CPU fast
        path reads (``process_weights_after_loading``); nothing notices a change without it."""
        with self._lock:
            self.runner.refresh_weights()
            if self.prefix_caching:
                self.allocator.reset_cache()     # cached KV was computed with the old weights

    # ----------------------------------------------------------------- forward
    def execute(self, chunks: Sequence[BatchedRequest]) -> torch.Tensor:
        """One forward pass over ``chunks`` (blocks must be reserved); advances each slot's length.

        Returns fp32 logits [len(chunks), vocab] of each chunk's last token.
        """
        with self._lock:
            seen = set()
            for i, c in enumerate(chunks):
                s = self._slots[self._check_slot(c.kv_cache_slot, f"chunks[{i}].kv_cache_slot")]
                if c.kv_cache_slot in seen:
                    raise ValueError(f"chunks[{i}].kv_cache_slot = {c.kv_cache_slot} appears twice; "
                                     "one chunk per slot and pass")
                seen.add(c.kv_cache_slot)
                if not s.active:
                    raise ValueError(f"chunks[{i}].kv_cache_slot = {c.kv_cache_slot} holds no sequence "
                                     "(prefill or begin_sequence first)")
                if c.position_offset != s.seq_len:
                    raise ValueError(f"chunks[{i}].position_offset = {c.position_offset}, but slot {c.kv_cache_slot} "
                                     f"holds {s.seq_len} tokens")
                if not c.token_ids:
                    raise ValueError(f"chunks[{i}] has no tokens")
                if self._blocks_for(c.position_offset + len(c.token_ids)) > len(s.blocks):
                    raise ValueError(f"chunks[{i}] needs {self._blocks_for(c.position_offset + len(c.token_ids))} blocks in slot "
                                     f"{c.kv_cache_slot}, which has {len(s.blocks)}; reserve() them first")
            logits = self.runner.execute(chunks)
            for c in chunks:
                self._slots[c.kv_cache_slot].seq_len += len(c.token_ids)
                if self.prefix_caching:
                    self._record_tokens(c.kv_cache_slot, c.token_ids)
            return logits

    def _prefill_rounds(self, prompts: Sequence[tuple[int, list[int]]]) -> torch.Tensor:
        """Chunked prefill of fresh slots, one forward per round of ``chunk_size`` tokens per prompt,
        each from what its slot already holds (a cached prefix, or nothing).

        Returns fp32 logits [len(prompts), vocab] of each prompt's last token.
        """
        last = [None] * len(prompts)
        starts = [self._slots[slot].seq_len for slot, _ in prompts]
        while True:
            live = [(i, slot, toks) for i, (slot, toks) in enumerate(prompts) if starts[i] < len(toks)]
            if not live:
                break
            logits = self.execute([BatchedRequest(slot, toks[starts[i]:starts[i] + self.chunk_size], starts[i])
                                   for i, slot, toks in live])
            for row, (i, _, toks) in enumerate(live):
                starts[i] = min(len(toks), starts[i] + self.chunk_size)
                if starts[i] == len(toks):
                    last[i] = logits[row]
        return torch.stack(last)

    def _sample(self, logits: torch.Tensor, slot_ids: Sequence[int], params: Sequence[SamplingParams]) -> list[int]:
        gens = [self._slots[s].generator if not p.greedy else None for s, p in zip(slot_ids, params)]
        for i, (s, p) in enumerate(zip(slot_ids, params)):
            if gens[i] is None and p.seed is not None and not p.greedy:
                gens[i] = self._slots[s].generator = p.make_generator(self.device)
        return self.share_sampled(sample(logits, params, gens)).tolist()

    def share_sampled(self, tokens: torch.Tensor) -> torch.Tensor:
        """Under torchrun (every rank samples), rank 0's ``tokens`` on every rank, so that random
        sampling cannot diverge; as they are otherwise (one process, or in-process workers, which
        do not sample)."""
        if self.tp is not None and getattr(self, "_tp_workers", None) is None:
            from qwen_ops.engine.distributed import broadcast_tokens

            broadcast_tokens(tokens, self.tp)
        return tokens

    def stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        """The tokens that end a request: its ``stop_token_ids``, plus the model's EOS ids unless
        ``ignore_eos`` (the one place this is decided, for the engine API and ``LLM`` alike)."""
        return frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else frozenset(self.eos_token_ids))

    # ----------------------------------------------------------------- single-session API
    def prefill(self, tokens: Sequence[int], slot_id: int = 0,
                sampling: Optional[SamplingParams] = None) -> QwenForwardResult:
        """Start slot ``slot_id``'s sequence afresh with ``tokens``; returns the first generated token."""
        with self._lock:
            self._check_slot(slot_id)
            sampling = self._check_sampling(sampling)
            tokens = self.check_prompt(tokens)
            self._check_blocks({slot_id: len(tokens)}, restart=True)
            self._restart(slot_id, len(tokens), sampling, tokens)
            logits = self._prefill_rounds([(slot_id, tokens)])
            token = self._sample(logits, [slot_id], [sampling])[0]
            return QwenForwardResult(token, logits[0])

    def decode_step(self, token: int, slot_id: int = 0,
                    sampling: Optional[SamplingParams] = None) -> QwenForwardResult:
        """Append ``token`` to the slot's sequence and return the next one."""
        with self._lock:
            self._check_slot(slot_id)
            sampling = self._check_sampling(sampling)
            self._check_token(token, "token")
            self._check_can_extend(slot_id, "slot_id")
            logits = self._decode([slot_id], [token])
            next_token = self._sample(logits, [slot_id], [sampling])[0]
            return QwenForwardResult(next_token, logits[0])

    def _check_can_extend(self, slot_id: int, name: str) -> None:
        s = self._slots[slot_id]
        if not s.active:
            raise ValueError(f"{name} = {slot_id} holds no sequence; call prefill first")
        if s.seq_len >= self.max_seq_len:
            raise ValueError(f"{name} = {slot_id} is full: {s.seq_len} tokens = max_seq_len")

    def _decode(self, slot_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        self._check_blocks({s: self._slots[s].seq_len + 1 for s in slot_ids})
        for s in slot_ids:
            self.reserve(s, self._slots[s].seq_len + 1)
        return self.execute([BatchedRequest(s, [t], self._slots[s].seq_len) for s, t in zip(slot_ids, tokens)])

    # ----------------------------------------------------------------- batch API
    def _check_requests(self, requests: Any) -> list[QwenBatchedRequest]:
        requests = list(requests)
        seen: dict[int, int] = {}
        for i, r in enumerate(requests):
            if not isinstance(r, QwenBatchedRequest):
                raise ValueError(f"requests[{i}] = {r!r}, expected a QwenBatchedRequest")
            self._check_slot(r.slot_id, f"requests[{i}].slot_id")
            self._check_sampling(r.sampling, f"requests[{i}].sampling")
            if r.slot_id in seen:
                raise ValueError(f"requests[{i}].slot_id = {r.slot_id} is also used by requests[{seen[r.slot_id]}]; "
                                 "each request needs its own slot")
            seen[r.slot_id] = i
        return requests

    def _finish_check(self, r: QwenBatchedRequest, token: int) -> bool:
        return len(r.generated_tokens) >= r.sampling.max_new_tokens or token in self.stop_ids(r.sampling)

    def batch_prefill(self, requests: Sequence[QwenBatchedRequest]) -> QwenBatchPrefillResult:
        """Prefill every request into its slot in one forward pass (per chunk round)."""
        with self._lock:
            requests = self._check_requests(requests)
            prompts = [self.check_prompt(r.prompt_tokens, f"requests[{i}].prompt_tokens")
                       for i, r in enumerate(requests)]
            self._check_blocks({r.slot_id: len(p) for r, p in zip(requests, prompts)}, restart=True)
            if not requests:
                return QwenBatchPrefillResult([], [])
            for r, p in zip(requests, prompts):
                self._restart(r.slot_id, len(p), r.sampling, p)
            logits = self._prefill_rounds([(r.slot_id, p) for r, p in zip(requests, prompts)])
            tokens = self._sample(logits, [r.slot_id for r in requests], [r.sampling for r in requests])
            for row, (r, p, t) in enumerate(zip(requests, prompts, tokens)):
                r.seq_len = len(p)
                r.last_token = t
                r.generated_tokens = [t]
                r.last_result = QwenForwardResult(t, logits[row])
                r.finished = self._finish_check(r, t)
            return QwenBatchPrefillResult(tokens, [len(p) for p in prompts])

    def batch_decode_step(self, requests: Sequence[QwenBatchedRequest]) -> QwenBatchDecodeResult:
        """One decode step for every unfinished request, in one forward pass."""
        with self._lock:
            requests = self._check_requests(requests)
            live = [r for r in requests if not r.finished]
            for i, r in enumerate(requests):
                if r.finished:
                    continue
                self._check_can_extend(r.slot_id, f"requests[{i}].slot_id")
                if r.last_token is None:
                    raise ValueError(f"requests[{i}] has no last_token; run batch_prefill first")
                self._check_token(r.last_token, f"requests[{i}].last_token")
                if self._slots[r.slot_id].seq_len != r.seq_len:
                    raise ValueError(f"requests[{i}].seq_len = {r.seq_len}, but slot {r.slot_id} holds "
                                     f"{self._slots[r.slot_id].seq_len} tokens; was the slot reused?")
            if live:
                logits = self._decode([r.slot_id for r in live], [r.last_token for r in live])
                tokens = self._sample(logits, [r.slot_id for r in live], [r.sampling for r in live])
                for row, (r, t) in enumerate(zip(live, tokens)):
                    r.seq_len += 1
                    r.last_token = t
                    r.generated_tokens.append(t)
                    r.last_result = QwenForwardResult(t, logits[row])
                    r.finished = self._finish_check(r, t)
            return QwenBatchDecodeResult([r.last_token for r in requests], [r.finished for r in requests])
