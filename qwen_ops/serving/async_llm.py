"""AsyncLLM: an engine core driven by one background loop, with an async stream per request.

    engine = AsyncLLM.from_pretrained()            # the embedded model; LLM's keyword arguments
    async for out in engine.generate("def f(x):", SamplingParams(max_tokens=16)):
        print(out.outputs[0].text)                 # cumulative; the last update has finished=True

The loop that owns the scheduler (``engine_core.py``) runs in a child process of its own
(``from_pretrained``; ``engine_process=False`` keeps it here) or on a thread of this process
(``AsyncLLM(llm)``, an ``LLM`` you built). Either way it takes new requests and aborts, runs one
iteration, and reports what each touched request gained as a ``RequestDelta``; this side folds
the deltas into cumulative ``RequestOutput``s and hands them to the event loop of the coroutine
that asked (``call_soon_threadsafe``, once per loop per iteration). Requests arrive at any time
and join the next iteration, as in vLLM's engine core.

Callers validate and tokenize here, in their own thread, before anything is queued (the same
``prepare_requests`` as ``LLM``). A request is aborted when its consumer goes away: closing the
async iterator, cancelling the task that iterates it, or a client disconnect that does either;
its slot, KV blocks and host swap copy are freed by the loop at its next turn. A failure inside
an iteration fails the requests in flight at that iteration (each of their streams raises it)
and the loop keeps serving new ones. If the loop itself dies (or the core process), every open
stream raises ``EngineDeadError``.

The waiting queue is bounded by ``max_waiting_requests``, counted in completions (a request
with ``n = 4`` is four scheduler requests, so it counts four): past it, ``generate`` raises
``QueueFullError`` (the server's 503) instead of queueing without limit.

LoRA adapters (``enable_lora=True``): ``generate(..., lora_request=)`` runs a request with one;
``add_lora`` parses an adapter into the core's host memory off its loop (and off the caller's
event loop), ``remove_lora`` forgets one no request uses, as vLLM's engine client does.

A pooling ``AsyncLLM`` (an embedding model or a reranker, ``runner="pooling"``) has ``embed`` and
``score`` (vLLM's ``LLM.embed`` / ``LLM.score`` shapes) instead of ``generate``: each prompt is one
pooling request sent to the same loop (``add_pooling``), whose embedding comes back as one finished
delta; the awaiting coroutine never runs the model itself.

``heartbeat_age()`` says how long the core has gone without finishing an iteration while it has
work (0 when idle): the server's ``/health`` turns a stopped or hung core into a 503 with it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path
from typing import AsyncIterator, Optional, Sequence, Union

import torch

from qwen_ops.engine.lora import LoRARequest
from qwen_ops.engine.sampling import RequestOutputKind, SamplingParams
from qwen_ops.models.tokenizer import load_tokenizer
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.engine_core import EngineDeadError, ProcessCore, ThreadCore
from qwen_ops.serving.core_process import pooling_info
from qwen_ops.serving.llm import LLM, Prompt, pooling_ids, prepare_requests
from qwen_ops.serving.outputs import RequestAccumulator, RequestDelta, RequestOutput
from qwen_ops.serving.pooling import (EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, ScorePlan,
                                      ScoringRequestOutput, pooling_tasks)

__all__ = ["AsyncLLM", "EngineDeadError", "QueueFullError"]


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` already; retry later."""


