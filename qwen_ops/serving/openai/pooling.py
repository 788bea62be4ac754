"""The pooling routes of the OpenAI-compatible server (a ``runner="pooling"`` engine): OpenAI's
``/v1/embeddings``, vLLM's ``/v1/score`` (also ``/score``), ``/rerank`` (also ``/v1/rerank`` and
``/v2/rerank``; Jina / Cohere's shape), ``/pooling`` (the model's own pooled output per input, or
of a chat's ``messages`` rendered by the template: an embedding model's vector, a classifier's
probabilities) and ``/classify`` (a sequence classifier's
probabilities and label per input, ``LLM.classify``'s path).

Text is tokenized here (the server's tokenizer, with its length bounds); the engine work runs on
the engine loop through ``AsyncLLM.embed`` / ``AsyncLLM.score`` (one pooling request per prompt
on the same scheduler as generation requests would use), never on this event loop. Errors leave in
the server's OpenAI shape, ``param`` naming the request field.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from qwen_ops.engine.pooling import PoolingParams
from qwen_ops.serving.pooling import classifier_probs, pooling_tasks
from qwen_ops.serving.engine_core import EngineDeadError
from qwen_ops.serving.openai import protocol as P

MAX_INPUTS = 2048           # OpenAI's cap on inputs in one embeddings request (and on documents here)
ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(P._Strict):
    model: Optional[str] = None
    input: Any = None
    encoding_format: str = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None


class ScoreRequest(P._Strict):
    model: Optional[str] = None
    text_1: Any = None
    text_2: Any = None


class RerankRequest(P._Strict):
    model: Optional[str] = None
    query: Any = None
    documents: Any = None
    top_n: Optional[int] = None             # None or 0: every document (vLLM's)
    return_documents: bool = True


class PoolingRequest(P._Strict):
    """vLLM's ``/pooling``: its completion-style request (``input``) or its chat-style one (``messages``,
    rendered by the chat template and pooled as one prompt; vLLM's ``PoolingChatRequest`` defaults:
    no generation prompt, no special tokens beyond the template's). ``task`` defaults to the model's own."""
    model: Optional[str] = None
    input: Any = None
    messages: Any = None
    add_generation_prompt: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Optional[dict] = None
    task: Optional[str] = None
    encoding_format: str = "float"
    dimensions: Optional[int] = None
    use_activation: Optional[bool] = None    # an embedding model: normalize (None: the checkpoint's choice)
    user: Optional[str] = None


class ClassificationRequest(P._Strict):
    """vLLM's ``/classify``."""
    model: Optional[str] = None
    input: Any = None
    use_activation: Optional[bool] = None
    user: Optional[str] = None


def _texts_or_ids(value: Any, param: str, *, texts_only: bool = False) -> list:
    """``value`` as a list of inputs: a str, a list of str, token ids, or a list of token-id lists
    (OpenAI's ``input``); with ``texts_only``, a str or a list of str."""
    expected = ("expected a string or an array of strings" if texts_only else
                "expected a string, an array of strings, an array of token ids or an array of token-id arrays")
    if isinstance(value, str):
        return [P.check_text(value, param)]
    if value is None:
        raise P.bad_request(f"{param} is missing; {expected}", param)
    if not isinstance(value, list) or not value:
        raise P.bad_request(f"{param} = {P._show(value)}, {expected}", param)
    if not texts_only and P._is_token_ids(value):
        return [value]
    if len(value) > MAX_INPUTS:
        raise P.bad_request(f"{param} has {len(value)} items, expected at most {MAX_INPUTS} per request", param)
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(P.check_text(item, f"{param}[{i}]", param))
        elif not texts_only and P._is_token_ids(item):
            out.append(item)
        else:
            raise P.bad_request(f"{param}[{i}] = {P._show(item)}, {expected}", param)
    return out


