"""Model runner: owns the caches (paged KV of attention layers, per-slot state of linear layers),
the device block table and the host copies of swapped KV, and runs one step: ``step(plan)``
applies the plan's swap copies, writes the block-table rows its tasks carry, runs one forward
pass of the model over them and samples the rows that end a request's tokens (``self.sampler``,
engine/sampler.py: the one place tokens are picked and drafts verified).

The scheduler (or the seed's slot API) decides what to run; the runner only packs it into flat
token tensors plus ``AttentionMetadata`` and calls the model once. Under in-process tensor
parallelism every mutating call goes through ``call(method, *args)``: rank 0 sends the method and
its arguments (a step's complete description) to the workers, then every rank runs it
(nano-vllm's ``ModelRunner.call``).

``execute`` is three lines: ``self.inputs`` (engine/inputs.py, the one builder of a step's tensors
and its row layout: static bucket-padded buffers for decode and verify batches, exact shapes for
the rest) builds, ``self.executors`` (engine/executors.py: eager, compiled, CUDA graphs) runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from dataclasses import dataclass

from qwen_ops.engine.batch import BatchedRequest, IterationPlan
from qwen_ops.engine.executors import Executors
from qwen_ops.engine.inputs import InputBuilder, StepInputs
from qwen_ops.engine.pooling import reduce_rows
from qwen_ops.engine.sampler import Sampler, SamplingError
from qwen_ops.models.lora import write_adapter
from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.ops.backend import resolve_backends, use_backend


@dataclass
class RunnerOutput:
    """What one step produced, row for row with the plan's tasks: fp32 ``logits`` [rows, vocab]
    of each task's last token (and of its drafts, before it, for a task with drafts; NaN for a
    prompt chunk that samples nothing, ``BatchedRequest.needs_logits``), the
    ``sampled`` token of each task that samples (else None), and its ``(logprob, rank, top ids,
    top logprobs)`` when its request asked for logprobs. ``emitted``: for a task with drafts,
    the 1 to k + 1 tokens its verification emitted (the accepted drafts, then the target's
    token), else None; ``sampled`` holds the first of them. ``prompt_logprobs``: for a task that
    scores its prompt tokens, ``(logprob, rank, top ids, top logprobs)`` of each, else None.
    ``errors``: per task, the ``SamplingError`` that left it without a token (its request fails
    alone), else None."""

    logits: torch.Tensor
    sampled: list[Optional[int]]
    logprobs: list[Optional[tuple]]
    emitted: Optional[list[Optional[list[int]]]] = None
    prompt_logprobs: Optional[list[Optional[list[tuple]]]] = None
    # The pooling runner's: per task, its pooled rows reduced (engine/pooling.py reduce_rows) or None.
    pooled: Optional[list[Optional[torch.Tensor]]] = None
    errors: Optional[list[Optional[SamplingError]]] = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, max_slots: int,
                 max_blocks_per_slot: int, dtype: torch.dtype, device: torch.device, compile: bool = False,
                 buckets: Optional[Sequence[int]] = None, cuda_graphs: bool = False,
                 compile_backend: str = "inductor", graph_api=None, native_cpu: bool = True,
                 kv_dtype: Optional[torch.dtype] = None, pooling: bool = False):
        self.model = model
        # The pooling runner (engine/pooling.py): its steps return the pooled rows' final-norm hidden
        # states (the decoder, model.model, without the LM head), never logits; one kind per runner.
        if pooling and not isinstance(getattr(model, "model", None), torch.nn.Module):
            raise ValueError(f"pooling = True needs a model with a decoder at .model, got {type(model).__name__}")
        if pooling and "linear" in model.layer_kinds:
            raise ValueError("pooling = True with linear-attention (hybrid) layers is not supported; expected a "
                             "dense Qwen2 / Qwen3 checkpoint")
        self.pooling = pooling
        self.device = device
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype      # the paged KV's dtype: the model's, or fp8 (ops/kv_quant.py)
        self.block_size = block_size
        # Per layer: "attention" layers hold paged KV [num_blocks, block_size, kv_heads, head_dim];
        # "linear" layers (hybrid models) hold per-slot state [max_slots, ...] (conv, recurrent).
        # Both are zero-filled, so unused rows never hold NaN.
        self.layer_kinds = list(model.layer_kinds)
        self.kv_caches = model.allocate_caches(num_blocks, block_size, max_slots, dtype, device,
                                               kv_dtype=self.kv_dtype)
        self.block_table = torch.zeros((max_slots, max_blocks_per_slot), dtype=torch.int32, device=device)
        # The ops' backends, chosen once, now (bound around every forward: no per-call resolution).
        # Resolving also builds the cpu backend's C kernels on first use (a few seconds, once per
        # machine), which the first request would otherwise wait for.
        self.op_backends = resolve_backends(device)
        # The model's layers choose their forward for this device, dtype and backend now, and pack
        # the weights it reads (on the CPU: the cpu backend's ops; models/layers.py), not on the first
        # request. ``native_cpu=False`` keeps every layer on its plain-torch forward (the reference op path).
        self.native_cpu = native_cpu
        # LoRA (models/lora.py): the per-token adapter slots every step writes, when the model has them.
        self.lora_context = getattr(model, "lora_context", None)
        self.refresh_weights()
        # The one builder of every step's tensors (and the static decode / verify buffers), and the
        # executors that run them: eager, compiled, CUDA graphs (engine/inputs.py, engine/executors.py).
        self.inputs = InputBuilder(self, buckets)
        self.executors = Executors(self, self.inputs, compile=compile, compile_backend=compile_backend,
                                   cuda_graphs=cuda_graphs, graph_api=graph_api)
        self._rows: list[tuple[int, ...]] = [()] * max_slots    # what block_table's rows hold (mirror)
        self._host_copies: dict[int, list] = {}                 # swapped KV by handle (BlockCopy)
        self.draft = None            # speculative "draft_model" / "mtp": a DraftRunner / MTPRunner (attach_*)
        self.sampler = Sampler(getattr(getattr(model, "config", None), "vocab_size", None))
        self.workers = None          # in-process TP: the other ranks (call() sends them each call)

    # ------------------------------------------------------------------ one step
    def call(self, method: str, *args: Any) -> Any:
        """Run ``method(*args)`` on this rank and, under in-process tensor parallelism, on every
        worker (rank 0 sends it first; a plan travels without its sampling state)."""
        if self.workers is not None:
            self.workers.broadcast((method, [a.without_sampling() if isinstance(a, IterationPlan) else a
                                             for a in args]))
        return getattr(self, method)(*args)

    def attach_proposer(self, proposer) -> None:
        """Run ``proposer`` (an ``engine/draft.py`` ``DraftRunner`` over a draft model, or an
        ``engine/mtp.py`` ``MTPRunner`` over the model's own MTP layer, built on this runner) as the
        proposer of speculative decoding, in this runner's slots and blocks."""
        self.draft = proposer

    # The executor choice and the compile settings live in ``self.executors`` (engine/executors.py).
    def executor_for(self, chunks: Sequence[BatchedRequest]) -> str:
        return self.executors.executor_for(chunks)

    def set_verify_rows(self, rows: int) -> None:
        self.executors.set_verify_rows(rows)

    @property
    def compiled(self) -> bool:
        return self.executors.compiled

    @property
    def cuda_graphs(self) -> bool:
        return self.executors.cuda_graphs

    @torch.inference_mode()
    def step(self, plan: IterationPlan) -> RunnerOutput:
        """One step (module docstring): swaps, block-table rows, forward, sampling."""
        for handle in plan.freed_swaps:
            self._host_copies.pop(handle, None)
        for c in plan.swap_out_requests:
            self._host_copies[c.handle] = self.copy_out(c.slot, c.block_ids)
        for c in plan.swap_in_requests:
            self.copy_in(c.slot, c.block_ids, self._host_copies.pop(c.handle))
        tasks = plan.tasks()
        if self.pooling:
            return self.pool(tasks)
        if self.draft is not None:
            tasks = self.draft.propose(tasks)
        masks = self.sampler.start_grammar_masks(tasks)     # beside the forward pass when that pays
        speculating = any(t.draft_token_ids for t in tasks)
        saved = self._save_linear_state(tasks) if speculating and "linear" in self.layer_kinds else None
        logits, layout = self.forward(tasks)
        # speculative "mtp": the target's final hidden state of every row (a later forward of the
        # hybrid rollback would replace it)
        hidden = self.model.hidden_out if getattr(self.model, "keep_hidden", False) else None
        grammar_mask = (masks[0], masks[1].result()) if masks is not None else None
        prompt_lps = None
        # Prefill chunks that score their prompt tokens: every row's logits came back, in the model's dtype.
        scoring = bool(plan.prefill_tasks) and any(t.prompt_logprob_ids for t in plan.prefill_tasks)
        if scoring or speculating:
            first, last = layout.logit_rows()      # which logits rows are each task's (the one place)
        if scoring:
            prompt_lps = self.sampler.prompt_logprobs(tasks, logits, first)
        if not speculating:
            if scoring:
                if logits.shape[0] != len(tasks):
                    logits = logits[torch.tensor(last, device=logits.device)]
                logits = logits.float()
            sampled, logprobs, errors = self.sampler.sample_rows(tasks, logits, grammar_mask)
            if self.draft is not None and hidden is not None:
                self.draft.kept(tasks, [None] * len(tasks), hidden, layout.row_starts)
            return RunnerOutput(logits, sampled, logprobs, prompt_logprobs=prompt_lps, errors=errors)
        if scoring:
            logits = logits.float()
        sampled, logprobs, errors = self.sampler.sample_rows(
            [replace(t, sampling=None) if t.draft_token_ids else t for t in tasks],
            logits[torch.tensor(last, device=logits.device)], grammar_mask)
        emitted, verify_errors = self.sampler.verify(tasks, logits, first)
        for i, (e, err) in enumerate(zip(emitted, verify_errors)):
            if e is not None:
                sampled[i] = e[0]
            errors[i] = errors[i] or err
        if saved is not None:
            self._rollback_linear_state(tasks, emitted, saved)
        if self.draft is not None:
            self.draft.kept(tasks, emitted, hidden, layout.row_starts)
        return RunnerOutput(logits, sampled, logprobs, emitted, prompt_logprobs=prompt_lps, errors=errors)

    def pool(self, tasks: Sequence[BatchedRequest]) -> RunnerOutput:
        """A pooling step: one forward of the decoder, the pooled rows of each task reduced."""
        hidden, layout = self.forward(tasks)
        pooled = [reduce_rows(t.pooling.pooling_type, hidden[a:b + 1]) for t, a, b in zip(tasks, *layout.logit_rows())]
        none = [None] * len(tasks)
        # ``logits`` holds the pooled rows' hidden states here: a pooling step computes no logits.
        return RunnerOutput(hidden, none, list(none), pooled=pooled)

    def _save_linear_state(self, tasks: Sequence[BatchedRequest]) -> dict[int, list[tuple[torch.Tensor, ...]]]:
        """Copies of the linear-attention state rows of the slots that verify drafts (hybrid models)."""
        return {t.kv_cache_slot: [(a[t.kv_cache_slot].clone(), b[t.kv_cache_slot].clone())
                                  for kind, (a, b) in zip(self.layer_kinds, self.kv_caches) if kind == "linear"]
                for t in tasks if t.draft_token_ids}

    def _rollback_linear_state(self, tasks: Sequence[BatchedRequest], emitted: Sequence[Optional[list[int]]],
                               saved: dict[int, list[tuple[torch.Tensor, ...]]]) -> None:
        """Where a draft was rejected, put the slot's linear-layer state back as it was before the
        pass and feed the accepted prefix again, so the state holds exactly the kept tokens (the
        attention KV of those rows is rewritten with the same tokens). A recompute from the saved
        state: one more forward pass of the kept rows, only in steps that rejected a draft."""
        redo = []
        for t, e in zip(tasks, emitted):
            if e is None or len(e) - 1 == len(t.draft_token_ids):
                continue                       # every draft kept: the state is the kept tokens'
            rows = saved[t.kv_cache_slot]
            linear = (i for i, kind in enumerate(self.layer_kinds) if kind == "linear")
            for i, (sa, sb) in zip(linear, rows):
                a, b = self.kv_caches[i]
                a[t.kv_cache_slot] = sa
                b[t.kv_cache_slot] = sb
            keep = len(t.token_ids) - len(t.draft_token_ids) + len(e) - 1
            redo.append(t.rows(t.token_ids[:keep], t.position_offset))
        if redo:
            self.execute(redo)

    def write_block_rows(self, tasks: Sequence[BatchedRequest]) -> None:
        """Write the block-table rows that the tasks' ``block_table``s changed (the one writer)."""
        rows = self._rows
        for t in tasks:
            bt = t.block_table
            if bt and rows[t.kv_cache_slot] != bt:
                self.set_block_row(t.kv_cache_slot, bt)

    def _run_uncompiled(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        attn: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """An eager step: the model's forward."""
        return self.model(input_ids, positions, attn, self.kv_caches, logits_indices)

    def load_lora(self, slot: int, adapter) -> None:
        """Write a parsed LoRA adapter into the model's slot ``slot`` (None: clear it; models/lora.py)."""
        write_adapter(self.model, slot, adapter)

    def refresh_weights(self) -> None:
        """Let the model's layers choose their forward and repack their weights (after the weights changed)."""
        pack = getattr(self.model, "process_weights_after_loading", None)
        if pack is None:
            return
        if self.native_cpu:
            pack()
        else:
            with use_backend("reference"):     # every layer on its plain-torch forward
                pack()

    def _layers(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[self._layers("attention")[0]][0].shape[0]

    def set_block_row(self, slot: int, blocks: Sequence[int]) -> None:
        """Make ``block_table[slot, :len(blocks)]`` name ``blocks`` (later columns are left as junk)."""
        if blocks:
            self.block_table[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.device)
            self._rows[slot] = tuple(blocks)

    def _grow_dim0(self, layers: list[int], size: int) -> None:
        for i in layers:
            grown = []
            for t in self.kv_caches[i]:
                if size > t.shape[0]:
                    bigger = torch.zeros((size,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                    bigger[:t.shape[0]] = t
                    t = bigger
                grown.append(t)
            self.kv_caches[i] = tuple(grown)
        self.executors.drop_graphs()

    def grow_slots(self, max_slots: int) -> None:
        """More slots: block-table rows, and per-slot state rows of linear layers."""
        rows, cols = self.block_table.shape
        if max_slots > rows:
            grown = torch.zeros((max_slots, cols), dtype=torch.int32, device=self.device)
            grown[:rows] = self.block_table
            self.block_table = grown
            self._rows = self._rows + [()] * (max_slots - rows)
            self._grow_dim0(self._layers("linear"), max_slots)

    def grow(self, max_slots: int, num_blocks: int) -> None:
        """More slots and physical blocks (the seed API's ``allocate_batch_slots``)."""
        self.grow_slots(max_slots)
        self.grow_blocks(num_blocks)
        if self.draft is not None:
            self.draft.runner.grow(max_slots, num_blocks)

    def grow_blocks(self, num_blocks: int) -> None:
        """Add physical KV blocks at the end; existing block ids keep their contents."""
        if num_blocks > self.num_blocks:
            self._grow_dim0(self._layers("attention"), num_blocks)

    def copy_out(self, slot: int, blocks: Sequence[int]) -> list:
        """Host copies of a slot's KV ``blocks`` (attention layers) and state rows (linear layers);
        with a draft model, then the draft's KV and its pending token (``engine/draft.py``)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        saved = [(a[idx].to("cpu"), b[idx].to("cpu")) if kind == "attention"
                 else (a[slot].to("cpu"), b[slot].to("cpu"))
                 for kind, (a, b) in zip(self.layer_kinds, self.kv_caches)]
        if self.draft is not None:
            saved.append((self.draft.runner.copy_out(slot, blocks), self.draft.pending.pop(slot, None)))
        return saved

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy KV block ``src`` into ``dst`` in every attention layer, for each ``(src, dst)``
        (a forked slot's own copy of a partial block: ``KVCacheManager.fork``)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for kind, (a, b) in zip(self.layer_kinds, self.kv_caches):
            if kind == "attention":
                a[dst] = a[src]
                b[dst] = b[src]

    def host_copy_nbytes(self, num_blocks: int) -> int:
        """Bytes that ``copy_out`` of a slot holding ``num_blocks`` blocks puts in host memory."""
        total = 0
        for kind, (a, b) in zip(self.layer_kinds, self.kv_caches):
            for t in (a, b):
                row = t[0].numel() * t.element_size()      # one block (attention) or one slot's state
                total += row * (num_blocks if kind == "attention" else 1)
        if self.draft is not None:
            total += self.draft.runner.host_copy_nbytes(num_blocks)
        return total

    def copy_in(self, slot: int, blocks: Sequence[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Inverse of ``copy_out``, into (possibly different) ``blocks`` and ``slot``."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        if self.draft is not None:
            draft_saved, pending = saved[len(self.kv_caches)]
            self.draft.runner.copy_in(slot, blocks, draft_saved)
            if pending is not None:
                self.draft.pending[slot] = pending
        for kind, (a, b), (ha, hb) in zip(self.layer_kinds, self.kv_caches, saved):
            if kind == "attention":
                a[idx] = ha.to(self.device)
                b[idx] = hb.to(self.device)
            else:
                a[slot] = ha.to(self.device)
                b[slot] = hb.to(self.device)

    def execute(self, chunks: Sequence[BatchedRequest]) -> torch.Tensor:
        """One forward over all chunks; returns fp32 logits [rows, vocab] of each chunk's last token,
        and of its drafts before it for a chunk with drafts (``num_logit_rows`` per chunk; a scored
        prompt's rows in the model's dtype). The pooling runner's: the model-dtype final-norm hidden
        states [rows, hidden] of each chunk's ``pool_rows``, in chunk order."""
        return self.forward(chunks)[0]

    @torch.inference_mode()
    def forward(self, chunks: Sequence[BatchedRequest]) -> tuple[torch.Tensor, StepInputs]:
        """``execute``'s output and its layout (``StepInputs.logit_rows``): the inputs are built by
        ``self.inputs`` (engine/inputs.py) and run by ``self.executors`` (engine/executors.py)."""
        self.write_block_rows(chunks)
        step, out = self.executors.execute(chunks)
        return step.finish(out), step