class _Stream:
    """Where one request's deltas go: an asyncio queue owned by the caller's event loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()


class AsyncLLM:
    """``AsyncLLM(llm)`` runs the engine loop on a thread of this process; ``from_pretrained``
    (by default) in a child process. ``llm`` is the ``LLM`` in the first case, None in the second."""

    def __init__(self, llm: Optional[LLM] = None, *, max_waiting_requests: Optional[int] = None,
                 _process: Optional[tuple] = None):
        if max_waiting_requests is not None and (isinstance(max_waiting_requests, bool)
                                                 or not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests = {max_waiting_requests!r}, expected an int >= 1 or None")
        if (llm is None) == (_process is None):
            raise ValueError(f"llm = {llm!r}, expected a qwen_ops.LLM (or use AsyncLLM.from_pretrained)")
        self.max_waiting_requests = max_waiting_requests
        self._lock = threading.Lock()                              # guards _streams
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: Optional[BaseException] = None
        self.llm = llm
        if llm is not None:
            self._core = ThreadCore(llm, self._deliver, self._core_exited)
            self.tokenizer = llm.tokenizer
            self.vocab_size = int(llm.engine.vocab_size)
            self.max_model_len = int(llm.scheduler.config.max_model_len)
            self.model_path: Optional[Path] = getattr(llm, "model_path", None)
            self.tokenizer_path: Optional[Path] = getattr(llm, "tokenizer_path", self.model_path)
            # how a GGUF file's tensors are held (quantized as stored, dequantized), else None
            self.weights: Optional[str] = getattr(llm.engine.model, "gguf_summary", None)
            self.eos_token_ids = tuple(llm.engine.eos_token_ids)
            self.sampling_overrides = dict(llm.sampling_overrides)     # generation_config's defaults
            self.max_loras = None if llm.engine.lora is None else llm.engine.lora.config.max_loras
            info = pooling_info(llm)
        else:
            model, llm_kwargs, num_threads, cpus = _process
            self._core = ProcessCore(model, llm_kwargs, self._deliver, self._core_exited, num_threads=num_threads,
                                     cpus=cpus)
            info = self._core.info
            self.vocab_size = info["vocab_size"]
            self.max_model_len = info["max_model_len"]
            from qwen_ops.models.gguf import open_path

            self.model_path = Path(info["model_path"])
            # the tokenizer's source (a GGUF file read here once more: the engine's process has its own copy)
            self.tokenizer_path = open_path(info.get("tokenizer_path") or self.model_path)
            self.tokenizer = load_tokenizer(self.tokenizer_path)
            self.weights = info.get("weights")
            self.eos_token_ids = tuple(info["eos_token_ids"])
            self.sampling_overrides = dict(info["sampling_overrides"])
            self.max_loras = info["max_loras"]            # None: LoRA is not enabled
        self.runner = info["runner"]                      # "generate" or "pooling"
        self.pooler = info["pooler"]                      # the pooling runner's PoolerConfig (else None)
        self.hidden_size = info["hidden_size"]
        # a reranker's / classifier's head [labels, hidden] (fp32), or None; pooling_info's lists, back as a tensor
        head = info["classifier"]
        self.classifier = None if head is None else torch.tensor(head, dtype=torch.float32)

    @classmethod
    def from_pretrained(cls, model=None, *, max_waiting_requests: Optional[int] = None,
                        engine_process: bool = True, **llm_kwargs) -> "AsyncLLM":
        """``LLM(model, **llm_kwargs)`` under a background loop: in a child process of its own
        (``engine_process=True``, the default, as vLLM's engine core), or on a thread here."""
        return cls.from_engine_args(EngineArgs(model=model, **llm_kwargs), max_waiting_requests=max_waiting_requests,
                                    engine_process=engine_process)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, max_waiting_requests: Optional[int] = None,
                         engine_process: bool = True, num_threads: Optional[int] = None,
                         cpus: Optional[Sequence[int]] = None) -> "AsyncLLM":
        """``LLM.from_engine_args(engine_args)`` under a background loop (``from_pretrained``'s).
        With ``engine_process``: ``num_threads`` torch threads in the core's process (None: this
        process's count), pinned to ``cpus`` (None: not pinned); a data-parallel replica's."""
        if not isinstance(engine_process, bool):
            raise ValueError(f"engine_process = {engine_process!r}, expected True or False")
        if not engine_process:
            if num_threads is not None or cpus is not None:
                raise ValueError(f"num_threads = {num_threads!r}, cpus = {cpus!r} with engine_process = False; "
                                 "expected both None (they set the engine core process's threads)")
            return cls(LLM.from_engine_args(engine_args), max_waiting_requests=max_waiting_requests)
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                        or num_threads < 1):
            raise ValueError(f"num_threads = {num_threads!r}, expected an int >= 1 or None")
        engine_args.validate()          # here, in the caller: a bad argument fails before a process starts
        return cls(max_waiting_requests=max_waiting_requests,
                   _process=(engine_args.model, engine_args.llm_kwargs(), num_threads, cpus))

    # ------------------------------------------------------------------ caller side
    @property
    def is_running(self) -> bool:
        return self._dead is None and self._core.is_alive

    def num_waiting(self) -> int:
        """Completions not yet admitted (``n`` per request): queued in the scheduler or on their way to it."""
        return self._core.num_waiting()

    def heartbeat_age(self) -> float:
        """Seconds since the engine core last finished an iteration, while it has work; 0 when idle."""
        return self._core.heartbeat_age()

    @property
    def pid(self) -> Optional[int]:
        """The engine core process's id (None: the core runs on a thread here)."""
        process = getattr(self._core, "process", None)
        return None if process is None else process.pid

    @property
    def dead_reason(self) -> Optional[BaseException]:
        """Why the engine loop stopped (an ``EngineDeadError``), or None while it runs."""
        return self._dead

    async def generate(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """Cumulative ``RequestOutput`` updates of one request; the last has ``finished=True``.
        ``lora_request``: the LoRA adapter it runs with (needs ``enable_lora=True``); a bad adapter
        file fails this request alone (``ValueError``) after it is queued, as a bad grammar does.

        Bad input raises ``ValueError`` (naming the field) before anything is queued, a full
        waiting queue ``QueueFullError``. Stopping the iteration early aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running (AsyncLLM.shutdown was called or it failed)")
        params = sampling_params or SamplingParams()
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request = {lora_request!r}, expected a LoRARequest or None")
            if self.max_loras is None:
                raise ValueError("lora_request was given, but LoRA is not enabled; expected enable_lora=True "
                                 "(served: --enable-lora) or no lora_request")
        ((prompt, ids, params),) = prepare_requests([prompt], [params], tokenizer=self.tokenizer,
                                                    vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id = {request_id!r}, expected a non-empty str or None")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            limit, waiting = self.max_waiting_requests, self.num_waiting()
            if limit is not None and waiting + params.n > limit:
                # Each of the n completions is a scheduler request: admission counts what it will cost.
                raise QueueFullError(f"{waiting} completions are waiting and this request adds n = {params.n} "
                                     f"(max_waiting_requests = {limit}); retry later")
            if request_id in self._streams:
                raise ValueError(f"request_id = {request_id!r} is already in flight; expected a new id")
            self._streams[request_id] = stream
        acc = RequestAccumulator(request_id, prompt, ids, params)
        finished = False
        try:
            self._core.add(request_id, ids, params, lora_request)
            final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
            new: list[int] = []           # new token ids since the last output handed out
            while True:
                item = await stream.queue.get()
                # Fold in every delta that is queued: one cumulative output says all of it.
                while True:
                    if isinstance(item, BaseException):
                        finished = True       # the loop already dropped it
                        raise item
                    if item.error is not None:
                        finished = True
                        raise (ValueError if item.bad_request else RuntimeError)(item.error)
                    new.extend(acc.apply(item))
                    if stream.queue.empty():
                        break
                    item = stream.queue.get_nowait()
                finished = acc.finished
                if finished or not final_only:
                    out, new = acc.output(new), []
                    yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    # ------------------------------------------------------------------ pooling (runner="pooling")
    async def encode(self, prompts: Sequence[list[int]], tasks: Sequence) -> list[torch.Tensor]:
        """The pooled vector (fp32) of each prompt of token ids (already validated) under its
        ``PoolingTask``: one pooling request each on the engine loop, awaited together. Cancelling
        (a client that went away) aborts the unfinished ones."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running (AsyncLLM.shutdown was called or it failed)")
        if self.runner != "pooling":
            raise ValueError("this engine runs a generation model; embeddings need runner='pooling'")
        loop = asyncio.get_running_loop()
        rids = [f"pool-{next(self._ids)}" for _ in prompts]
        streams = [_Stream(loop) for _ in prompts]
        with self._lock:
            limit, waiting = self.max_waiting_requests, self.num_waiting()
            if limit is not None and waiting + len(prompts) > limit:
                raise QueueFullError(f"{waiting} completions are waiting and this request adds {len(prompts)} "
                                     f"prompts (max_waiting_requests = {limit}); retry later")
            self._streams.update(zip(rids, streams))
        done = [False] * len(rids)
        out: list[torch.Tensor] = []
        try:
            for rid, ids, task in zip(rids, prompts, tasks, strict=True):
                self._core.add_pooling(rid, list(ids), task)
            for i, stream in enumerate(streams):
                item = await stream.queue.get()
                done[i] = True                 # one delta, finished: the loop has dropped it
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise (ValueError if item.bad_request else RuntimeError)(item.error)
                out.append(torch.tensor(item.embedding, dtype=torch.float32))
            return out
        finally:
            with self._lock:
                for rid in rids:
                    self._streams.pop(rid, None)
            for rid, finished in zip(rids, done):
                if not finished:
                    self.abort(rid)

    def _pooling_ids(self, prompts) -> list[list[int]]:
        return pooling_ids(prompts, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                           max_model_len=self.max_model_len)

    async def embed(self, prompts, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None
                    ) -> list[EmbeddingRequestOutput]:
        """``LLM.embed`` on the engine loop: one embedding per prompt, in prompt order."""
        if self.classifier is not None:
            raise ValueError("this engine is a classifier (a reranker or a sequence classifier); it has score, "
                             "expected an embedding model for embed")
        ids = self._pooling_ids(prompts)
        tasks = pooling_tasks(pooling_params, len(ids), self.pooler, self.hidden_size)
        vectors = await self.encode(ids, tasks)
        return [EmbeddingRequestOutput(str(i), p, EmbeddingOutput(v.tolist()))
                for i, (p, v) in enumerate(zip(ids, vectors))]

    async def score(self, text_1, text_2) -> list[ScoringRequestOutput]:
        """``LLM.score`` on the engine loop: the cosine similarity of the two texts' embeddings, or a
        one-label classifier's (Qwen3-Reranker's) relevance of the two joined; vLLM's pairing."""
        plan = ScorePlan(text_1, text_2, self._pooling_ids, self.classifier)
        tasks = pooling_tasks(None, len(plan.prompts), self.pooler, self.hidden_size)
        return plan.outputs(await self.encode(plan.prompts, tasks))

    def abort(self, request_id: str) -> None:
        """Abort a request (its completions' slots, blocks and swap copies are freed by the loop)."""
        self._core.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Parse ``lora_request``'s adapter into the core's host memory (vLLM's ``add_lora``), off the
        engine loop and this event loop. A bad adapter raises ``ValueError`` naming the file or field."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request = {lora_request!r}, expected a LoRARequest")
        return await asyncio.wrap_future(self._core.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (vLLM's ``remove_lora``): False if it was not loaded, ``ValueError``
        while a running or waiting request uses it."""
        return await asyncio.wrap_future(self._core.remove_lora(lora_id))

    def stats(self) -> dict:
        return self._core.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (and the core process); requests still in flight fail with ``EngineDeadError``."""
        self._core.shutdown(timeout)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ from the engine loop
    def _core_exited(self, reason: BaseException) -> None:
        self._dead = reason
        with self._lock:
            rids = list(self._streams)
        self._deliver([(rid, reason) for rid in rids])

    def _deliver(self, items: Sequence[Union[RequestDelta, tuple[str, BaseException]]]) -> None:
        """Hand each delta (or ``(id, error)``) to its stream: one ``call_soon_threadsafe`` per event loop."""
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for item in items:
                if isinstance(item, RequestDelta):
                    rid, value = item.request_id, item
                else:
                    rid, value = item
                stream = self._streams.get(rid)
                if stream is not None:
                    per_loop.setdefault(stream.loop, []).append((stream.queue, value))
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:            # that event loop is closed: its callers are gone
                pass


def _put_all(batch) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
