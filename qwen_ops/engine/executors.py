"""The executors of a ``ModelRunner``: they only run the inputs ``engine/inputs.py`` built. One of
three runs each step, chosen by ``executor_for`` and nowhere else:

- "eager": the model's forward as written (every prefill, mixed, oversized or pooling step, and
  static steps when nothing is compiled);
- "compiled": a decode or verify step ``torch.compile``d with ``fullgraph=True`` over the static
  buffers, padded to a bucket (one graph for batch 1, one dynamic in the batch for the others);
- "cuda_graph": the compiled step captured into CUDA graphs, one per bucket, largest first, into
  one memory pool, and replayed.

The caches and the block table are the runner's: read at each call, since growing the cache
replaces them (``drop_graphs``).
"""

from __future__ import annotations

import types
from typing import Sequence

import torch

from qwen_ops.engine.batch import BatchedRequest
from qwen_ops.engine.inputs import InputBuilder, StepInputs
from qwen_ops.ops.backend import bound_backends, trusted_metadata
from qwen_ops.ops.metadata import AttentionMetadata
from qwen_ops.torch_library import SCHEMAS


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


class Executors:
    """The compiled decode and verify steps of ``runner`` and their CUDA graphs, over ``inputs``' buffers."""

    def __init__(self, runner, inputs: InputBuilder, *, compile: bool, compile_backend: str, cuda_graphs: bool,
                 graph_api=None):
        self.runner = runner
        self.inputs = inputs
        device = runner.device
        if cuda_graphs and device.type != "cuda" and graph_api is None:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device {device}")
        if compile_backend == "tensorrt":
            if device.type != "cuda":
                raise ValueError(f"compile_backend='tensorrt' needs a CUDA device, got device {device}")
            compile = True
        self.compiled = compile
        self.compile_backend = compile_backend
        self._cpp_wrapper = getattr(runner.model, "tp", None) is None
        # The step that CUDA graphs capture: compiled, or the model's forward as written.
        self._decode_step = (_compile_decode(self._decode_forward, compile_backend, device, self._cpp_wrapper)
                             if compile else self._decode_forward)
        self._verify_step = None                   # set_verify_rows
        self.cuda_graphs = cuda_graphs
        self.graph_api = graph_api if graph_api is not None else (CudaGraphAPI(device) if cuda_graphs else None)
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.verify_graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def set_verify_rows(self, rows: int) -> None:
        """Verify steps (decodes with up to ``rows - 1`` drafts) get static buffers of ``rows`` rows per
        sequence, bucketed like decode: compiled and captured too when decode is."""
        self.inputs.set_verify_rows(rows)
        self._verify_step = (_compile_decode(self._verify_forward, self.compile_backend, self.runner.device,
                                             self._cpp_wrapper) if self.compiled else self._verify_forward)
        self.verify_graphs.clear()

    def drop_graphs(self) -> None:
        """Captured graphs hold the old cache/table addresses: drop them (recaptured on demand)."""
        self.graphs.clear()
        self.verify_graphs.clear()

    def executor_for(self, chunks: Sequence[BatchedRequest]) -> str:
        """Which executor runs a step of ``chunks``, decided here and only here."""
        return self.static_executor() if self.inputs.kind_of(chunks) in ("decode", "verify") else "eager"

    def static_executor(self) -> str:
        """``executor_for`` a decode or verify step."""
        return "cuda_graph" if self.cuda_graphs else "compiled" if self.compiled else "eager"

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def execute(self, chunks: Sequence[BatchedRequest]) -> tuple[StepInputs, torch.Tensor]:
        """Build the step's inputs and run them: ``(inputs, the forward's output)``."""
        kind = self.inputs.kind_of(chunks)
        executor = "eager"
        if kind == "decode" or kind == "verify":
            executor = "cuda_graph" if self.cuda_graphs else "compiled" if self.compiled else "eager"
        if executor == "cuda_graph" and not (self.graphs if kind == "decode" else self.verify_graphs):
            self.capture()              # before filling: capture runs on (and leaves) all-padding buffers
        step = self.inputs.build(chunks, kind, padded=executor != "eager")
        return step, self.run(step, executor)

    def run(self, step: StepInputs, executor: str) -> torch.Tensor:
        runner = self.runner
        if executor == "cuda_graph":
            graph, out = (self.graphs if step.kind == "decode" else self.verify_graphs)[step.bucket]
            graph.replay()
            # The graph's output buffer is rewritten by the next replay: a decode's rows are copied here
            # (a verify step's are gathered into a new tensor by ``StepInputs.finish``).
            return out.clone() if step.kind == "decode" else out
        static = self._decode_step if step.kind == "decode" else self._verify_step
        # Index tensors built from the KV-cache manager's own block ids; the ops' backends chosen at construction.
        with trusted_metadata(), bound_backends(runner.op_backends):
            if executor == "compiled":
                return static(*self._dynamic_above_one(step.args, step.bucket))
            if step.kind == "decode":
                ids, positions, slots, query_start_loc, seq_lens, logits_indices = step.args
                return runner._run_uncompiled(ids, positions, self._decode_attn(slots, query_start_loc, seq_lens),
                                              logits_indices)
            if step.kind == "verify":
                return self._verify_forward(*step.args)
            input_ids, positions, attn, logits_indices = step.args
            if step.kind == "pool":
                # The pooling runner: the final-norm hidden states [rows, hidden] of the pooled rows (no LM head).
                return runner.model.model(input_ids, positions, attn, runner.kv_caches, logits_indices)
            return runner._run_uncompiled(input_ids, positions, attn, logits_indices)

    def _dynamic_above_one(self, inputs: tuple[torch.Tensor, ...], bucket: int) -> tuple[torch.Tensor, ...]:
        """Compiled steps: mark dim 0 dynamic above bucket 1, so one graph serves every bucket
        above 1 instead of a recompile per size."""
        if bucket > 1:
            for t in inputs:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return inputs

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        logits_indices: torch.Tensor) -> torch.Tensor:
        """The decode step that is compiled and captured: one token per sequence, bucket-sized shapes."""
        runner = self.runner
        return runner.model(input_ids, positions, self._decode_attn(slots, query_start_loc, seq_lens),
                            runner.kv_caches, logits_indices)

    def _decode_attn(self, slots: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(slot_ids=slots, seq_slots=slots, block_table=self.runner.block_table,
                                 query_start_loc=query_start_loc, seq_lens=seq_lens, max_query_len=1)

    def _verify_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                        seq_slots: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        logits_indices: torch.Tensor) -> torch.Tensor:
        """The verify step that is compiled and captured: ``verify_rows`` query rows per sequence."""
        runner = self.runner
        attn = AttentionMetadata(slot_ids=slot_ids, seq_slots=seq_slots, block_table=runner.block_table,
                                 query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 max_query_len=self.inputs.verify_rows)
        return runner.model(input_ids, positions, attn, runner.kv_caches, logits_indices)

    # ------------------------------------------------------------------ CUDA graphs
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture the decode step of every bucket into CUDA graphs, largest first, one memory pool
        (and the verify step's, when speculative decoding set verify rows).

        Capture runs on all-padding inputs (slot -1: nothing is written). Replays read the
        static buffers, which ``InputBuilder.fill_decode`` rewrites in full up to the bucket size
        before every replay, so no stale row from an earlier batch is ever read.
        """
        import time

        api, inputs = self.graph_api, self.inputs
        self.graphs.clear()
        api.synchronize()
        free_before = api.free_bytes()
        t0 = time.perf_counter()
        pool = self._capture_buckets(self.graphs, inputs.fill_decode, inputs.decode_args, self._decode_step, None)
        if inputs.verify_rows is not None:
            self.verify_graphs.clear()
            self._capture_buckets(self.verify_graphs, inputs.fill_verify, inputs.verify_args, self._verify_step, pool)
        api.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = max(0, free_before - api.free_bytes())

    def _capture_buckets(self, graphs: dict, fill, args_of, step_fn, pool):
        """One graph per bucket, largest first, into ``graphs`` (``fill(chunks, bucket)`` and
        ``args_of(bucket)`` give the static buffers ``step_fn`` reads); returns the memory pool."""
        api = self.graph_api
        for bucket in reversed(self.inputs.buckets):
            fill([], bucket)
            args = self._dynamic_above_one(args_of(bucket), bucket) if self.compiled else args_of(bucket)

            def step(args=args):
                with trusted_metadata(), bound_backends(self.runner.op_backends):   # what the graph replays
                    return step_fn(*args)

            api.warm_up(step)                      # (and compile) outside the capture
            graph, out, pool = api.capture(step, pool)
            graphs[bucket] = (graph, out)
        return pool
