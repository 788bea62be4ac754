"""The offline pooling API (``LLM.embed``, ``classify``, ``score``, ``encode``, ``reward``) and its
outputs, in vLLM's shapes.

    llm = qwen_ops.LLM("Qwen/Qwen3-Embedding-0.6B", runner="pooling")
    out = llm.embed(["a query", "a document"], qwen_ops.PoolingParams(dimensions=256))
    out[0].outputs.embedding                      # 256 floats, unit length
    llm.score("a query", ["doc 1", "doc 2"])[1].outputs.score   # cosine similarity

Each prompt is one pooling request of the engine core's scheduler (``engine/pooling.py``: it only
prefills, chunked and prefix-cached like any prompt, and frees its blocks after its last chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from qwen_ops.engine.pooling import PoolingParams, PoolingTask
from qwen_ops.models.pooler_config import PoolerConfig

RUNNERS = ("auto", "generate", "pooling")
# vLLM's pooling tasks (``LLM.encode(pooling_task=...)``); one vector per prompt is what runs here.
ENCODE_TASKS = ("embed", "classify")
PER_TOKEN_TASKS = ("token_embed", "token_classify")
# vLLM's older ``task=`` spelling, and the runner each means.
TASKS = {"auto": "auto", "generate": "generate", "embed": "pooling", "score": "pooling"}


@dataclass
class PoolingOutput:
    """vLLM's: the pooled result of one prompt (``LLM.encode``): an embedding, or a classifier's
    probabilities, as a float32 tensor."""
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """vLLM's (its argument order): one prompt's ``PoolingOutput``; ``num_cached_tokens``: its prompt
    tokens served from the prefix cache."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def resolve_runner(runner: Any, task: Any, checkpoint_pools: bool) -> str:
    """``"generate"`` or ``"pooling"`` from ``LLM``'s ``runner`` (vLLM's) and ``task`` (its older
    spelling); ``"auto"`` is ``"pooling"`` where the checkpoint is an embedding model
    (``checkpoint_pools``)."""
    if not isinstance(runner, str) or runner not in RUNNERS:
        raise ValueError(f"runner = {runner!r}, expected one of {', '.join(map(repr, RUNNERS))}")
    if task is not None and (not isinstance(task, str) or task not in TASKS):
        raise ValueError(f"task = {task!r}, expected one of {', '.join(map(repr, TASKS))} or None")
    from_task = TASKS[task] if task is not None else "auto"
    if runner != "auto" and from_task != "auto" and runner != from_task:
        raise ValueError(f"runner = {runner!r} and task = {task!r} disagree; expected one of them, or a task "
                         f"that means runner {runner!r}")
    chosen = runner if runner != "auto" else from_task
    if chosen == "auto":
        chosen = "pooling" if checkpoint_pools else "generate"
    return chosen


def pooling_tasks(pooling_params: Union[PoolingParams, Sequence[PoolingParams], None], n: int,
                  pooler: PoolerConfig, hidden_size: int) -> list[PoolingTask]:
    """One ``PoolingTask`` per prompt from vLLM's ``pooling_params`` (one for all, or one each)."""
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params = [pooling_params or PoolingParams()] * n
    elif isinstance(pooling_params, Sequence) and not isinstance(pooling_params, str):
        params = list(pooling_params)
        if len(params) != n:
            raise ValueError(f"pooling_params has {len(params)} entries, expected one per prompt ({n})")
    else:
        raise ValueError(f"pooling_params = {pooling_params!r}, expected a PoolingParams, a list of them "
                         "(one per prompt), or None")
    tasks = []
    for i, p in enumerate(params):
        if not isinstance(p, PoolingParams):
            raise ValueError(f"pooling_params[{i}] = {p!r}, expected a qwen_ops.PoolingParams")
        if p.dimensions is not None and p.dimensions > hidden_size:
            raise ValueError(f"pooling_params[{i}].dimensions = {p.dimensions}, but the model's embeddings have "
                             f"{hidden_size}; expected at most that")
        normalize = pooler.normalize if p.normalize is None else p.normalize
        tasks.append(PoolingTask(pooler.pooling_type, normalize, p.dimensions))
    return tasks


def run_pooling(llm, prompts: list[list[int]], tasks: list[PoolingTask],
                use_tqdm: Union[bool, Callable[..., Any]]) -> list[torch.Tensor]:
    """Run pooling requests on ``llm``'s engine core until each has its embedding (fp32 tensors,
    in prompt order); an interruption aborts the unfinished ones. With ``data_parallel_size > 1``
    they run on the replicas (``OfflineDataParallel.encode``)."""
    if getattr(llm, "_dp", None) is not None:
        return llm._dp.encode(prompts, tasks)
    return [r.embedding for r in run_pooling_requests(llm, prompts, tasks, use_tqdm)]


