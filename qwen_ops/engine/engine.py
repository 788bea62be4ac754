"""QwenEngine: the seed's slot API (explicit per-request slots over a paged KV cache), batched.

A thin layer over the same ``KVCacheManager`` and ``ModelRunner`` the scheduler uses: every
length and block list is the manager's, per slot; there is no engine-wide position.
``prefill``/``decode_step`` drive one slot; ``batch_prefill``/``batch_decode_step`` run ONE
forward pass for all their requests (prompts longer than ``chunk_size`` take one pass per chunk
round), each a ``runner.step`` whose tasks carry their block ids and sampling, as the
scheduler's do. Forward passes are serialized by a lock, so calls on different slots from
several threads are safe.

A slot holds a sequence after ``prefill`` and until ``free_slot`` (or the next ``prefill``
restarts it). With ``enable_prefix_caching=True`` full blocks are content-addressed and shared
(``BlockPool``): ``prefill``/``batch_prefill`` (and the scheduler) map the longest cached run
of full blocks of a prompt into the slot and compute only the rest. The last prompt token is
always computed, so its logits exist. A slot writes only past its full blocks, so a shared
block is never written; ``free_slot`` drops references and keeps the content cached until
allocation evicts it (LRU). Models with linear-attention layers keep per-slot recurrent state
that a block does not capture, so for them prefix caching stays off (a warning says so, and
``prefix_caching`` reads False).
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from qwen_ops.engine.batch import BatchedRequest, IterationPlan
from qwen_ops.engine.block_manager import BlockPool, KVCacheManager
from qwen_ops.engine.lora import LoRAConfig, LoRAManager
from qwen_ops.engine.request import Request
from qwen_ops.engine.runner import ModelRunner, RunnerOutput
from qwen_ops.engine.sampling import GREEDY, SamplingParams
from qwen_ops.engine.scheduler import Scheduler, SchedulerConfig
from qwen_ops.engine.threads import configure_cpu_threads
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.loader import checkpoint_name
from qwen_ops.models.lora import enable_lora, lora_module_names
from qwen_ops.ops.kv_quant import resolve_kv_cache_dtype
from qwen_ops.ops.memory import check_fits


@dataclass
class QwenForwardResult:
    next_token: int
    logits: torch.Tensor  # [vocab] fp32 logits of the last position


@dataclass
class QwenBatchedRequest:
    """One request of the batch API. ``batch_prefill`` binds it to the sequence it starts in its
    slot (a ``Request``, the record the scheduler keeps too); what it reads back (``seq_len``,
    ``generated_tokens``, ``finished``, ``finish_reason``) is that record's, not a copy.
    ``last_token`` is the token the next ``batch_decode_step`` feeds: the newest sampled one,
    unless you set another."""

    request_id: Any
    prompt_tokens: list[int]
    slot_id: Optional[int] = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    last_token: Optional[int] = None
    _sequence: Optional[Request] = field(default=None, init=False, repr=False, compare=False)

    @property
    def seq_len(self) -> int:
        """Tokens in the slot's KV cache (the KV-cache manager's count)."""
        seq = self._sequence
        return 0 if seq is None or seq.kv is None else seq.num_computed

    @property
    def generated_tokens(self) -> list[int]:
        return [] if self._sequence is None else list(self._sequence.output_token_ids)

    @property
    def finished(self) -> bool:
        return self._sequence is not None and self._sequence.finished

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop" (a stop token), "length" (``max_new_tokens`` or ``max_seq_len``), or None."""
        return None if self._sequence is None else self._sequence.finish_reason


@dataclass
class QwenBatchPrefillResult:
    last_tokens: list[int]
    prompt_lengths: list[int]


@dataclass
class QwenBatchDecodeResult:
    next_tokens: list[int]
    finished: list[bool]


logger = logging.getLogger(__name__)