def _b64_float32(vector: list[float]) -> str:
    """OpenAI's base64 embedding: the little-endian float32 bytes (what its client decodes)."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def checkpoint_labels(model_path) -> dict[int, str]:
    """A sequence classifier's label names, ``config.json``'s ``id2label`` (empty when it has none)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
        return {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    except (OSError, TypeError, ValueError, AttributeError):
        return {}


class PoolingRoutes:
    """The pooling routes over ``serving`` (the server's ``_Serving``: tokenizer, names, engine)."""

    def __init__(self, serving):
        self.s = serving
        self.engine = serving.engine
        self._labels: Optional[dict[int, str]] = None      # read at the first /classify

    @property
    def pooling(self) -> bool:
        return getattr(self.engine, "runner", "generate") == "pooling"

    def refuse_generation(self, api: str) -> None:
        """A generation route on a pooling server: a 400 (vLLM's answer), before the body is read."""
        if self.pooling:
            raise P.bad_request(f"The model does not support the {api} API: it is a pooling model (embeddings / "
                                "reranking, --runner pooling); use /v1/embeddings, /v1/score or /rerank")

    def _check_runner(self, api: str, needs_classifier: Optional[bool] = None) -> None:
        if not self.pooling:
            raise P.bad_request(f"The model does not support the {api} API: it is a generation model; serve an "
                                "embedding or reranker model with --runner pooling")
        if needs_classifier is False and self.engine.classifier is not None:
            raise P.bad_request(f"The model does not support the {api} API: it is a classifier (a reranker); use "
                                "/v1/score or /rerank")
        if needs_classifier and self.engine.classifier is None:
            raise P.bad_request(f"The model does not support the {api} API: it is an embedding model; use "
                                "/v1/embeddings or /pooling")

    def _ids(self, items: list, param: str) -> list[list[int]]:
        out = []
        for i, item in enumerate(items):
            where = f"{param}[{i}]" if len(items) > 1 or not isinstance(item, str) else param
            ids = self.s.encode(item, param) if isinstance(item, str) else list(item)
            self.s.check_ids(ids, where, param)
            if len(ids) > self.s.max_model_len:
                raise P.bad_request(f"{where} has {len(ids)} tokens; this model's maximum context length is "
                                    f"{self.s.max_model_len} tokens", param)
            out.append(ids)
        return out

    async def _run(self, coro, param: str, prompts: list[list[int]]):
        """Await engine work over ``prompts`` (each one pooling request); its errors as the server's
        (ValueError: a 400 naming ``param``). Each prompt is a request of the Prometheus metrics, as vLLM
        counts pooling requests: its prompt tokens, its latency, finished "stop" (or "abort" when the
        work failed or was cancelled), no generated tokens."""
        from qwen_ops.serving.async_llm import QueueFullError

        self.s.check_engine()
        deadline = self.s.deadline()
        timings = [self.s.metrics.timing(len(p)) for p in prompts]
        reason = None
        try:
            if deadline is None:
                out = await coro
            else:
                out = await asyncio.wait_for(coro, max(0.0, deadline - time.monotonic()))
            reason = "stop"
            return out
        except QueueFullError as e:
            raise P.APIError(503, str(e), headers={"Retry-After": "1"}) from None
        except EngineDeadError as e:
            raise self.s.dead_error(e) from None
        except asyncio.TimeoutError:
            if deadline is None:
                raise
            raise self.s.timeout_error() from None
        except ValueError as e:
            raise P.bad_request(str(e), param) from None
        finally:
            for t in timings:
                t.finish([reason], 0)

    async def embeddings(self, body: bytes) -> dict:
        req = P.parse_request(EmbeddingRequest, body)
        self._check_runner("Embeddings", needs_classifier=False)
        self.s.check_model(req.model)
        if req.encoding_format not in ENCODING_FORMATS:
            raise P.bad_request(f"encoding_format = {req.encoding_format!r}, expected 'float' or 'base64'",
                                "encoding_format")
        hidden = self.engine.hidden_size
        if req.dimensions is not None and not 1 <= req.dimensions <= hidden:
            raise P.bad_request(f"dimensions = {req.dimensions}, expected an int in [1, {hidden}] (this model's "
                                "embedding size)", "dimensions")
        ids = self._ids(_texts_or_ids(req.input, "input"), "input")
        outs = await self._run(self.engine.embed([{"prompt_token_ids": x} for x in ids],
                                                 PoolingParams(dimensions=req.dimensions)), "input", ids)
        encode = _b64_float32 if req.encoding_format == "base64" else (lambda v: v)
        num_tokens = sum(len(x) for x in ids)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.s.names[0],
                "data": [{"index": i, "object": "embedding", "embedding": encode(o.outputs.embedding)}
                         for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def _scores(self, left: list[list[int]], right: list[list[int]], param: str) -> list:
        pairs = [(left[0], b) for b in right] if len(left) == 1 else list(zip(left, right))   # a request each
        return await self._run(self.engine.score([{"prompt_token_ids": x} for x in left],
                                                 [{"prompt_token_ids": x} for x in right]), param,
                               [a + b for a, b in pairs])

    async def score(self, body: bytes) -> dict:
        """vLLM's ``/v1/score``: ``text_1`` against each ``text_2`` (one to one, one to N, N to N)."""
        req = P.parse_request(ScoreRequest, body)
        self._check_runner("Score")
        self.s.check_model(req.model)
        left = self._ids(_texts_or_ids(req.text_1, "text_1", texts_only=True), "text_1")
        right = self._ids(_texts_or_ids(req.text_2, "text_2", texts_only=True), "text_2")
        if len(left) != 1 and len(left) != len(right):
            raise P.bad_request(f"text_1 has {len(left)} items and text_2 {len(right)}; expected one text_1, or as "
                                "many as text_2 (scored pairwise)", "text_1")
        outs = await self._scores(left, right, "text_1")
        num_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.s.names[0],
                "data": [{"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def rerank(self, body: bytes) -> dict:
        """vLLM's ``/rerank`` (Jina / Cohere): ``documents`` scored against ``query``, best first."""
        req = P.parse_request(RerankRequest, body)
        self._check_runner("Rerank")
        self.s.check_model(req.model)
        if not isinstance(req.query, str):
            raise P.bad_request(f"query = {P._show(req.query)}, expected a string", "query")
        if not isinstance(req.documents, list):
            raise P.bad_request(f"documents = {P._show(req.documents)}, expected an array of strings", "documents")
        docs = _texts_or_ids(req.documents, "documents", texts_only=True)
        if req.top_n is not None and req.top_n < 0:
            raise P.bad_request(f"top_n = {req.top_n}, expected an int >= 0 (0: every document)", "top_n")
        (query,) = self._ids([P.check_text(req.query, "query")], "query")
        doc_ids = self._ids(docs, "documents")
        outs = await self._scores([query], doc_ids, "documents")
        order = sorted(range(len(outs)), key=lambda i: outs[i].outputs.score, reverse=True)
        if req.top_n:
            order = order[:req.top_n]
        results = []
        for i in order:
            item = {"index": i, "relevance_score": outs[i].outputs.score}
            if req.return_documents:
                item["document"] = {"text": docs[i]}
            results.append(item)
        num_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.s.names[0], "results": results,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    def _chat_ids(self, req: PoolingRequest) -> list[list[int]]:
        """The one prompt of a chat-style request: ``messages`` rendered by the chat template, tokenized."""
        if req.input is not None:
            raise P.bad_request("give one of input (texts or token ids) and messages (a chat), not both", "messages")
        text = self.s.render_chat(P.chat_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs)
        ids = self.s.encode(text, "messages", add_special_tokens=req.add_special_tokens)
        self.s.check_ids(ids, "messages (rendered)", "messages")
        if len(ids) > self.s.max_model_len:
            raise P.bad_request(f"messages (rendered) has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.s.max_model_len} tokens", "messages")
        return [ids]

    async def _probs(self, ids: list[list[int]]) -> list[list[float]]:
        """The classifier's probabilities of each prompt: ``LLM.classify``'s pooling and head, each
        prompt one pooling request on the engine loop."""
        tasks = pooling_tasks(None, len(ids), self.engine.pooler, self.engine.hidden_size)
        vectors = await self._run(self.engine.encode(ids, tasks), "input", ids)
        return classifier_probs(torch.stack(vectors), self.engine.classifier)

    def _check_activation(self, use_activation: Optional[bool]) -> None:
        if use_activation is False and self.engine.classifier is not None:
            raise P.bad_request("use_activation = false (raw logits) is not supported for a classifier; expected "
                                "true or no use_activation", "use_activation")

    async def pool(self, body: bytes) -> dict:
        """vLLM's ``/pooling``: per input the model's pooled output as ``data`` (an embedding model's
        vector; a classifier's probabilities)."""
        req = P.parse_request(PoolingRequest, body)
        self._check_runner("Pooling")
        self.s.check_model(req.model)
        own = "embed" if self.engine.classifier is None else "classify"
        if req.task is not None and req.task != own:
            raise P.bad_request(f"task = {req.task!r}, but this model's pooling task is {own!r}; expected {own!r} "
                                "or no task", "task")
        if req.dimensions is not None:         # vLLM's answer too (use /v1/embeddings for Matryoshka sizes)
            raise P.bad_request("dimensions is currently not supported", "dimensions")
        if req.encoding_format not in ENCODING_FORMATS:
            raise P.bad_request(f"encoding_format = {req.encoding_format!r}, expected 'float' or 'base64'",
                                "encoding_format")
        self._check_activation(req.use_activation)
        ids = self._chat_ids(req) if req.messages is not None else self._ids(_texts_or_ids(req.input, "input"), "input")
        if own == "embed":
            outs = await self._run(self.engine.embed([{"prompt_token_ids": x} for x in ids],
                                                     PoolingParams(normalize=req.use_activation)), "input", ids)
            vectors = [o.outputs.embedding for o in outs]
        else:
            vectors = await self._probs(ids)
        encode = _b64_float32 if req.encoding_format == "base64" else (lambda v: v)
        num_tokens = sum(len(x) for x in ids)
        return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.s.names[0],
                "data": [{"index": i, "object": "pooling", "data": encode(v)} for i, v in enumerate(vectors)],
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    async def classify(self, body: bytes) -> dict:
        """vLLM's ``/classify``: per input the classifier's ``probs``, its most likely ``label`` (the
        checkpoint's ``id2label``, else transformers' ``LABEL_<i>``) and ``num_classes``."""
        req = P.parse_request(ClassificationRequest, body)
        self._check_runner("Classification", needs_classifier=True)
        self.s.check_model(req.model)
        self._check_activation(req.use_activation)
        ids = self._ids(_texts_or_ids(req.input, "input"), "input")
        probs = await self._probs(ids)
        if self._labels is None:
            self._labels = checkpoint_labels(getattr(self.engine, "model_path", None))
        data = []
        for i, p in enumerate(probs):
            best = max(range(len(p)), key=p.__getitem__)
            data.append({"index": i, "label": self._labels.get(best, f"LABEL_{best}"), "probs": p,
                         "num_classes": len(p)})
        num_tokens = sum(len(x) for x in ids)
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.s.names[0], "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
