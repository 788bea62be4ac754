"""vLLM's ``LLMEngine`` (``from vllm import LLMEngine``): requests added by id and the engine stepped by
hand, a thin front of ``LLM`` with vLLM's argument order.

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("0", "The capital of France is", SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        for out in engine.step():               # RequestOutput of each request that changed
            if out.finished:
                print(out.outputs[0].text)

Everything runs in the caller's thread (vLLM's in-process ``LLMEngine``); the ``LLM`` it fronts is
``engine.llm``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

from qwen_ops.engine.lora import LoRARequest
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.llm import LLM, Prompt
from qwen_ops.serving.outputs import RequestOutput


class LLMEngine:
    """``LLMEngine(llm)`` fronts an ``LLM``; ``from_engine_args`` builds one (vLLM's way)."""

    def __init__(self, llm: LLM):
        if not isinstance(llm, LLM):
            raise ValueError(f"llm = {llm!r}, expected a qwen_ops.LLM (or use LLMEngine.from_engine_args)")
        self.llm = llm

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context=None, stat_loggers=None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """The engine of ``engine_args`` (vLLM's). ``usage_context`` is accepted and unused; ``stat_loggers``
        only None (``get_metrics`` reads the stats); ``enable_multiprocessing`` only False (the core runs
        in this process; ``AsyncLLM`` runs it in a process of its own)."""
        if not isinstance(engine_args, EngineArgs):
            raise ValueError(f"engine_args = {engine_args!r}, expected a qwen_ops.EngineArgs")
        if stat_loggers is not None:
            raise ValueError(f"stat_loggers = {stat_loggers!r}, but custom stat loggers do not run here; expected "
                             "None (get_metrics() reads the engine's stats)")
        if enable_multiprocessing is not False:
            raise ValueError(f"enable_multiprocessing = {enable_multiprocessing!r}, but LLMEngine runs its core in "
                             "this process; expected False (AsyncLLM runs it in a process of its own)")
        return cls(LLM.from_engine_args(engine_args))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None,
                    tokenization_kwargs: Optional[dict] = None, trace_headers=None, priority: int = 0,
                    prompt_text: Optional[str] = None) -> str:
        """Queue one request under ``request_id`` (a str, not in flight already); ``step()`` runs it.
        Validated as ``LLM.generate``'s (a bad one raises ``ValueError`` and nothing is queued). Of
        vLLM's other arguments ``arrival_time`` (the engine stamps its own), ``trace_headers`` and
        ``prompt_text`` are accepted and unused; ``tokenization_kwargs`` only None, ``priority`` only 0."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id = {request_id!r}, expected a str (vLLM's rule)")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params = {params!r}, expected a qwen_ops.SamplingParams (pooling runs through "
                             "LLM.embed / LLM.encode here)")
        if tokenization_kwargs:
            raise ValueError(f"tokenization_kwargs = {tokenization_kwargs!r}, expected None: prompts are "
                             "tokenized as LLM.generate's")
        if priority != 0:
            raise ValueError(f"priority = {priority!r}, but requests run in arrival order here (scheduling_policy "
                             "'fcfs'); expected 0")
        return self.llm.add_request(prompt, params, request_id=request_id, lora_request=lora_request)

    def abort_request(self, request_ids: Union[str, Iterable[str]], internal: bool = False) -> None:
        """Abort requests by id (all their completions); an id not in flight is ignored, as vLLM's."""
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            self.llm.abort(rid)

    def step(self) -> list[RequestOutput]:
        """One engine iteration: a (cumulative) ``RequestOutput`` of each request that gained tokens or
        finished in it (``LLM.step``)."""
        return self.llm.step()

    def has_unfinished_requests(self) -> bool:
        return self.llm.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted."""
        with self.llm.core.lock:
            return len(self.llm.core.outputs.states)

    # ------------------------------------------------------------------ the rest of vLLM's surface
    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    @property
    def tokenizer(self):
        return self.llm.get_tokenizer()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm.reset_prefix_cache(reset_running_requests, reset_connector)

    def get_metrics(self) -> list:
        return self.llm.get_metrics()

    def start_profile(self, profile_prefix: Optional[str] = None, **kwargs) -> None:
        self.llm.start_profile(profile_prefix, **kwargs)

    def stop_profile(self) -> None:
        self.llm.stop_profile()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm.list_loras()