def run_pooling_requests(llm, prompts: list[list[int]], tasks: list[PoolingTask],
                         use_tqdm: Union[bool, Callable[..., Any]]) -> list:
    """``run_pooling``'s finished scheduler requests (``.embedding``, and what the scheduler recorded)."""
    core = llm.core
    reqs = core.add_pooling_requests(prompts, tasks)
    bar = None
    if use_tqdm:
        if callable(use_tqdm) and not isinstance(use_tqdm, bool):
            factory = use_tqdm
        else:
            from tqdm.auto import tqdm as factory
        bar = factory(total=len(reqs), desc="Processed prompts", dynamic_ncols=True)
    done = 0
    try:
        while True:
            finished = sum(r.finished for r in reqs)
            if bar is not None and finished > done:
                bar.update(finished - done)
            done = finished
            if done == len(reqs):
                break
            core.step()
    finally:
        if bar is not None:
            bar.close()
        core.abort_requests(reqs)
    return reqs


def check_pooling_task(pooling_task: Any, classifier: bool) -> None:
    """``LLM.encode``'s ``pooling_task`` against what this model pools: ``"embed"`` for an embedding
    model, ``"classify"`` for a classifier (vLLM requires one, as here)."""
    if pooling_task is None:
        raise ValueError("pooling_task = None: LLM.encode needs one (vLLM's rule); expected 'embed' (an "
                         "embedding model, as LLM.embed) or 'classify' (a classifier or reward model, as "
                         "LLM.classify / LLM.reward)")
    if pooling_task in PER_TOKEN_TASKS:
        raise ValueError(f"pooling_task = {pooling_task!r}: this engine pools one vector per prompt (last, mean "
                         f"or cls), not one per token; expected one of {', '.join(map(repr, ENCODE_TASKS))}")
    if pooling_task not in ENCODE_TASKS:
        raise ValueError(f"pooling_task = {pooling_task!r}, expected one of {', '.join(map(repr, ENCODE_TASKS))}")
    want = "classify" if classifier else "embed"
    if pooling_task != want:
        kind = "a classifier (a reranker or a sequence classifier)" if classifier else "an embedding model"
        raise ValueError(f"pooling_task = {pooling_task!r}, but this model is {kind}; expected {want!r}")


def score_pairs(text_1, text_2) -> list[tuple[Any, Any]]:
    """vLLM's pairing of ``LLM.score``: one against one, one against N, or N against N (pairwise)."""
    one_1 = isinstance(text_1, (str, dict))
    one_2 = isinstance(text_2, (str, dict))
    left = [text_1] if one_1 else list(text_1)
    right = [text_2] if one_2 else list(text_2)
    if not left or not right:
        raise ValueError(f"text_1 has {len(left)} items and text_2 {len(right)}; expected at least one each")
    if len(left) == 1:
        return [(left[0], r) for r in right]
    if len(left) != len(right):
        raise ValueError(f"text_1 has {len(left)} items and text_2 {len(right)}; expected one text_1, or as many "
                         "text_1 as text_2 (scored pairwise)")
    return list(zip(left, right))


class ScorePlan:
    """The one pairing of ``LLM.score`` and ``AsyncLLM.score``: ``prompts`` are what the pooling runner
    must run (a cross-encoder's joined pairs, or each distinct text once for an embedding model: one
    against N embeds the one text once), and ``outputs`` turns their pooled vectors into scores. The
    caller runs the prompts its own way (``run_pooling`` in ``LLM``, ``encode`` on ``AsyncLLM``'s loop).
    ``pooling_ids`` validates and tokenizes prompts as the caller does."""

    def __init__(self, text_1, text_2, pooling_ids: Callable[[list], list[list[int]]],
                 classifier: Optional[torch.Tensor]):
        pairs = score_pairs(text_1, text_2)
        if classifier is not None and classifier.shape[0] != 1:
            raise ValueError(f"score with a classifier of num_labels = {classifier.shape[0]}; expected a "
                             "one-label classifier (a reranker) or an embedding model")
        self.classifier = classifier
        self.left = pooling_ids([a for a, _ in pairs])
        self.right = pooling_ids([b for _, b in pairs])
        if classifier is not None:           # a cross-encoder (reranker): one prompt per pair
            self.prompts = pooling_ids([{"prompt_token_ids": a + b} for a, b in zip(self.left, self.right)])
        else:
            self.prompts = [list(u) for u in dict.fromkeys(map(tuple, self.left + self.right))]

    def outputs(self, vectors: Sequence[torch.Tensor]) -> list[ScoringRequestOutput]:
        if self.classifier is not None:
            probs = classifier_probs(torch.stack(list(vectors)), self.classifier)
            return [ScoringRequestOutput(str(k), self.prompts[k], ScoringOutput(p[0])) for k, p in enumerate(probs)]
        by_text = dict(zip(map(tuple, self.prompts), vectors))
        return [ScoringRequestOutput(str(k), a + b, ScoringOutput(torch.nn.functional.cosine_similarity(
                    by_text[tuple(a)], by_text[tuple(b)], dim=0).item()))
                for k, (a, b) in enumerate(zip(self.left, self.right))]


