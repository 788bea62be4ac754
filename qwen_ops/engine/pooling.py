"""Pooling (embedding models): what a pooling request asks for, which rows of a chunk its pooling
reads, and how those rows become one vector.

A pooling request is a prompt that only prefills (``Request.pooling`` set): it runs through the
scheduler's chunked prefill and paged KV like any prompt, and its chunks' final-norm hidden
states (``QwenModel.forward``, no LM head) leave the forward only for the rows its pooling needs:

- ``"last"``: the last row of the chunk that ends the prompt (one row per request);
- ``"mean"``: every row of every chunk, summed per request in fp32 as the chunks run;
- ``"cls"``: row 0 of the chunk at position 0.

``"mean"`` and ``"cls"`` read rows a cached prefix would skip, so their requests map no cached
blocks (the scheduler asks ``reads_prefix``); ``"last"`` maps them like generation.
``finish_pooling`` turns the accumulated rows into the output: the mean's division, Matryoshka
truncation to ``dimensions``, then L2 normalization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

@dataclass(frozen=True)
class PoolingParams:
    """vLLM's ``PoolingParams`` (per request): ``dimensions`` keeps the first that many features of
    the embedding (Matryoshka models), before normalization; ``normalize`` None: the model's default
    (whether its sentence-transformers files have a ``Normalize`` module; True without those files)."""

    dimensions: Optional[int] = None
    normalize: Optional[bool] = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions = {d!r}, expected an int >= 1 or None")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize = {self.normalize!r}, expected True, False or None")


@dataclass(frozen=True)
class PoolingTask:
    """One request's resolved pooling: the model's ``pooling_type`` with the request's
    ``dimensions`` and ``normalize`` (the model's default filled in)."""

    pooling_type: str
    normalize: bool
    dimensions: Optional[int] = None

    @property
    def reads_prefix(self) -> bool:
        """Whether it reads rows before the last one (no cached prefix may stand in for them)."""
        return self.pooling_type != "last"


def pooled_rows(pooling_type: str, n: int, position_offset: int, ends_prompt: bool) -> range:
    """The rows (0 .. n - 1 of a chunk at ``position_offset``) whose hidden states pooling reads."""
    if pooling_type == "mean":
        return range(n)
    if pooling_type == "cls":
        return range(1) if position_offset == 0 else range(0)
    return range(n - 1, n) if ends_prompt else range(0)


def reduce_rows(pooling_type: str, hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """A chunk's contribution ``[hidden]`` (fp32) from its pooled rows ``[r, hidden]``: their sum
    for ``"mean"``, the one row otherwise (None: no rows)."""
    if hidden.shape[0] == 0:
        return None
    return hidden.float().sum(0) if pooling_type == "mean" else hidden[0].float()


def finish_pooling(task: PoolingTask, pooled: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The embedding ``[dimensions or hidden]`` (fp32) of a request whose chunks gave ``pooled``
    (summed over ``num_rows`` rows for the mean)."""
    out = pooled / num_rows if task.pooling_type == "mean" else pooled
    if task.dimensions is not None:
        out = out[:task.dimensions]
    if task.normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=0)
    return out
