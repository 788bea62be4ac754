"""The static steps of a ``ModelRunner``: decode (one token per sequence) and speculative verify
(``verify_rows`` per sequence) batches copied into static buffers sized for the largest bucket, run
by one of three executors, chosen per step by ``executor_for`` and nowhere else:

- "eager": the model's forward as written, at the batch's exact size;
- "compiled": the same step ``torch.compile``d with ``fullgraph=True`` (padded to a bucket: one
  graph for batch 1 and one dynamic in the batch for the other buckets);
- "cuda_graph": the compiled step captured into CUDA graphs, one per bucket, largest first, into
  one memory pool, and replayed.

Padding rows carry slot -1 (nothing is read or written for them), so a replay needs no branches.
Everything else (prefill, mixed and oversized batches) is the runner's eager step with exact
shapes (``ModelRunner.execute``). The caches and the block table are the runner's: this reads them
at each call, since growing the cache replaces them (``drop_graphs``).
"""

from __future__ import annotations

import bisect
import types
from typing import Optional, Sequence

import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.ops.backend import bound_backends, trusted_metadata
from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.torch_library import SCHEMAS


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 8 up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_batch]
    sizes += list(range(24, max_batch, 8))
    return sizes + [max_batch]


def _own_code(method):
    """``method`` (a bound method) with its function's code object copied for this engine alone.
    Dynamo keeps compiled graphs per code object; with the module guards dropped (below) a second
    engine of the process would otherwise reuse the first one's graphs on its own, different model
    (measured: a compiled dense model's graph run on a MoE model's modules). One code object per
    engine keeps each engine's graphs its own, with no global ``torch._dynamo.reset()``."""
    func = method.__func__
    clone = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                               func.__closure__)
    clone.__kwdefaults__, clone.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(clone, method.__self__)


def _compile_decode(fn, backend: str, device: torch.device, cpp_wrapper: bool = True):
    """``torch.compile`` the decode step: Inductor, or Torch-TensorRT (``compile_backend="tensorrt"``).

    On the CPU, Inductor emits a C++ wrapper (``cpp_wrapper``) instead of a Python one (faster
    per step, for a few seconds more of cold compile: benchmarks/README.md). On CUDA the step is
    replayed from a CUDA graph, where the wrapper's cost does not recur.

    Dynamo's guards on the model's modules are dropped (``guard_filter_fn``), as vLLM drops
    guards after its first compile: the engine owns the model, whose structure, shapes and dtypes
    do not change under it, and re-checking every module and parameter cost about a tenth of a
    CPU decode step. Parameter *values* are still read at every call (they are graph inputs), so
    weight updates take effect; ``tests/test_runner.py`` checks it.

    ``cpp_wrapper=False`` keeps the Python wrapper: the C++ one cannot call the functional
    collectives of a tensor-parallel model yet.
    """
    if isinstance(fn, types.MethodType):
        fn = _own_code(fn)
    if backend == "inductor":
        options = {"cpp_wrapper": True} if device.type == "cpu" and cpp_wrapper else {}
        skip_module_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        if skip_module_guards is not None:
            options["guard_filter_fn"] = skip_module_guards
        return torch.compile(fn, fullgraph=True, options=options or None)
    if backend == "tensorrt":
        try:
            import torch_tensorrt  # noqa: F401  (registers the "torch_tensorrt" compile backend)
        except ImportError as e:
            raise RuntimeError("compile_backend='tensorrt' needs the torch-tensorrt package "
                               "(pip install 'qwen_ops[tensorrt]') and a CUDA GPU") from e
        # torch.ops.qwen.* are not TensorRT layers: they keep running in PyTorch between engines.
        return torch.compile(fn, fullgraph=False, backend="torch_tensorrt",
                             options={"torch_executed_ops": {f"torch.ops.qwen.{op}.default" for op in SCHEMAS},
                                      "min_block_size": 1})
    raise ValueError(f"compile_backend = {backend!r}, expected 'inductor' or 'tensorrt'")


