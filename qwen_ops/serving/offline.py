"""``qwen_ops.LLM``, vLLM's offline ``LLM``: one engine in this process (``serving/llm.py``'s
``LLM``, which this class is), or with ``data_parallel_size = N > 1`` N engine-core processes
behind the data-parallel balancer (``serving/data_parallel.py``), as vLLM's ``LLM`` takes the
argument.

    llm = LLM(data_parallel_size=2)            # two processes, the usable cores divided among them
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    llm.shutdown()

A class of its own above ``serving/llm.py`` because the replicas are ``AsyncLLM`` processes and
``AsyncLLM`` is built on ``serving/llm.py``: the single-engine class cannot import them without an
import circle. With N replicas, ``generate`` and ``chat`` send every request at once and the
balancer spreads them by load and cached prefix (``OfflineDataParallel``); ``embed``, ``score``
and ``classify`` send theirs to the least-loaded replica. What needs an engine in this process
(``step``, ``add_request``, ``stream``, ``beam_search``, ``encode``, LoRA and profiling calls)
raises a ``ValueError`` naming ``data_parallel_size``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

from qwen_ops.engine.lora import LoRARequest
from qwen_ops.engine.sampling import SamplingParams
from qwen_ops.serving import llm as single
from qwen_ops.serving.data_parallel import OfflineDataParallel
from qwen_ops.serving.engine_args import EngineArgs
from qwen_ops.serving.llm import Prompt, RequestOutput

__all__ = ["LLM"]


class _ReplicasView:
    """``LLM.engine`` / ``.scheduler`` / ``.core`` with ``data_parallel_size > 1``: the few facts the
    replicas share (``vocab_size``, ``config``), and a clear error for what needs an engine in
    this process."""

    def __init__(self, size: int, **facts: Any):
        self._size = size
        self.__dict__.update(facts)

    def __getattr__(self, name: str):
        raise ValueError(f"data_parallel_size = {self._size}: the engines run in {self._size} processes of their "
                         f"own, and this needs one here (.{name}); expected data_parallel_size=1 for step, "
                         "add_request, stream, beam_search, encode, LoRA and profiling calls (generate, chat, "
                         "embed, score and classify run on the replicas)")


class LLM(single.LLM):
    __doc__ = single.LLM.__doc__

    def __init__(self, model=None, **kwargs: Any) -> None:
        """``serving/llm.py``'s ``LLM(model, **kwargs)``; with ``data_parallel_size > 1`` its replicas
        (the module docstring), each an engine process built from the same arguments."""
        self._dp: Optional[OfflineDataParallel] = None
        size = kwargs.get("data_parallel_size", 1)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 1:
            super().__init__(model, **kwargs)       # one engine (a bad size is refused there, by name)
            return
        args = EngineArgs(model=model, **{"disable_log_stats": True, **kwargs})
        args.validate()
        self._dp = OfflineDataParallel(args)
        front = self._dp.engine
        self.runner, self.pooler, self.classifier = front.runner, front.pooler, front.classifier
        self.tokenizer = None if args.skip_tokenizer_init else front.tokenizer
        self.model_path, self.tokenizer_path = front.model_path, front.tokenizer_path
        self.sampling_overrides = dict(front.sampling_overrides)
        self._default_sampling = SamplingParams(**self.sampling_overrides)
        self.engine_args = args
        self.engine = _ReplicasView(size, vocab_size=front.vocab_size,
                                    config=SimpleNamespace(hidden_size=front.hidden_size))
        self.scheduler = _ReplicasView(size, config=SimpleNamespace(max_model_len=front.max_model_len))
        self.core = _ReplicasView(size)

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 use_tqdm: Union[bool, Callable[..., Any]] = True,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        if self._dp is None:
            return super().generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        prepared = self._prepare(prompts, sampling_params)
        return self._dp.generate(prepared, self._loras(lora_request, len(prepared)), use_tqdm)

    generate.__doc__ = single.LLM.generate.__doc__

    def stats(self) -> dict:
        """The engine's stats; with replicas, summed over them (``merge_stats``), each one's under ``"replicas"``."""
        return super().stats() if self._dp is None else self._dp.engine.stats()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers or the data-parallel replicas' processes (a no-op without them)."""
        if self._dp is None:
            super().shutdown()
        else:
            self._dp.shutdown()