def _compile_backend(compile_backend: str, backend: Optional[str]) -> str:
    """``compile_backend``, or the older name ``backend`` (deprecated: it is also the op backend's word)."""
    if backend is None:
        return compile_backend
    warnings.warn("backend= is deprecated; pass compile_backend= ('inductor' or 'tensorrt')", DeprecationWarning,
                  stacklevel=4)     # QwenEngine(...) -> build_runner -> here
    return backend


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# Host memory the engine keeps per KV block and per slot beside the tensors (allocator lists,
# slot records): a count of 10**12 blocks is refused, not built.
HOST_BYTES_PER_BLOCK = 64
HOST_BYTES_PER_SLOT = 1024


def check_cache_memory(model: torch.nn.Module, num_blocks: int, block_size: int, max_slots: int,
                       max_blocks_per_slot: int, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                       what: str) -> None:
    """Refuse, before anything is allocated, a cache that does not fit the device's free memory:
    its size is measured by building it on the meta device (no storage), so every model kind
    (paged KV, per-slot linear-attention state) is counted by its own ``allocate_caches``."""
    caches = model.allocate_caches(num_blocks, block_size, max_slots, dtype, torch.device("meta"), kv_dtype=kv_dtype)
    device_bytes = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    device_bytes += 4 * max_slots * max_blocks_per_slot                    # the block table (int32)
    host_bytes = HOST_BYTES_PER_BLOCK * num_blocks + HOST_BYTES_PER_SLOT * max_slots
    fix = "lower num_kv_blocks, block_size, max_slots (max_num_seqs) or max_seq_len (max_model_len)"
    if device.type == "cpu":
        check_fits(device_bytes + host_bytes, device, f"the KV cache ({what})", fix)
    else:
        check_fits(device_bytes, device, f"the KV cache ({what})", fix)
        check_fits(host_bytes, torch.device("cpu"), f"the KV block bookkeeping ({what})", fix)


