"""LLM: vLLM-style offline generation over the engine and the continuous-batching scheduler.

    llm = qwen_ops.LLM()                       # the embedded default model
    outs = llm.generate(["def fibonacci(n):"], qwen_ops.SamplingParams(max_tokens=32, temperature=0))
    outs[0].outputs[0].text

Each iteration runs one forward pass over the scheduler's merged prefill chunks and decodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch

from qwen_ops.batch import RequestId
from qwen_ops.engine import QwenEngine
from qwen_ops.runner import SeqChunk
from qwen_ops.sampling import SamplingParams, sample
from qwen_ops.scheduler import Request, Scheduler, SchedulerConfig

Prompt = Union[str, Sequence[int]]

DEFAULT_KV_CACHE_BYTES = 1 << 30     # KV budget when num_kv_blocks is None on the CPU
DEFAULT_MAX_MODEL_LEN = 4096         # cap of the default max_model_len (the model's max_position_embeddings)
CUDA_GRAPH_RESERVE_BYTES = 1 << 30   # kept free on a GPU for activations and CUDA-graph capture


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
                 kv_cache_bytes: Optional[int] = None, check_invariants: bool = False,
                 compile: Optional[bool] = None, decode_buckets: Optional[Sequence[int]] = None,
                 cuda_graphs: Optional[bool] = None, backend: str = "inductor"):
        from qwen_ops.defaults import default_model_path
        from qwen_ops.loader import load_checkpoint

        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode = {preemption_mode!r}, expected 'recompute' or 'swap'")
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
                                 backend=backend)
        self.tokenizer = ckpt.tokenizer
        self.scheduler = Scheduler(self.engine, SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, preemption_mode=preemption_mode, check_invariants=check_invariants))
        self._next_id = 0

    # ------------------------------------------------------------------ inputs
    def _encode(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{index}] is text, but the checkpoint has no tokenizer.json; "
                                 "pass token ids instead")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        return list(prompt)

    def _prepare(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None]
                 ) -> list[tuple[Prompt, list[int], SamplingParams]]:
        """Validate every request before any work; errors name the request index."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
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

    def _add(self, ids: list[int], sp: SamplingParams) -> Request:
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.update(self.engine.eos_token_ids)
        rid = RequestId(self._next_id)
        self._next_id += 1
        return self.scheduler.add_request(rid, ids, sp, frozenset(stops))

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Request]:
        """One iteration: plan, one forward pass, sample, update. Returns the requests it touched."""
        sched = self.scheduler
        plan = sched.schedule()
        if not plan.has_work():
            moved = plan.evicted_requests or plan.swap_out_requests or plan.swap_in_requests
            if sched.has_unfinished() and not sched.running and not moved:
                raise RuntimeError("scheduler made no progress with requests pending (KV cache too small?)")
            return []
        batch = plan.to_scheduled_batch(sched.next_batch_id())
        chunks = [SeqChunk(r.kv_cache_slot, r.token_ids, r.position_offset) for r in batch.requests]
        logits = self.engine.execute(chunks)
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
        reqs = [self._add(ids, sp) for _, ids, sp in prepared]
        try:
            while any(not r.finished for r in reqs):
                self.step()
        finally:
            for r in reqs:
                if not r.finished:
                    self.scheduler.abort(r.request_id)
        return [self._output(r, p, []) for r, (p, _, _) in zip(reqs, prepared)]

    def stream(self, prompts: Union[Prompt, Sequence[Prompt]],
               sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None
               ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` with ``new_token_ids`` whenever a request gains tokens.

        A request that cannot run (bad prompt or sampling values) yields one update with
        ``finish_reason == "error"`` and ``error`` set; the others go on.
        """
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = (sampling_params if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        live: dict[RequestId, tuple[Request, Prompt]] = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                (_, ids, spv), = self._prepare([p], [sp if sp is not None else SamplingParams()])
            except ValueError as e:
                msg = str(e).replace("prompts[0]", f"prompts[{i}]").replace("sampling_params[0]", f"sampling_params[{i}]")
                yield RequestOutput(f"error-{i}", p if isinstance(p, str) else None,
                                    [] if isinstance(p, str) else list(p),
                                    [CompletionOutput(0, "", [], "error")], True, [], msg)
                continue
            req = self._add(ids, spv)
            live[req.request_id] = (req, p)
        seen = {rid: 0 for rid in live}
        try:
            while any(not r.finished for r, _ in live.values()):
                for req in self.step():
                    if req.request_id not in live:
                        continue
                    new = req.output_token_ids[seen[req.request_id]:]
                    if new or req.finished:
                        seen[req.request_id] = len(req.output_token_ids)
                        yield self._output(req, live[req.request_id][1], list(new))
        finally:
            for r, _ in live.values():
                if not r.finished:
                    self.scheduler.abort(r.request_id)

    def abort(self, request_id: Union[str, int, RequestId]) -> None:
        rid = request_id if isinstance(request_id, RequestId) else RequestId(int(request_id))
        self.scheduler.abort(rid)

    def stats(self) -> dict:
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
        }
