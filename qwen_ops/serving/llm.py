"""LLM: vLLM-style offline generation over the engine and the continuous-batching scheduler.

    llm = qwen_ops.LLM()                       # the embedded default model
    outs = llm.generate(["def fibonacci(n):"], qwen_ops.SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

Each iteration runs one forward pass over the scheduler's merged prefill chunks and decodes.

An ``LLM`` may be shared by threads: every call that touches the scheduler (``add_request``,
``step``, ``abort``, ``stats``, and each iteration inside ``generate`` and ``stream``) holds one
lock. Concurrent ``generate`` calls therefore interleave their iterations, and requests from
several threads share forward passes; each caller gets exactly its own outputs.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch

from qwen_ops.engine.batch import RequestId
from qwen_ops.engine.engine import QwenEngine, _compile_backend
from qwen_ops.engine.sampling import SamplingParams, sample
from qwen_ops.serving.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

Prompt = Union[str, Sequence[int], torch.Tensor]

DEFAULT_KV_CACHE_BYTES = 1 << 30     # KV budget when num_kv_blocks is None on the CPU
DEFAULT_MAX_MODEL_LEN = 4096         # cap of the default max_model_len (the model's max_position_embeddings)
CUDA_GRAPH_RESERVE_BYTES = 1 << 30   # kept free on a GPU for activations and CUDA-graph capture
MAX_DEFAULT_SWAP_SPACE_BYTES = 4 << 30   # vLLM's default swap_space (4 GiB)
PROMPTS_EXPECTED = "a str, a list of token ids, a 1-D integer tensor, or a list of those"


def default_swap_space_bytes() -> int:
    """Host memory for swapped KV: a quarter of physical memory, at most 4 GiB (vLLM's default)."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        host = 16 << 30
    return min(MAX_DEFAULT_SWAP_SPACE_BYTES, host // 4)


def _check_int(name: str, value, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}, expected an int >= {low}" + (" or None" if optional else ""))


def _check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device = {device!r}, expected 'cpu', 'cuda' or 'cuda:N'") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible")
            raise ValueError(f"device = {device!r}, but {why}; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device = {device!r}, but only {torch.cuda.device_count()} CUDA devices exist")
    elif dev.type != "cpu":
        raise ValueError(f"device = {device!r}, expected 'cpu', 'cuda' or 'cuda:N'")
    return dev


def normalize_prompts(prompts) -> list:
    """One list of prompts from what ``generate``/``stream`` accept: a str, a list of token ids, a
    1-D tensor (one prompt), a 2-D tensor (one prompt per row), or a list of those."""
    if prompts is None:
        raise ValueError(f"prompts = None, expected {PROMPTS_EXPECTED}")
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            return [prompts]
        if prompts.dim() == 2:
            return list(prompts)
        raise ValueError(f"prompts is a tensor of shape {tuple(prompts.shape)}, expected 1-D (one prompt) "
                         "or 2-D (one prompt per row)")
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts = {prompts!r}, expected {PROMPTS_EXPECTED}")
    if prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
        return [prompts]
    return list(prompts)


def _default_kv_budget(device: torch.device) -> int:
    """Bytes for the KV cache: 1 GiB on the CPU; on a GPU, 90% of what is free after the weights,
    less a reserve for activations and graph capture, taken before the cache is sized."""
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, int(0.9 * (free - CUDA_GRAPH_RESERVE_BYTES)))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None     # "stop", "length", "abort" or "error"
    stop_reason: Optional[int] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)   # tokens added since the last update (stream)
    error: Optional[str] = None