# ---------------------------------------------------------------------------- Qwen3-Reranker
# vLLM's hf_overrides for Qwen3-Reranker: score with the lm_head rows of "no" and "yes".
RERANKER_ARCHITECTURE = "Qwen3ForSequenceClassification"
HF_OVERRIDE_KEYS = ("architectures", "classifier_from_token", "is_original_qwen3_reranker")
# The prompt of Qwen3-Reranker's model card: a system turn, the instruction, query and document, an
# empty thinking block; the score is P("yes") against "no" as the next token.
QWEN3_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                         "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                         "<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_reranker_inputs(query: str, documents: Union[str, Sequence[str]],
                          instruction: Optional[str] = None) -> tuple[str, Union[str, list[str]]]:
    """``(text_1, text_2)`` for ``LLM.score`` with Qwen3-Reranker, in its model card's format:
    ``text_1`` = prefix + ``<Instruct>: {instruction}\\n<Query>: {query}\\n``, each ``text_2`` =
    ``<Document>: {document}`` + suffix; the scored prompt is the two joined."""
    text_1 = (f"{QWEN3_RERANKER_PREFIX}<Instruct>: {instruction or QWEN3_RERANKER_INSTRUCTION}\n"
              f"<Query>: {query}\n")
    if isinstance(documents, str):
        return text_1, f"<Document>: {documents}{QWEN3_RERANKER_SUFFIX}"
    return text_1, [f"<Document>: {d}{QWEN3_RERANKER_SUFFIX}" for d in documents]


def split_hf_overrides(hf_overrides: Optional[dict]) -> tuple[Optional[dict], dict]:
    """vLLM's ``hf_overrides`` as ``(reranker, config)``: the Qwen3-Reranker keys (``HF_OVERRIDE_KEYS``;
    None when it names none of them) and the rest, config.json keys laid over the checkpoint's
    (``rope_theta``, ``rope_scaling``, ``max_position_embeddings``, ...; vLLM's context extension)."""
    if hf_overrides is None:
        return None, {}
    if not isinstance(hf_overrides, dict):
        raise ValueError(f"hf_overrides = {hf_overrides!r}, expected a dict or None")
    reranker = {k: v for k, v in hf_overrides.items() if k in HF_OVERRIDE_KEYS}
    config = {k: v for k, v in hf_overrides.items() if k not in HF_OVERRIDE_KEYS}
    if set(reranker) == {"architectures"} and reranker["architectures"] != [RERANKER_ARCHITECTURE]:
        config["architectures"] = reranker.pop("architectures")     # a config key, not the reranker's
    return (reranker or None), config


def check_hf_overrides(hf_overrides: Optional[dict]) -> None:
    """vLLM's Qwen3-Reranker overrides, checked before the load: its architecture, two classifier
    tokens (strings or ids). The other keys are config.json keys (``split_hf_overrides``), checked
    with the config."""
    hf_overrides, _ = split_hf_overrides(hf_overrides)
    if hf_overrides is None:
        return
    archs = hf_overrides.get("architectures", [RERANKER_ARCHITECTURE])
    if archs != [RERANKER_ARCHITECTURE]:
        raise ValueError(f"hf_overrides['architectures'] = {archs!r}, expected [{RERANKER_ARCHITECTURE!r}]")
    tokens = hf_overrides.get("classifier_from_token")
    if not isinstance(tokens, (list, tuple)) or len(tokens) != 2:
        raise ValueError(f"hf_overrides['classifier_from_token'] = {tokens!r}, expected two tokens: "
                         "['no', 'yes'] (strings, or token ids)")


def classifier_tokens(hf_overrides: dict, tokenizer) -> tuple[int, int]:
    """The ``(no, yes)`` token ids of vLLM's Qwen3-Reranker overrides (``classifier_from_token``:
    two tokens, as strings looked up in the tokenizer or as ids)."""
    check_hf_overrides(hf_overrides)
    tokens = hf_overrides["classifier_from_token"]
    ids = []
    for i, tok in enumerate(tokens):
        if isinstance(tok, int) and not isinstance(tok, bool):
            ids.append(tok)
            continue
        tid = tokenizer.token_to_id(tok) if isinstance(tok, str) and tokenizer is not None else None
        if tid is None:
            raise ValueError(f"hf_overrides['classifier_from_token'][{i}] = {tok!r} is not a token of the "
                             "checkpoint's tokenizer; expected a token string it has, or a token id")
        ids.append(tid)
    return ids[0], ids[1]


def reranker_head(lm_head_weight: torch.Tensor, no: int, yes: int) -> torch.Tensor:
    """Qwen3-Reranker as a one-label classifier ``[1, hidden]`` (vLLM's conversion): the "yes" row of
    the LM head less the "no" row, so sigmoid of its logit is softmax over (no, yes)'s "yes" share."""
    return (lm_head_weight[yes].float() - lm_head_weight[no].float()).unsqueeze(0)


def classifier_probs(hidden: torch.Tensor, head: torch.Tensor) -> list[list[float]]:
    """Per row of ``hidden [N, H]`` (last-token final-norm states), the classifier ``head [L, H]``'s
    probabilities: sigmoid of the one logit (a reranker, ``num_labels`` 1) or softmax over the labels."""
    logits = hidden.float() @ head.float().t()
    probs = torch.sigmoid(logits) if head.shape[0] == 1 else torch.softmax(logits, dim=-1)
    return probs.tolist()
