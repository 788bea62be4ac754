"""AsyncLLM: the offline ``LLM`` driven by one background loop, with an async stream per request.

    engine = AsyncLLM.from_pretrained()            # the embedded model; LLM's keyword arguments
    async for out in engine.generate("def f(x):", SamplingParams(max_tokens=16)):
        print(out.outputs[0].text)                 # cumulative; the last update has finished=True

One thread (``qwen-ops-engine``) owns the scheduler: it takes new requests and aborts from an
inbox, runs one ``LLM`` iteration, and hands each touched request's ``RequestOutput`` to the
event loop of the coroutine that asked for it (``call_soon_threadsafe``, once per loop per
iteration). Requests arrive at any time and join the next iteration, as in vLLM's engine core.

A request is aborted when its consumer goes away: closing the async iterator, cancelling the
task that iterates it, or a client disconnect that does either; its slot, KV blocks and host
swap copy are freed by the loop at its next turn. A failure inside an iteration fails the
requests in flight at that iteration (each of their streams raises it) and the loop keeps
serving new ones.

The waiting queue is bounded by ``max_waiting_requests``: past it, ``generate`` raises
``QueueFullError`` (the server's 503) instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from typing import AsyncIterator, Optional, Sequence, Union

from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.llm import LLM, Prompt
from qwen_ops.serving.outputs import RequestOutput

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` already; retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (``shutdown`` or a failure it cannot recover from)."""


class _Stream:
    """Where one request's outputs go: an asyncio queue owned by the caller's event loop."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()


class AsyncLLM:
    def __init__(self, llm: LLM, *, max_waiting_requests: Optional[int] = None):
        if max_waiting_requests is not None and (isinstance(max_waiting_requests, bool)
                                                 or not isinstance(max_waiting_requests, int)
                                                 or max_waiting_requests < 1):
            raise ValueError(f"max_waiting_requests = {max_waiting_requests!r}, expected an int >= 1 or None")
        self.llm = llm
        self.max_waiting_requests = max_waiting_requests
        self._inbox: collections.deque = collections.deque()     # ("add", prepared, id) | ("abort", id)
        self._wake = threading.Event()
        self._lock = threading.Lock()                              # guards _streams
        self._streams: dict[str, _Stream] = {}
        self._owned: set[str] = set()         # ids this loop added to the LLM and has not seen finish
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="qwen-ops-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model=None, *, max_waiting_requests: Optional[int] = None, **llm_kwargs) -> "AsyncLLM":
        """An ``LLM(model, **llm_kwargs)`` under a background loop."""
        return cls(LLM(model, **llm_kwargs), max_waiting_requests=max_waiting_requests)

    # ------------------------------------------------------------------ caller side
    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def num_waiting(self) -> int:
        """Requests not yet admitted: queued in the scheduler or still in the inbox."""
        return len(self.llm.scheduler.waiting) + len(self._inbox)

    async def generate(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Cumulative ``RequestOutput`` updates of one request; the last has ``finished=True``.

        Bad input raises ``ValueError`` (naming the field) before anything is queued, a full
        waiting queue ``QueueFullError``. Stopping the iteration early aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running (AsyncLLM.shutdown was called or it failed)")
        prepared = self.llm._prepare([prompt], [sampling_params or SamplingParams()])
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id = {request_id!r}, expected a non-empty str or None")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self.max_waiting_requests is not None and self.num_waiting() >= self.max_waiting_requests:
                raise QueueFullError(f"{self.num_waiting()} requests are waiting (max_waiting_requests = "
                                     f"{self.max_waiting_requests}); retry later")
            if request_id in self._streams:
                raise ValueError(f"request_id = {request_id!r} is already in flight; expected a new id")
            self._streams[request_id] = stream
        self._inbox.append(("add", prepared, request_id))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                # Outputs are cumulative: when several are queued, the newest says everything.
                while not stream.queue.empty() and not isinstance(item, BaseException):
                    newer = stream.queue.get_nowait()
                    if isinstance(newer, RequestOutput):
                        newer.new_token_ids = item.new_token_ids + newer.new_token_ids
                    item = newer
                if isinstance(item, BaseException):
                    finished = True           # the loop already dropped it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (its completions' slots, blocks and swap copies are freed by the loop)."""
        if not self._thread.is_alive():
            self.llm.abort(request_id)         # no loop to hand it to
            return
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        s = self.llm.stats()
        s["num_waiting"] += len(self._inbox)
        return s

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight fail with ``EngineDeadError``."""
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> "AsyncLLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the engine loop
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.llm.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._iterate()
        except BaseException as e:       # never leave callers waiting on a dead loop
            logger.exception("qwen_ops engine loop failed")
            self._fail_all(EngineDeadError(f"the engine loop failed: {type(e).__name__}: {e}"))
            raise
        finally:
            self._stopping = True
            # Nothing of ours may outlive the loop: drop queued work, abort what it admitted.
            self._inbox.clear()
            for rid in list(self._owned):
                self.llm.abort(rid)
            self._owned.clear()
            self._fail_all(EngineDeadError("the engine loop stopped (AsyncLLM.shutdown)"))

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "abort":
                self.llm.abort(item[1])
                self._owned.discard(item[1])
                continue
            _, prepared, request_id = item
            with self._lock:
                stream = self._streams.get(request_id)
            if stream is None:                 # the caller left before its request was admitted
                continue
            try:
                self.llm._add_all(prepared, [request_id])
                self._owned.add(request_id)
            except Exception as e:            # e.g. an id clash with an offline request
                self._deliver([(request_id, e)])

    def _iterate(self) -> None:
        llm = self.llm
        with llm._lock:
            running = list(llm._groups)
            try:
                groups = llm._step()
            except Exception as e:
                # Fail the requests of this iteration, keep serving: nothing of theirs survives.
                logger.exception("qwen_ops engine iteration failed; failing its %d requests", len(running))
                for rid in running:
                    llm.abort(rid)
                    self._owned.discard(rid)
                self._deliver([(rid, RuntimeError(f"generation failed: {type(e).__name__}: {e}")) for rid in running])
                return
            outs = [(g.request_id, g.output(g.take_new_tokens())) for g in groups]
        for rid, out in outs:
            if out.finished:
                self._owned.discard(rid)
        self._deliver(outs)

    def _deliver(self, items: Sequence[tuple[str, Union[RequestOutput, BaseException]]]) -> None:
        """Hand each item to its stream: one ``call_soon_threadsafe`` per event loop."""
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for rid, item in items:
                stream = self._streams.get(rid)
                if stream is not None:
                    per_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:            # that event loop is closed: its callers are gone
                pass

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            rids = list(self._streams)
        self._deliver([(rid, error) for rid in rids])


def _put_all(batch) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
