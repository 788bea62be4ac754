"""Batch generation over a Ray Data dataset, one offline ``LLM`` per actor (vLLM's ``ray.data.llm``
in shape: a config, ``build_llm_processor``, and a processor that maps a dataset to a dataset).

    import ray
    from qwen_ops.serving.ray import QwenEngineProcessorConfig, build_llm_processor

    config = QwenEngineProcessorConfig(model=None, engine_kwargs={"max_model_len": 512}, concurrency=2, batch_size=8)
    processor = build_llm_processor(
        config,
        preprocess=lambda row: {"prompt": row["text"], "sampling_params": {"temperature": 0, "max_tokens": 32}},
        postprocess=lambda row: {"text": row["text"], "answer": row["generated_text"]},
    )
    processor(ray.data.from_items([{"text": "def fibonacci(n):"}])).take_all()

The processor is ``ds.map(preprocess)`` (plus the request check) ``.map_batches(engine stage)``
``.map(postprocess)``. The engine stage is a pool of ``concurrency`` Ray actors, each holding one
``LLM`` built once in its constructor; a batch of ``batch_size`` rows is one ``LLM.generate`` (rows
with ``"prompt"``) and one ``LLM.chat`` (rows with ``"messages"``), so its requests share the
engine's forward passes. Each row keeps its columns and gains vLLM's: ``generated_text``,
``generated_tokens`` (the token ids), ``num_input_tokens``, ``num_generated_tokens``; and
``engine_actor_id``, the Ray actor whose engine produced it.

A row's request (its prompt or messages and its ``sampling_params``) travels to the engine stage as
one JSON column written by the preprocess step: Arrow, which holds the dataset between steps, would
otherwise fill the keys one row's ``sampling_params`` lacks with nulls and turn lists into arrays.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from qwen_ops.serving.ray.dependency import import_data

REQUEST_COLUMN = "__qwen_ops_request"        # the preprocess step's JSON request, dropped by the engine stage
OUTPUT_COLUMNS = ("generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens", "engine_actor_id")


@dataclass(frozen=True)
class QwenEngineProcessorConfig:
    """What ``build_llm_processor`` builds (vLLM's ``vLLMEngineProcessorConfig``; ``model`` is its
    ``model_source``).

    ``model``: a checkpoint directory, GGUF file or Hugging Face id, or None (the embedded model);
    ``engine_kwargs``: ``LLM``'s keywords (``EngineArgs``), checked here before any actor starts.
    ``concurrency``: the number of engine actors, or ``(min, max)`` for a pool Ray Data scales.
    ``batch_size``: rows per engine call. ``num_cpus_per_actor``: each actor's Ray CPUs (torch in the
    actor uses as many threads, as Ray sets ``OMP_NUM_THREADS``). ``max_tasks_in_flight_per_actor``:
    batches sent to an actor before it finishes one (1: the next batch goes to whichever actor is free).
    """

    model: Optional[str] = None
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    concurrency: Union[int, tuple[int, int]] = 1
    batch_size: int = 16
    num_cpus_per_actor: float = 1.0
    max_tasks_in_flight_per_actor: int = 1

    def __post_init__(self) -> None:
        from qwen_ops.serving.engine_args import EngineArgs

        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model = {self.model!r}, expected a str (path or model id) or None")
        if not isinstance(self.engine_kwargs, Mapping):
            raise ValueError(f"engine_kwargs = {self.engine_kwargs!r}, expected a dict of LLM's keywords")
        object.__setattr__(self, "engine_kwargs", dict(self.engine_kwargs))
        if "model" in self.engine_kwargs:
            raise ValueError(f"engine_kwargs['model'] = {self.engine_kwargs['model']!r}; expected the model as "
                             "model=, not in engine_kwargs")
        args = EngineArgs(self.model, **self.engine_kwargs)     # an unknown keyword: TypeError, as LLM's
        if args.data_parallel_size != 1:
            raise ValueError(f"engine_kwargs['data_parallel_size'] = {args.data_parallel_size}, but an actor holds "
                             "one engine; expected 1 (use concurrency for more engines)")
        args.validate()
        if not _is_concurrency(self.concurrency):
            raise ValueError(f"concurrency = {self.concurrency!r}, expected an int >= 1 (the actors) or a pair "
                             "(min, max) with 1 <= min <= max")
        for name in ("batch_size", "max_tasks_in_flight_per_actor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}, expected an int >= 1")
        cpus = self.num_cpus_per_actor
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus < float("inf"):
            raise ValueError(f"num_cpus_per_actor = {cpus!r}, expected a number > 0")


def _is_concurrency(value) -> bool:
    def is_count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if isinstance(value, tuple):
        return len(value) == 2 and all(is_count(v) for v in value) and value[0] <= value[1]
    return is_count(value)


@dataclass(frozen=True)
class QwenProcessor:
    """``processor(dataset) -> dataset``: the lazy Ray Data plan of ``build_llm_processor``."""

    config: QwenEngineProcessorConfig
    preprocess: Optional[Callable[[dict], dict]] = None
    postprocess: Optional[Callable[[dict], dict]] = None

    def __call__(self, dataset):
        data = import_data()
        config = self.config
        concurrency = config.concurrency
        size = dict(min_size=concurrency[0], max_size=concurrency[1]) if isinstance(concurrency, tuple) \
            else dict(size=concurrency)
        dataset = dataset.map(_request_row(self.preprocess))
        dataset = dataset.map_batches(
            QwenEngineStage, fn_constructor_kwargs={"model": config.model, "engine_kwargs": config.engine_kwargs},
            batch_size=config.batch_size, batch_format="pyarrow", num_cpus=config.num_cpus_per_actor,
            compute=data.ActorPoolStrategy(**size, max_tasks_in_flight_per_actor=config.max_tasks_in_flight_per_actor))
        if self.postprocess is not None:
            dataset = dataset.map(self.postprocess)
        return dataset


def build_llm_processor(config: QwenEngineProcessorConfig, preprocess: Optional[Callable[[dict], dict]] = None,
                        postprocess: Optional[Callable[[dict], dict]] = None) -> QwenProcessor:
    """vLLM's ``build_llm_processor``: ``preprocess(row)`` returns the row with ``"prompt"`` (a str)
    or ``"messages"`` (a chat, a list of ``{"role", "content"}``) and optionally ``"sampling_params"``
    (``SamplingParams``' keywords; none: the model's default sampling); ``postprocess(row)`` returns
    the output row. None leaves a row as it is (then the dataset itself has ``"prompt"`` or
    ``"messages"``). A bad request fails its preprocess step with a ValueError naming the row."""
    if not isinstance(config, QwenEngineProcessorConfig):
        raise ValueError(f"config = {config!r}, expected a QwenEngineProcessorConfig")
    for name, fn in (("preprocess", preprocess), ("postprocess", postprocess)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} = {fn!r}, expected a function of a row (dict) or None")
    import_data()                          # no Ray: the error names the extra now, not when the plan runs
    return QwenProcessor(config, preprocess, postprocess)


# ---------------------------------------------------------------------- the preprocess step
def _request_row(preprocess: Optional[Callable[[dict], dict]]) -> Callable[[dict], dict]:
    """The function ``ds.map`` runs (a closure, so Ray Data runs it as a task, not an actor):
    ``preprocess(row)``, its request checked and written to ``REQUEST_COLUMN``."""

    def request_row(row: dict) -> dict:
        row = dict(row) if preprocess is None else preprocess(row)
        if not isinstance(row, dict):
            raise ValueError(f"preprocess returned {row!r}, expected a dict (the row)")
        row[REQUEST_COLUMN] = json.dumps(request_of(row))
        return row

    return request_row


def request_of(row: Mapping) -> dict:
    """The engine's request of one row: ``{"prompt": str}`` or ``{"messages": [...]}``, and
    ``"sampling_params"`` when the row has them, in plain JSON types (checked by ``SamplingParams``)."""
    from qwen_ops.engine.sampling import SamplingParams

    has_prompt, has_messages = row.get("prompt") is not None, row.get("messages") is not None
    if has_prompt == has_messages:
        raise ValueError(f"row {_short(row)} has {'both' if has_prompt else 'neither of'} 'prompt' and 'messages'; "
                         "expected exactly one (a str prompt, or a chat's list of {'role', 'content'})")
    request: dict[str, Any] = {}
    if has_prompt:
        prompt = _plain(row["prompt"])
        if not isinstance(prompt, str):
            raise ValueError(f"row['prompt'] = {prompt!r}, expected a str")
        request["prompt"] = prompt
    else:
        messages = _plain(row["messages"])
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"row['messages'] = {messages!r}, expected a non-empty list of {{'role', 'content'}}")
        request["messages"] = messages
    params = row.get("sampling_params")
    if params is not None:
        params = _plain(params)
        if not isinstance(params, dict):
            raise ValueError(f"row['sampling_params'] = {params!r}, expected a dict of SamplingParams' keywords")
        try:
            SamplingParams(**params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"row['sampling_params'] = {params!r}: {e}") from None
        request["sampling_params"] = params
    return request


def _plain(value):
    """``value`` in JSON's types: numpy arrays and scalars (how Ray Data hands back lists and numbers)
    become lists and Python numbers, recursively."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    tolist = getattr(value, "tolist", None)        # numpy arrays and scalars, without importing numpy
    if callable(tolist) and not isinstance(value, (str, bytes)):
        return _plain(tolist())
    return value