class LLM:
    def __init__(self, model: Union[str, Path, None] = None, *, dtype: Union[str, torch.dtype] = "float32",
                 device: Union[str, torch.device] = "cpu", max_num_seqs: int = 64, max_model_len: Optional[int] = None,
                 block_size: int = 16, num_kv_blocks: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None, preemption_mode: str = "recompute",
                 kv_cache_bytes: Optional[int] = None, swap_space: Optional[int] = None,
                 check_invariants: bool = False,
                 compile: Optional[bool] = None, decode_buckets: Optional[Sequence[int]] = None,
                 cuda_graphs: Optional[bool] = None, compile_backend: str = "inductor",
                 backend: Optional[str] = None):
        """``swap_space``: bytes of host memory for KV swapped out by preemption (vLLM's
        ``swap_space``, which is in GiB); default ``default_swap_space_bytes()``. When it is full,
        preemption recomputes instead (``stats()["num_swap_full_recomputes"]``)."""
        from qwen_ops.models.defaults import default_model_path
        from qwen_ops.models.loader import load_checkpoint

        # Every argument by name, before the (slow) load.
        if model is not None and not isinstance(model, (str, Path)):
            raise ValueError(f"model = {model!r}, expected a checkpoint directory (str or Path) or None")
        _check_int("max_num_seqs", max_num_seqs, 1)
        _check_int("max_model_len", max_model_len, 2, optional=True)
        _check_int("block_size", block_size, 1)
        _check_int("num_kv_blocks", num_kv_blocks, 1, optional=True)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, 1, optional=True)
        _check_int("kv_cache_bytes", kv_cache_bytes, 1, optional=True)
        _check_int("swap_space", swap_space, 0, optional=True)
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode = {preemption_mode!r}, expected 'recompute' or 'swap'")
        for name, flag in (("check_invariants", check_invariants), ("compile", compile), ("cuda_graphs", cuda_graphs)):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name} = {flag!r}, expected True or False" + ("" if name == "check_invariants"
                                                                                  else " or None"))
        if decode_buckets is not None:
            buckets = list(decode_buckets)
            if not buckets:
                raise ValueError("decode_buckets is empty; expected batch sizes >= 1, or None")
            for i, b in enumerate(buckets):
                _check_int(f"decode_buckets[{i}]", b, 1)
        compile_backend = _compile_backend(compile_backend, backend)
        if compile_backend not in ("inductor", "tensorrt"):
            raise ValueError(f"compile_backend = {compile_backend!r}, expected 'inductor' or 'tensorrt'")
        device = _check_device(device)
        ckpt = load_checkpoint(default_model_path() if model is None else model, dtype=dtype, device=device)
        cfg = ckpt.config
        if max_model_len is None:   # the model's own limit, capped so the default KV budget holds one sequence
            max_model_len = min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        per_seq_blocks = -(-max_model_len // block_size)
        if num_kv_blocks is None:
            elem = next(ckpt.model.parameters()).element_size()
            attention_layers = list(ckpt.model.layer_kinds).count("attention")   # hybrid models: 1 in 4
            block_bytes = 2 * attention_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem
            budget = kv_cache_bytes if kv_cache_bytes is not None else _default_kv_budget(next(ckpt.model.parameters()).device)
            num_kv_blocks = min(max_num_seqs * per_seq_blocks, max(per_seq_blocks, budget // block_bytes))
        if num_kv_blocks < per_seq_blocks:
            raise ValueError(f"num_kv_blocks = {num_kv_blocks} cannot hold one sequence of max_model_len = "
                             f"{max_model_len} ({per_seq_blocks} blocks of {block_size}); raise it or lower max_model_len")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(512, max_num_seqs)
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens = {max_num_batched_tokens}, expected >= 1")
        self.engine = QwenEngine(ckpt.model, cfg, max_slots=max_num_seqs, max_seq_len=max_model_len,
                                 block_size=block_size, num_kv_blocks=num_kv_blocks,
                                 tokenizer=ckpt.tokenizer, eos_token_ids=ckpt.eos_token_ids, compile=compile,
                                 decode_buckets=decode_buckets, cuda_graphs=cuda_graphs,
                                 compile_backend=compile_backend)
        self.tokenizer = ckpt.tokenizer
        self.scheduler = Scheduler(self.engine, SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=preemption_mode,
            swap_space_bytes=default_swap_space_bytes() if swap_space is None else swap_space,
            check_invariants=check_invariants))
        self._next_id = 0
        self._lock = threading.RLock()        # serializes every use of the scheduler (module docstring)

    # ------------------------------------------------------------------ inputs
    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{index}] is text, but the checkpoint has no tokenizer.json; "
                                 "pass token ids instead")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex:
                raise ValueError(f"prompts[{index}] is a {prompt.dtype} tensor of shape {tuple(prompt.shape)}, "
                                 "expected a 1-D integer tensor of token ids")
            return prompt.tolist()
        if not isinstance(prompt, Sequence):
            raise ValueError(f"prompts[{index}] = {prompt!r}, expected a str, a list of token ids or a 1-D tensor")
        return list(prompt)

    def _prepare(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None]
                 ) -> list[tuple[Prompt, list[int], SamplingParams]]:
        """Validate every request before any work; errors name the request index.

        The one validation of ``generate``, ``stream`` and ``add_request``."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            params = list(sampling_params)
        else:
            raise ValueError(f"sampling_params = {sampling_params!r}, expected a SamplingParams, a list of them "
                             "(one per prompt), or None")
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries, expected one per prompt ({len(prompts)})")
        out = []
        limit = self.scheduler.config.max_model_len
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] = {sp!r}, expected a qwen_ops.SamplingParams")
            sp.check_vocab(self.engine.vocab_size)
            ids = self._encode(prompt, i)
            if not ids:
                raise ValueError(f"prompts[{i}] is empty; expected at least one token")
            if len(ids) >= limit:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; max_model_len = {limit} leaves no room "
                                 "to generate")
            for j, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.engine.vocab_size:
                    raise ValueError(f"prompts[{i}][{j}] = {t!r}, expected a token id in [0, {self.engine.vocab_size})")
            out.append((prompt, ids, sp))
        return out

    def _add_all(self, prepared: Sequence[tuple[Prompt, list[int], SamplingParams]]) -> list[Request]:
        """Queue every prepared request, or none: a failure part-way aborts the ones already queued."""
        reqs: list[Request] = []
        with self._lock:
            try:
                for _, ids, sp in prepared:
                    rid = RequestId(self._next_id)
                    self._next_id += 1
                    reqs.append(self.scheduler.add_request(rid, ids, sp, self.engine.stop_ids(sp)))
            except BaseException:
                for r in reqs:
                    self.scheduler.abort(r.request_id)
                raise
        return reqs

    def add_request(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> str:
        """Queue one request (validated like ``generate``); ``step()`` runs it. Returns its id."""
        (req,) = self._add_all(self._prepare([prompt], [sampling_params or SamplingParams()]))
        return str(req.request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Request]:
        """One iteration: plan, one forward pass, sample, update. Returns the requests it touched.

        Raises ``SchedulerStuckError`` when requests are pending and none can ever run."""
        with self._lock:
            return self._step()

    def _step(self) -> list[Request]:
        sched = self.scheduler
        plan = sched.schedule()
        if not plan.has_work():
            return []
        batch = plan.to_scheduled_batch(sched.next_batch_id())
        logits = self.engine.execute(batch.requests)
        rows, reqs = [], []
        for row, r in enumerate(batch.requests):
            req = sched.requests[r.request_id]
            if r.seq_len == req.num_tokens:          # the chunk reaches the end: sample the next token
                rows.append(row)
                reqs.append(req)
        sampled = {}
        if rows:
            picked = logits if len(rows) == logits.shape[0] else logits[rows]   # every row: no gather copy
            tokens = sample(picked, [q.sampling for q in reqs], [q.generator for q in reqs]).tolist()
            sampled = {q.request_id: t for q, t in zip(reqs, tokens)}
        return sched.update(plan, sampled)

    def _output(self, req: Request, prompt: Optional[Prompt], new: list[int]) -> RequestOutput:
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else ""
        completion = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason, req.stop_reason)
        return RequestOutput(str(req.request_id), prompt if isinstance(prompt, str) else None,
                             list(req.prompt_token_ids), [completion], req.finished, new)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in prompt order."""
        prepared = self._prepare(prompts, sampling_params)
        reqs = self._add_all(prepared)
        try:
            while any(not r.finished for r in reqs):
                self.step()
        finally:
            self._abort_unfinished(reqs)
        return [self._output(r, p, []) for r, (p, _, _) in zip(reqs, prepared)]

    def _abort_unfinished(self, reqs: Sequence[Request]) -> None:
        with self._lock:
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r.request_id)

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]],
               sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
               ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` with ``new_token_ids`` whenever a request gains tokens.

        Validated exactly like ``generate``, here, before anything is queued: a bad request
        raises ``ValueError`` and none runs. The requests are queued when iteration starts;
        closing the iterator early aborts what is left.
        """
        prepared = self._prepare(prompts, sampling_params)
        return self._stream(prepared)

    def _stream(self, prepared: list[tuple[Prompt, list[int], SamplingParams]]) -> Iterator[RequestOutput]:
        reqs = self._add_all(prepared)
        seen = [0] * len(reqs)
        done = [False] * len(reqs)
        try:
            while True:
                # Report what any iteration (ours or another thread's) produced, then run one more.
                for i, req in enumerate(reqs):
                    if done[i]:
                        continue
                    if req.status is RequestStatus.ABORTED:      # aborted by the caller: no more updates
                        done[i] = True
                        continue
                    new = req.output_token_ids[seen[i]:]
                    if new or req.finished:
                        seen[i] += len(new)
                        done[i] = req.finished
                        yield self._output(req, prepared[i][0], list(new))
                if all(done):
                    return
                self.step()
        finally:
            self._abort_unfinished(reqs)

    def abort(self, request_id: Union[str, int, RequestId]) -> None:
        rid = request_id if isinstance(request_id, RequestId) else RequestId(int(request_id))
        with self._lock:
            self.scheduler.abort(rid)

    def stats(self) -> dict:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict:
        s = self.scheduler
        return {
            "num_preemptions": s.num_preemptions,
            "num_swaps_out": s.num_swaps_out,
            "num_swaps_in": s.num_swaps_in,
            "free_blocks": self.engine.num_free_blocks,
            "total_blocks": self.engine.num_total_blocks,
            "num_iterations": s.num_iterations,
            "mean_batch_size": s.num_scheduled_seqs / s.num_iterations if s.num_iterations else 0.0,
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_swapped": len(s.swapped),
            "swap_space_bytes": s.config.swap_space_bytes,
            "swap_bytes_used": s.swap_bytes_used,
            "num_swap_full_recomputes": s.num_swap_full_recomputes,
            "num_swap_in_recomputes": s.num_swap_in_recomputes,
        }