class CudaGraphAPI:
    """What the runner needs of CUDA graphs: warm up a step, capture it into a graph in a shared
    memory pool, and measure memory. Tests on the CPU pass a stand-in with the same methods
    (``tests/test_graph_executor.py``), so the runner's own capture and replay logic (buckets,
    padding, output slicing, static buffers) is exercised where no GPU exists."""

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def warm_up(self, step) -> None:
        """Run ``step`` on a side stream (compiling it) before capture, as torch requires."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, step, pool):
        """``(graph, output, pool)``: ``step`` captured; its output tensor is rewritten by each replay."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()
        return graph, out, graph.pool() if pool is None else pool


class StaticSteps:
    """The static decode and verify buffers of ``runner``, their compiled steps and CUDA graphs."""

    def __init__(self, runner, *, buckets: Optional[Sequence[int]], compile: bool, compile_backend: str,
                 cuda_graphs: bool, graph_api=None):
        self.runner = runner
        self.device = runner.device
        self.buckets = sorted(set(buckets)) if buckets else decode_buckets(runner.block_table.shape[0])
        if self.buckets[0] < 1:
            raise ValueError(f"buckets = {list(buckets)}, expected sizes >= 1")
        if cuda_graphs and self.device.type != "cuda" and graph_api is None:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device {self.device}")
        if compile_backend == "tensorrt":
            if self.device.type != "cuda":
                raise ValueError(f"compile_backend='tensorrt' needs a CUDA device, got device {self.device}")
            compile = True
        self.compiled = compile
        self.compile_backend = compile_backend
        self._alloc_decode_buffers()
        # The step that CUDA graphs capture: compiled, or the model's forward as written.
        self._decode_step = (_compile_decode(self._decode_forward, compile_backend, self.device,
                                             cpp_wrapper=getattr(runner.model, "tp", None) is None) if compile
                             else self._decode_forward)
        self.cuda_graphs = cuda_graphs
        self.graph_api = graph_api if graph_api is not None else (CudaGraphAPI(self.device) if cuda_graphs else None)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        # Speculative decoding's verify steps (set_verify_rows): k + 1 rows per sequence, static buffers.
        self.verify_rows: Optional[int] = None
        self.verify_graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self._verify_step = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def drop_graphs(self) -> None:
        """Captured graphs hold the old cache/table addresses: drop them (recaptured on demand)."""
        self.graphs.clear()
        self.verify_graphs.clear()

    def _alloc_decode_buffers(self) -> None:
        """Static decode inputs for the largest bucket; a batch of B uses the first B rows."""
        n, dev = self.buckets[-1], self.device
        self.buf_input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.buf_positions = torch.zeros(n, dtype=torch.int32, device=dev)
        self.buf_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)   # slot_ids == seq_slots in decode
        self.buf_seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.buf_query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)  # never changes
        self.buf_logits_indices = torch.arange(n, dtype=torch.long, device=dev)        # never changes


    def set_verify_rows(self, rows: int) -> None:
        """Give verify steps (decodes with up to ``rows - 1`` drafts) static buffers of ``rows`` rows
        per sequence, bucketed like decode: compiled and captured too when decode is (a bucket of
        B sequences is B x rows query rows; rows a sequence does not fill carry slot -1)."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 2:
            raise ValueError(f"rows = {rows!r}, expected an int >= 2 (num_speculative_tokens + 1)")
        self.verify_rows = rows
        # A sequence's R rows take positions offset .. offset + R - 1 even where it has fewer tokens:
        # they must stay inside its block-table row and the model's RoPE table (else: eager).
        rope = getattr(getattr(getattr(self.runner.model, "model", None), "rotary_emb", None), "cos_sin", None)
        self._verify_max_len = self.runner.block_table.shape[1] * self.runner.block_size
        if rope is not None:
            self._verify_max_len = min(self._verify_max_len, rope.shape[0])
        n, dev = self.buckets[-1], self.device
        self.vbuf_input_ids = torch.zeros(n * rows, dtype=torch.long, device=dev)
        self.vbuf_positions = torch.zeros(n * rows, dtype=torch.int32, device=dev)
        self.vbuf_slot_ids = torch.full((n * rows,), -1, dtype=torch.int32, device=dev)
        self.vbuf_seq_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.vbuf_seq_lens = torch.full((n,), rows, dtype=torch.int32, device=dev)
        self.vbuf_query_start_loc = torch.arange(0, n * rows + 1, rows, dtype=torch.int32, device=dev)
        self.vbuf_logits_indices = torch.arange(n * rows, dtype=torch.long, device=dev)
        self._verify_step = (_compile_decode(self._verify_forward, self.compile_backend, dev,
                                             cpp_wrapper=getattr(self.runner.model, "tp", None) is None)
                             if self.compiled else self._verify_forward)
        self.verify_graphs.clear()


    def _verify_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                        seq_slots: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        logits_indices: torch.Tensor) -> torch.Tensor:
        """The verify step that is compiled and captured: ``verify_rows`` query rows per sequence."""
        attn = AttentionMetadata(slot_ids=slot_ids, seq_slots=seq_slots, block_table=self.runner.block_table,
                                 query_start_loc=query_start_loc, seq_lens=seq_lens, max_query_len=self.verify_rows)
        return self.runner.model(input_ids, positions, attn, self.runner.kv_caches, logits_indices)


    def is_static_verify(self, chunks: Sequence[BatchedRequest]) -> bool:
        """Decodes only, some with drafts, each within ``verify_rows`` rows, no more sequences than the
        largest bucket. Hybrid models only when every decode fills its rows (a padding row would
        advance its linear-layer state, which the rollback restores only after a rejection)."""
        rows = self.verify_rows
        if rows is None or len(chunks) > self.buckets[-1] or any(c.is_prefill or len(c.token_ids) > rows
                                                                 or c.position_offset + rows > self._verify_max_len
                                                                 for c in chunks):
            return False
        if not any(c.draft_token_ids for c in chunks):
            return False
        return "linear" not in self.runner.layer_kinds or all(len(c.token_ids) == rows for c in chunks)


    def fill_verify_buffers(self, chunks: Sequence[BatchedRequest], bucket: int) -> None:
        """Copy a verify batch into the static buffers: sequence i owns rows i*R .. i*R+R-1 at
        positions offset.., the rows past its tokens and the sequences past the batch slot -1."""
        R, n = self.verify_rows, len(chunks)
        rows: list[list[int]] = []                      # (token, position, slot) per row
        for c in chunks:
            m, p0, slot = len(c.token_ids), c.position_offset, c.kv_cache_slot
            rows += [[t, p0 + j, slot] for j, t in enumerate(c.token_ids)]
            rows += [[0, p0 + j, -1] for j in range(m, R)]
        rows += [[0, 0, -1]] * ((bucket - n) * R)
        host = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        seq = torch.tensor([[c.kv_cache_slot, c.position_offset + R] for c in chunks] + [[-1, R]] * (bucket - n),
                           dtype=torch.long).to(self.device, non_blocking=True)
        total = bucket * R
        if self.runner.lora_context is not None:
            self.runner.lora_context.set_indices(torch.tensor(
                [c.lora_slot for c in chunks for _ in range(R)] + [-1] * ((bucket - n) * R), dtype=torch.int32))
        self.vbuf_input_ids[:total].copy_(host[:, 0])
        self.vbuf_positions[:total].copy_(host[:, 1])
        self.vbuf_slot_ids[:total].copy_(host[:, 2])
        self.vbuf_seq_slots[:bucket].copy_(seq[:, 0])
        self.vbuf_seq_lens[:bucket].copy_(seq[:, 1])


    def verify_inputs(self, bucket: int) -> tuple[torch.Tensor, ...]:
        rows = bucket * self.verify_rows
        inputs = (self.vbuf_input_ids[:rows], self.vbuf_positions[:rows], self.vbuf_slot_ids[:rows],
                  self.vbuf_seq_slots[:bucket], self.vbuf_query_start_loc[:bucket + 1], self.vbuf_seq_lens[:bucket],
                  self.vbuf_logits_indices[:rows])
        return self._dynamic_above_one(inputs, bucket)


    @torch.inference_mode()
    def execute_verify(self, chunks: Sequence[BatchedRequest], executor: str) -> torch.Tensor:
        """A static verify step (``is_static_verify``); returns the chunks' logits rows in
        ``execute``'s layout (``num_logit_rows`` per chunk)."""
        static = executor in ("cuda_graph", "compiled")
        bucket = self.bucket_for(len(chunks)) if static else len(chunks)
        if executor == "cuda_graph" and not self.verify_graphs:
            self.capture()
        self.fill_verify_buffers(chunks, bucket)
        self.runner.row_starts = [i * self.verify_rows for i in range(len(chunks))]
        if executor == "cuda_graph":
            graph, out = self.verify_graphs[bucket]
            graph.replay()
            logits = out
        else:
            with trusted_metadata(), bound_backends(self.runner.op_backends):
                logits = self._verify_step(*self.verify_inputs(bucket)) if static else \
                    self._verify_forward(*self.verify_inputs(bucket))
        R = self.verify_rows
        keep = [i * R + j for i, c in enumerate(chunks) for j in range(c.num_logit_rows)]
        return logits[torch.tensor(keep, device=logits.device)].float()


    def bucket_for(self, n: int) -> Optional[int]:
        """The smallest bucket holding ``n`` sequences, or None above the largest."""
        i = bisect.bisect_left(self.buckets, n)
        return self.buckets[i] if i < len(self.buckets) else None


    def is_static_decode(self, chunks: Sequence[BatchedRequest]) -> bool:
        """One token per sequence and no more sequences than the largest bucket: a step that the
        static decode buffers (and so the compiled step and the CUDA graphs) can take."""
        return all(len(c.token_ids) == 1 for c in chunks) and len(chunks) <= self.buckets[-1]


    def executor_for(self, chunks: Sequence[BatchedRequest]) -> str:
        """Which executor runs a step of ``chunks``, decided here and only here:

        - "cuda_graph": a static decode (or verify) batch, with CUDA graphs on;
        - "compiled": the same without CUDA graphs, with ``compile=True``;
        - "eager": the model's forward as written.
        """
        if self.is_static_decode(chunks) or self.is_static_verify(chunks):
            return self.static_executor()
        return "eager"

    def static_executor(self) -> str:
        """``executor_for`` a step known to be static."""
        return "cuda_graph" if self.cuda_graphs else "compiled" if self.compiled else "eager"


    def _decode_attn(self, slots: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(slot_ids=slots, seq_slots=slots, block_table=self.runner.block_table,
                                 query_start_loc=query_start_loc, seq_lens=seq_lens, max_query_len=1)


    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        logits_indices: torch.Tensor) -> torch.Tensor:
        """The decode step that is compiled and captured: one token per sequence, bucket-sized shapes."""
        return self.runner.model(input_ids, positions, self._decode_attn(slots, query_start_loc, seq_lens),
                          self.runner.kv_caches, logits_indices)


    def fill_decode_buffers(self, chunks: Sequence[BatchedRequest], bucket: int) -> None:
        """Copy a decode batch into the static buffers; rows n..bucket-1 become slot -1 padding."""
        n = len(chunks)
        host = torch.tensor([[c.token_ids[0], c.position_offset, c.kv_cache_slot, c.position_offset + 1] for c in chunks]
                            + [[0, 0, -1, 1]] * (bucket - n), dtype=torch.long)
        host = host.to(self.device, non_blocking=True)
        self.buf_input_ids[:bucket].copy_(host[:, 0])
        self.buf_positions[:bucket].copy_(host[:, 1])
        self.buf_slots[:bucket].copy_(host[:, 2])
        self.buf_seq_lens[:bucket].copy_(host[:, 3])
        if self.runner.lora_context is not None:       # its buffer is a static input of the compiled step and graphs
            self.runner.lora_context.set_indices(torch.tensor([c.lora_slot for c in chunks] + [-1] * (bucket - n),
                                                       dtype=torch.int32))


    def decode_inputs(self, bucket: int) -> tuple[torch.Tensor, ...]:
        inputs = (self.buf_input_ids[:bucket], self.buf_positions[:bucket], self.buf_slots[:bucket],
                  self.buf_query_start_loc[:bucket + 1], self.buf_seq_lens[:bucket],
                  self.buf_logits_indices[:bucket])
        return self._dynamic_above_one(inputs, bucket)


    def _dynamic_above_one(self, inputs: tuple[torch.Tensor, ...], bucket: int) -> tuple[torch.Tensor, ...]:
        """Compiled steps: mark dim 0 dynamic above bucket 1, so one graph serves every bucket
        above 1 instead of a recompile per size."""
        if self.compiled and bucket > 1:
            for t in inputs:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return inputs

    @torch.inference_mode()
    def execute_decode(self, chunks: Sequence[BatchedRequest], executor: Optional[str] = None) -> torch.Tensor:
        """A static decode step (``is_static_decode``) on ``executor`` (default: ``executor_for``)."""
        executor = executor or self.executor_for(chunks)
        # Buckets exist for compiled graphs and CUDA graphs (a few fixed shapes); an uncompiled step
        # runs at its exact size, where padding rows would only add work (up to a third more at 17-of-24).
        static = executor in ("cuda_graph", "compiled")
        bucket = self.bucket_for(len(chunks)) if static else len(chunks)
        if executor == "cuda_graph" and not self.graphs:
            self.capture()              # before filling: capture runs on (and leaves) all-padding buffers
        self.fill_decode_buffers(chunks, bucket)
        self.runner.row_starts = list(range(len(chunks)))
        if executor == "cuda_graph":
            graph, out = self.graphs[bucket]
            graph.replay()
            # The graph's output buffer is overwritten by the next replay: hand out a copy.
            return out[:len(chunks)].to(torch.float32, copy=True)
        inputs = self.decode_inputs(bucket)
        # Index tensors built from the KV-cache manager's own block ids; the ops' backends chosen at construction.
        with trusted_metadata(), bound_backends(self.runner.op_backends):
            if static:
                logits = self._decode_step(*inputs)
            else:
                ids, pos, slots, qsl, seq_lens, logits_indices = inputs
                logits = self.runner._run_uncompiled(ids, pos, self._decode_attn(slots, qsl, seq_lens),
                                                     logits_indices)
        return logits[:len(chunks)].float()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the decode step of every bucket into CUDA graphs, largest first, one memory pool.

        Capture runs on all-padding inputs (slot -1: nothing is written). Replays read the
        static buffers, which ``fill_decode_buffers`` rewrites in full up to the bucket size
        before every replay, so no stale row from an earlier batch is ever read.
        """
        import time

        api = self.graph_api
        self.graphs.clear()
        api.synchronize()
        free_before = api.free_bytes()
        t0 = time.perf_counter()
        pool = self._capture_buckets(self.graphs, self.fill_decode_buffers, self.decode_inputs, self._decode_step,
                                     None)
        if self.verify_rows is not None:
            self.verify_graphs.clear()
            self._capture_buckets(self.verify_graphs, self.fill_verify_buffers, self.verify_inputs,
                                  self._verify_step, pool)
        api.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - api.free_bytes())

    def _capture_buckets(self, graphs: dict, fill, inputs_of, step_fn, pool):
        """One graph per bucket, largest first, into ``graphs`` (``fill(chunks, bucket)`` and
        ``inputs_of(bucket)`` give the static buffers ``step_fn`` reads); returns the memory pool."""
        api = self.graph_api
        for bucket in reversed(self.buckets):
            fill([], bucket)
            inputs = inputs_of(bucket)

            def step(inputs=inputs):
                with trusted_metadata(), bound_backends(self.runner.op_backends):   # what the graph replays
                    return step_fn(*inputs)

            api.warm_up(step)                      # (and compile) outside the capture
            graph, out, pool = api.capture(step, pool)
            graphs[bucket] = (graph, out)
        return pool