def _short(row: Mapping) -> str:
    text = repr({k: v for k, v in row.items() if k != REQUEST_COLUMN})
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------------- the engine stage
class QwenEngineStage:
    """The callable class of ``map_batches``: Ray Data makes one per actor, so each actor builds one
    ``LLM`` (its own engine and KV cache) here and reuses it for every batch it is given."""

    def __init__(self, model: Optional[str], engine_kwargs: Mapping[str, Any]):
        import ray

        from qwen_ops.serving.llm import LLM

        self.llm = LLM(model, **dict(engine_kwargs))
        self.actor_id = ray.get_runtime_context().get_actor_id()

    def __call__(self, batch):
        """``batch`` (a pyarrow Table with ``REQUEST_COLUMN``) without it, plus ``OUTPUT_COLUMNS``."""
        import pyarrow as pa

        from qwen_ops.engine.sampling import SamplingParams

        requests = [json.loads(text) for text in batch.column(REQUEST_COLUMN).to_pylist()]
        default = self.llm.get_default_sampling_params()
        params = [SamplingParams(**r["sampling_params"]) if "sampling_params" in r else default for r in requests]
        outputs: list = [None] * len(requests)
        for key, run in (("prompt", self.llm.generate), ("messages", self.llm.chat)):
            rows = [i for i, r in enumerate(requests) if key in r]
            if rows:
                for i, out in zip(rows, run([requests[i][key] for i in rows], [params[i] for i in rows],
                                            use_tqdm=False)):
                    outputs[i] = out
        completions = [out.outputs[0] for out in outputs]       # n > 1: the first, as vLLM's stage
        columns = {
            "generated_text": pa.array([c.text for c in completions], pa.string()),
            "generated_tokens": pa.array([list(c.token_ids) for c in completions], pa.list_(pa.int64())),
            "num_input_tokens": pa.array([len(out.prompt_token_ids) for out in outputs], pa.int64()),
            "num_generated_tokens": pa.array([len(c.token_ids) for c in completions], pa.int64()),
            "engine_actor_id": pa.array([self.actor_id] * len(outputs), pa.string()),
        }
        table = batch.drop_columns([name for name in (REQUEST_COLUMN, *columns) if name in batch.column_names])
        for name, values in columns.items():
            table = table.append_column(name, values)
        return table