def build_runner(model: torch.nn.Module, config: Any, *, max_slots: int = 8, max_seq_len: int = 2048,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, compile: Optional[bool] = None,
                 decode_buckets: Optional[Sequence[int]] = None, cuda_graphs: Optional[bool] = None,
                 compile_backend: str = "inductor", backend: Optional[str] = None, native_cpu: bool = True,
                 kv_cache_dtype: Union[str, torch.dtype] = "auto", calculate_kv_scales: bool = False,
                 lora: Optional[LoRAConfig] = None, pooling: bool = False) -> ModelRunner:
    """The ``ModelRunner`` of ``model`` for an engine with these arguments (``QwenEngine``'s, which
    it checks by name), its cache checked against the free memory first: what ``QwenEngine`` runs
    its steps on, and what a tensor-parallel worker serves (it builds no engine)."""
    for name, value, low in (("max_slots", max_slots, 1), ("max_seq_len", max_seq_len, 1),
                             ("block_size", block_size, 1)):
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
    if not isinstance(calculate_kv_scales, bool):
        raise ValueError(f"calculate_kv_scales = {calculate_kv_scales!r}, expected True or False")
    param = next(model.parameters())
    model = model.eval()
    device, dtype = param.device, param.dtype
    if device.type == "cpu":
        configure_cpu_threads()          # once, here: see engine/threads.py
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    max_blocks_per_slot = -(-max_seq_len // block_size)
    if num_kv_blocks is None:
        num_kv_blocks = max_slots * max_blocks_per_slot
    if not _is_int(num_kv_blocks) or num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks = {num_kv_blocks!r}, expected an int >= 1")
    check_cache_memory(model, num_kv_blocks, block_size, max_slots, max_blocks_per_slot, dtype, kv_dtype, device,
                       f"num_kv_blocks = {num_kv_blocks} of block_size = {block_size}, max_slots = {max_slots} "
                       f"and max_seq_len = {max_seq_len}")
    if lora is not None:      # the LoRA slots, before the layers choose their forwards (ModelRunner)
        if not isinstance(lora, LoRAConfig):
            raise ValueError(f"lora = {lora!r}, expected a LoRAConfig or None")
        enable_lora(model, lora.max_loras, lora.max_lora_rank, max_slots * max_seq_len)
    runner = ModelRunner(
        model, num_blocks=num_kv_blocks, block_size=block_size, max_slots=max_slots,
        max_blocks_per_slot=max_blocks_per_slot, dtype=dtype, device=device,
        compile=(device.type == "cuda") if compile is None else bool(compile), buckets=decode_buckets,
        cuda_graphs=(device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs),
        compile_backend=_compile_backend(compile_backend, backend), native_cpu=native_cpu, kv_dtype=kv_dtype,
        pooling=pooling)
    if calculate_kv_scales:
        request_kv_scales(model)
    return runner


def request_kv_scales(model: torch.nn.Module) -> None:
    """Have every attention layer set its fp8 KV scales from the next forward's keys and values
    (vLLM's ``calculate_kv_scales``: amax / 200 and amax / 100, once; ``SlotAttention``)."""
    from qwen_ops.models.layers import SlotAttention

    for m in model.modules():
        if isinstance(m, SlotAttention):
            m.calculate_kv_scales = True


class QwenEngine:
    def __init__(self, model: torch.nn.Module, config: Any, *, max_slots: int = 8, max_seq_len: int = 2048,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None, chunk_size: int = 512,
                 tokenizer: Any = None, eos_token_ids: Sequence[int] = (), compile: Optional[bool] = None,
                 decode_buckets: Optional[Sequence[int]] = None, cuda_graphs: Optional[bool] = None,
                 compile_backend: str = "inductor", backend: Optional[str] = None, native_cpu: bool = True,
                 enable_prefix_caching: bool = False, kv_cache_dtype: Union[str, torch.dtype] = "auto",
                 calculate_kv_scales: bool = False, lora: Optional[LoRAConfig] = None, pooling: bool = False):
        if not _is_int(chunk_size) or chunk_size < 1:
            raise ValueError(f"chunk_size = {chunk_size!r}, expected an int >= 1")
        self.runner = build_runner(model, config, max_slots=max_slots, max_seq_len=max_seq_len, block_size=block_size,
                                   num_kv_blocks=num_kv_blocks, compile=compile, decode_buckets=decode_buckets,
                                   cuda_graphs=cuda_graphs, compile_backend=compile_backend, backend=backend,
                                   native_cpu=native_cpu, kv_cache_dtype=kv_cache_dtype,
                                   calculate_kv_scales=calculate_kv_scales, lora=lora, pooling=pooling)
        self.model = self.runner.model
        # LoRA adapters (engine/lora.py): parsed, and put into the model's slots as requests need them.
        self.lora: Optional[LoRAManager] = None
        if lora is not None:
            self.lora = LoRAManager(lora, lambda slot, adapter: self.runner.call("load_lora", slot, adapter),
                                    lora_module_names(self.model),
                                    lambda n: checkpoint_name(n, config) if isinstance(config, QwenConfig) else n)
        self.config = config
        self.device = self.runner.device
        self.dtype = self.runner.dtype
        # The paged KV's dtype (vLLM's kv_cache_dtype): the model's, or fp8 (ops/kv_quant.py).
        self.kv_cache_dtype = self.runner.kv_dtype
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = int(config.vocab_size)
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.max_blocks_per_slot = self.runner.block_table.shape[1]
        self._auto_blocks = num_kv_blocks is None
        num_kv_blocks = self.runner.num_blocks
        self.tp = None                    # this rank's TPGroup under tensor parallelism (from_pretrained)
        prefix_caching = bool(enable_prefix_caching)
        self.prefix_caching_disabled_reason: Optional[str] = None
        if prefix_caching and "linear" in self.runner.layer_kinds:
            prefix_caching = False
            self.prefix_caching_disabled_reason = (
                "the model has linear-attention (Gated DeltaNet) layers, whose per-slot recurrent state a "
                "cached KV block does not capture")
            logger.warning("prefix caching is off: %s", self.prefix_caching_disabled_reason)
        # Anything that changes the KV of a token run: model, cache dtype, block size.
        salt = (f"{type(model).__name__}|{getattr(config, 'model_type', '')}|{self.dtype}|{self.kv_cache_dtype}|"
                f"{block_size}").encode()
        # The scheduler owns the KV-cache manager; the slot API's sequences are its pinned requests
        # (an ``EngineCore`` built on this engine gives it its serving policy: ``Scheduler.configure``).
        kv = KVCacheManager(num_kv_blocks, block_size, max_slots, prefix_caching, salt,
                            host_bytes=self.runner.host_copy_nbytes)
        self.scheduler = Scheduler(kv, SchedulerConfig(max_num_seqs=max_slots, max_num_batched_tokens=chunk_size,
                                                       max_model_len=max_seq_len), self.device)
        self._lock = threading.RLock()

    @property
    def kv(self) -> KVCacheManager:
        """The KV-cache manager (the scheduler's; read it, mutate it through the scheduler)."""
        return self.scheduler.kv

    def _seq(self, slot_id: int) -> Optional[Request]:
        """The sequence pinned to the slot, if any."""
        return self.scheduler.pinned.get(slot_id)

    # ----------------------------------------------------------------- the one driver of the runner
    def step(self, plan: IterationPlan) -> tuple[RunnerOutput, list]:
        """Run one planned step and take its result back: the runner executes and samples, then the
        scheduler counts the KV written, appends the tokens and runs the finish check
        (``Scheduler.update``). The only caller of ``runner.step``: ``EngineCore.step`` (scheduled
        requests) and the slot API (pinned ones) both come here. Returns the runner's output and the
        ``(request, token, logprobs)`` gained."""
        out = self.runner.call("step", plan)
        return out, self.scheduler.update(plan, out)

    def calculate_kv_scales(self) -> None:
        """Have every attention layer set its fp8 KV scales from the next forward's keys and values
        (vLLM's ``calculate_kv_scales``: amax / 200 and amax / 100, once; ``SlotAttention``). Call it
        before the first request; blocks written before it keep the scales they were written with."""
        request_kv_scales(self.model)

    @property
    def prefix_caching(self) -> bool:
        return self.kv.prefix_caching

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries

    @property
    def allocator(self) -> BlockPool:
        """The KV block pool (``kv.pool``)."""
        return self.kv.pool

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: Union[str, Path, None] = None, *, dtype: Union[str, torch.dtype] = torch.float32,
                        device: Union[str, torch.device] = "cpu", tensor_parallel_size: int = 1,
                        tp_port: Optional[int] = None, quantization: Optional[str] = None,
                        **kwargs: Any) -> "QwenEngine":
        """Load a Hugging Face Qwen checkpoint directory (``None``: the embedded default model).

        ``tensor_parallel_size=N > 1`` splits the model over N processes (``engine/distributed.py``):
        under torchrun every rank joins its group; otherwise this process becomes rank 0 and
        spawns N-1 workers (on ``tp_port``, default a free one), stopped by ``shutdown()``.
        ``quantization``: ``"int8"`` / ``"fp8"`` online quantization (``models/quant.py``); checkpoints
        quantized in a supported format load quantized either way."""
        from qwen_ops.engine import distributed as D
        from qwen_ops.models.defaults import resolve_model_path
        from qwen_ops.models.loader import load_checkpoint, resolve_dtype
        from qwen_ops.models.parallel import check_tp_config

        path = resolve_model_path(path)       # None: the embedded model; a model id: the HF cache
        config = QwenConfig.from_pretrained(path)
        if tensor_parallel_size == 1:
            # The RoPE table needs only max_seq_len rows (the default 2048, as __init__'s).
            max_positions = kwargs.get("max_seq_len", 2048)
            if _is_int(max_positions) and max_positions >= 1:
                max_positions = min(max_positions, config.max_position_embeddings)
            else:
                max_positions = None             # __init__ names the bad value
            ckpt = load_checkpoint(path, dtype=dtype, device=device, max_positions=max_positions, config=config,
                                   quantization=quantization)
            return cls(ckpt.model, ckpt.config, tokenizer=ckpt.tokenizer, eos_token_ids=ckpt.eos_token_ids, **kwargs)
        check_tp_config(config, tensor_parallel_size)
        from qwen_ops.models.quant import read_quant_config
        from qwen_ops.models.gguf import as_path

        quant = read_quant_config(as_path(path), quantization)
        if quant is not None:
            raise ValueError(f"tensor_parallel_size = {tensor_parallel_size} with quantized weights ({quant.method}) "
                             "is not supported yet; expected tensor_parallel_size = 1")
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
                                      device=device, engine_kwargs=kwargs, build_runner=_tp_worker_runner,
                                      port=tp_port)
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
            engine.runner.workers = workers          # runner.call sends each call to them
            engine._tp_workers = workers
            engine._tp_finalizer = weakref.finalize(engine, workers.shutdown)
        else:
            # Under torchrun every rank samples; rank 0's tokens win, so random sampling cannot diverge.
            engine.runner.sampler.share_tokens = partial(D.broadcast_tokens, tp=tp)
        return engine

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if this engine spawned any (a no-op otherwise)."""
        workers = getattr(self, "_tp_workers", None)
        if workers is not None:
            workers.shutdown()

    # ----------------------------------------------------------------- slots
    @property
    def num_slots(self) -> int:
        return self.kv.num_slots

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv.num_total_blocks

    def slot_blocks(self, slot_id: int) -> list[int]:
        return list(self.kv.slots[self._check_slot(slot_id)].block_ids)

    def slot_seq_len(self, slot_id: int) -> int:
        return self.kv.slots[self._check_slot(slot_id)].num_tokens

    def allocate_batch_slots(self, n: int) -> list[int]:
        """Make slots ``0 .. n-1`` usable, growing the slot table (and an auto-sized cache) if needed."""
        self._check_generation()
        if not _is_int(n) or n < 1:
            raise ValueError(f"n = {n!r}, expected an int >= 1")
        with self._lock:
            if n > self.kv.num_slots:
                extra = n - self.kv.num_slots
                blocks = self.kv.num_total_blocks + (extra * self.max_blocks_per_slot if self._auto_blocks else 0)
                check_cache_memory(self.model, blocks, self.block_size, n, self.max_blocks_per_slot, self.dtype,
                                   self.kv_cache_dtype, self.device,
                                   f"allocate_batch_slots(n = {n}) with max_seq_len = {self.max_seq_len}")
                self.runner.call("grow", n, blocks)
                self.scheduler.grow(n, blocks)
            return list(range(n))

    def allocate_slot(self, request_id: Any) -> int:
        """A slot that holds no sequence and no owner, now owned by ``request_id``."""
        self._check_generation()
        with self._lock:
            return self.scheduler.allocate_slot(request_id)

    def free_slot(self, slot_id: int) -> None:
        """Release the slot, its sequence and its KV blocks."""
        with self._lock:
            self.scheduler.free_slot(self._check_slot(slot_id))

    # ----------------------------------------------------------------- validation
    def _check_generation(self) -> None:
        """The slot API is generation's: a pooling engine refuses it before anything is reserved."""
        if self.runner.pooling:
            raise ValueError("this engine runs the pooling runner; the slot API (allocate_slot, prefill, decode_step, "
                             "batch_*, execute) needs a generation engine (pooling = False)")

    def _check_slot(self, slot_id: Any, name: str = "slot_id") -> int:
        self._check_generation()
        if not _is_int(slot_id) or not 0 <= slot_id < self.kv.num_slots:
            raise ValueError(f"{name} = {slot_id!r}, expected an int in [0, {self.kv.num_slots})")
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
        if sampling.prompt_logprobs is not None:
            raise ValueError(f"{name}.prompt_logprobs = {sampling.prompt_logprobs}: the slot API returns no prompt "
                             "logprobs, expected None (LLM.generate returns them)")
        sampling.check_vocab(self.vocab_size)
        return sampling

    def _check_blocks(self, needs: dict[int, int], restart: bool = False) -> None:
        """``needs``: slot -> tokens it must hold. Raise before anything changes if blocks run short.

        ``restart``: the slots start afresh, so only the blocks that no other slot shares come
        back (and a cached prefix may save some, which this bound does not count on)."""
        kv = self.kv
        extra = sum(max(0, kv.blocks_for(n) - kv.kept_blocks(s, restart)) for s, n in needs.items())
        if extra > kv.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: this call needs {extra} more, {kv.num_free_blocks} "
                               f"are free of {kv.num_total_blocks} (num_kv_blocks)")

    # ----------------------------------------------------------------- blocks
    def check_block_accounting(self) -> None:
        """Assert that reference counts, free list and every slot's blocks agree (tests, invariants)."""
        with self._lock:
            self.kv.check()

    def reserve(self, slot_id: int, n_tokens: int) -> bool:
        """Give the slot blocks for ``n_tokens`` tokens in total; False (and no change) if too few are free."""
        with self._lock:
            self._check_slot(slot_id)
            if n_tokens > self.max_seq_len:
                raise ValueError(f"n_tokens = {n_tokens}, more than max_seq_len = {self.max_seq_len}")
            return self.scheduler.extend(slot_id, n_tokens)

    def _restart(self, slot_id: int, n_tokens: int, sampling: SamplingParams,
                 tokens: Optional[Sequence[int]] = None, prompt: bool = True) -> Request:
        """Start a fresh sequence pinned to the slot (blocks must have been checked): ``Scheduler.pin``."""
        return self.scheduler.pin(slot_id, tokens, sampling, self.stop_ids(sampling), n_tokens, prompt)

    def begin_sequence(self, slot_id: int, sampling: Optional[SamplingParams] = None,
                       tokens: Optional[Sequence[int]] = None) -> int:
        """Empty the slot and mark it as holding a (still empty) sequence.

        With prefix caching and the sequence's ``tokens``, the longest cached prefix of full blocks
        is mapped in; returns how many tokens that covers (0 otherwise): compute from there."""
        with self._lock:
            return self._restart(self._check_slot(slot_id), 0, self._check_sampling(sampling), tokens,
                                 prompt=False).num_computed

    def fork_slot(self, src_slot: int, dst_slot: int) -> None:
        """``dst_slot`` continues as a copy of ``src_slot``'s sequence (beam search's beams): the full
        KV blocks are shared by reference count, never copied; only a partial last block is
        (``KVCacheManager.fork``). Attention-only models (a linear layer's state is per slot)."""
        with self._lock:
            self._check_slot(src_slot, "src_slot")
            self._check_slot(dst_slot, "dst_slot")
            if src_slot == dst_slot:
                raise ValueError(f"dst_slot = {dst_slot} is src_slot; expected another slot")
            self._check_can_extend(src_slot, "src_slot")
            if "linear" in self.runner.layer_kinds:
                raise ValueError("fork_slot needs an attention-only model; this one has linear-attention layers, "
                                 "whose per-slot state a fork does not copy")
            copy = self.scheduler.fork(src_slot, dst_slot)
            if copy is not None:
                self.runner.call("copy_blocks", [copy])

    def refresh_weights(self) -> None:
        """Call after changing the model's weights: the layers repack the copies their CPU fast
        path reads (``process_weights_after_loading``); nothing notices a change without it."""
        with self._lock:
            self.runner.call("refresh_weights")
            self.scheduler.reset_cache()     # cached KV was computed with the old weights

    # ----------------------------------------------------------------- forward
    def _run(self, tasks: list[BatchedRequest]) -> RunnerOutput:
        """One step over the pinned sequences' ``tasks`` (their blocks reserved): ``step``. A sequence
        whose token could not be sampled (its parameters leave none) is a ValueError naming its slot."""
        out = self.step(IterationPlan(tasks))[0]
        for t, e in zip(tasks, out.errors or ()):
            if e is not None:
                raise ValueError(f"slot {t.kv_cache_slot}: {e.message}")
        return out

    def execute(self, chunks: Sequence[BatchedRequest]) -> torch.Tensor:
        """One forward pass over ``chunks`` (blocks must be reserved); advances each slot's length.
        Nothing is sampled; the chunks' tokens join their slots' sequences.

        Returns fp32 logits [len(chunks), vocab] of each chunk's last token.
        """
        with self._lock:
            seen = set()
            for i, c in enumerate(chunks):
                s = self.kv.slots[self._check_slot(c.kv_cache_slot, f"chunks[{i}].kv_cache_slot")]
                if c.kv_cache_slot in seen:
                    raise ValueError(f"chunks[{i}].kv_cache_slot = {c.kv_cache_slot} appears twice; "
                                     "one chunk per slot and pass")
                seen.add(c.kv_cache_slot)
                if not s.active or self._seq(c.kv_cache_slot) is None:
                    raise ValueError(f"chunks[{i}].kv_cache_slot = {c.kv_cache_slot} holds no sequence "
                                     "(prefill or begin_sequence first)")
                if c.position_offset != s.num_tokens:
                    raise ValueError(f"chunks[{i}].position_offset = {c.position_offset}, but slot {c.kv_cache_slot} "
                                     f"holds {s.num_tokens} tokens")
                if not c.token_ids:
                    raise ValueError(f"chunks[{i}] has no tokens")
                for j, t in enumerate(c.token_ids):
                    self._check_token(t, f"chunks[{i}].token_ids[{j}]")
                need = self.kv.blocks_for(c.position_offset + len(c.token_ids))
                if need > len(s.block_ids):
                    raise ValueError(f"chunks[{i}] needs {need} blocks in slot {c.kv_cache_slot}, which has "
                                     f"{len(s.block_ids)}; reserve() them first")
            tasks = []
            for c in chunks:
                seq = self._seq(c.kv_cache_slot)
                seq.feed(c.position_offset, c.token_ids)
                tasks.append(seq.task(len(c.token_ids), c.is_prefill, sample=False))
            return self._run(tasks).logits

    def _prefill_rounds(self, seqs: Sequence[Request]) -> tuple[torch.Tensor, list[int]]:
        """Chunked prefill of fresh sequences, one forward per round of ``chunk_size`` tokens each,
        from what its slot already holds (a cached prefix, or nothing); the round that reaches a
        prompt's end samples its first token.

        Returns fp32 logits [len(seqs), vocab] of each prompt's last token, and those tokens (each
        appended to its sequence through the finish check).
        """
        n = len(seqs)
        last: list = [None] * n
        tokens: list = [None] * n
        while True:
            live = [i for i, q in enumerate(seqs) if q.num_computed < len(q.prompt_token_ids)]
            if not live:
                break
            out = self._run([seqs[i].task(min(self.chunk_size, len(seqs[i].prompt_token_ids) - seqs[i].num_computed),
                                          is_prefill=True) for i in live])
            for row, i in enumerate(live):
                token = out.sampled[row]
                if token is not None:        # appended, through the finish check, by the step
                    last[i], tokens[i] = out.logits[row], token
        return torch.stack(last), tokens

    def _decode(self, seqs: Sequence[Request], tokens: Sequence[int]) -> RunnerOutput:
        """Feed each sequence its token (in place of the sampled one, if another) and sample the next."""
        self._check_blocks({q.slot: q.num_computed + 1 for q in seqs})
        tasks = []
        for q, t in zip(seqs, tokens):
            self.scheduler.extend(q.slot, q.num_computed + 1)
            q.feed(q.num_computed, [t])
            tasks.append(q.task(1, is_prefill=False))
        return self._run(tasks)      # the sampled tokens join their sequences there

    def stop_ids(self, sampling: SamplingParams) -> frozenset[int]:
        """The tokens that end a request: its ``stop_token_ids``, plus the model's EOS ids unless
        ``ignore_eos`` (the one place this is decided, for the engine API and ``LLM`` alike). Stop ids
        past the vocabulary (accepted, as vLLM accepts them) are left out: never sampled, and ``min_tokens``
        masks these ids in the logits."""
        vocab = self.config.vocab_size
        stops = frozenset(t for t in sampling.stop_token_ids if t < vocab)
        return stops | (frozenset() if sampling.ignore_eos else frozenset(self.eos_token_ids))

    # ----------------------------------------------------------------- single-session API
    def prefill(self, tokens: Sequence[int], slot_id: int = 0,
                sampling: Optional[SamplingParams] = None) -> QwenForwardResult:
        """Start slot ``slot_id``'s sequence afresh with ``tokens``; returns the first generated token."""
        with self._lock:
            self._check_slot(slot_id)
            sampling = self._check_sampling(sampling)
            tokens = self.check_prompt(tokens)
            self._check_blocks({slot_id: len(tokens)}, restart=True)
            seq = self._restart(slot_id, len(tokens), sampling, tokens)
            logits, sampled = self._prefill_rounds([seq])
            return QwenForwardResult(sampled[0], logits[0])

    def decode_step(self, token: int, slot_id: int = 0,
                    sampling: Optional[SamplingParams] = None) -> QwenForwardResult:
        """Append ``token`` to the slot's sequence and return the next one."""
        with self._lock:
            self._check_slot(slot_id)
            sampling = self._check_sampling(sampling)
            self._check_token(token, "token")
            self._check_can_extend(slot_id, "slot_id")
            seq = self._seq(slot_id)
            self._set_sampling(seq, sampling)
            out = self._decode([seq], [token])
            return QwenForwardResult(out.sampled[0], out.logits[0])

    def _set_sampling(self, seq: Request, sampling: SamplingParams) -> None:
        """A step's own sampling parameters (the slot API takes them per call), with its seed's noise
        (a pure function of seed and output position: a fork, which shares its source's, draws what
        the source would)."""
        if sampling is not seq.sampling:
            seq.sampling, seq.stop_ids = sampling, self.stop_ids(sampling)
        if seq.generator is None or seq.generator.seed != sampling.seed:
            seq.generator = sampling.make_generator()

    def _check_can_extend(self, slot_id: int, name: str) -> None:
        s = self.kv.slots[slot_id]
        if not s.active or self._seq(slot_id) is None:
            raise ValueError(f"{name} = {slot_id} holds no sequence; call prefill first")
        if s.num_tokens >= self.max_seq_len:
            raise ValueError(f"{name} = {slot_id} is full: {s.num_tokens} tokens = max_seq_len")

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

    def batch_prefill(self, requests: Sequence[QwenBatchedRequest]) -> QwenBatchPrefillResult:
        """Prefill every request into its slot in one forward pass (per chunk round)."""
        with self._lock:
            requests = self._check_requests(requests)
            prompts = [self.check_prompt(r.prompt_tokens, f"requests[{i}].prompt_tokens")
                       for i, r in enumerate(requests)]
            self._check_blocks({r.slot_id: len(p) for r, p in zip(requests, prompts)}, restart=True)
            if not requests:
                return QwenBatchPrefillResult([], [])
            seqs = [self._restart(r.slot_id, len(p), r.sampling, p) for r, p in zip(requests, prompts)]
            _, tokens = self._prefill_rounds(seqs)
            for r, q, t in zip(requests, seqs, tokens):
                r._sequence, r.last_token = q, t
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
                if r._sequence is None or self._seq(r.slot_id) is not r._sequence:
                    raise ValueError(f"requests[{i}] (request_id = {r.request_id!r}) no longer holds slot {r.slot_id}: "
                                     "it was prefilled again or freed since its batch_prefill; was the slot reused?")
            if live:
                for r in live:
                    self._set_sampling(r._sequence, r.sampling)
                out = self._decode([r._sequence for r in live], [r.last_token for r in live])
                for r, t in zip(live, out.sampled):
                    r.last_token = t
            return QwenBatchDecodeResult([r.last_token for r in requests], [r.finished for r in requests])


def _tp_worker_runner(model: torch.nn.Module, config: Any, engine_kwargs: dict) -> ModelRunner:
    """A tensor-parallel worker's runner over its loaded slice (``engine/distributed.py`` calls it by
    name): built from rank 0's engine arguments as rank 0's is, so that both choose the same step."""
    takes = inspect.signature(build_runner).parameters      # the engine's other arguments are rank 0's alone
    return build_runner(model, config, **{k: v for k, v in engine_kwargs.items() if k in takes})
