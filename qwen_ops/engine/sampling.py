"""Sampling parameters (vLLM's vocabulary) and batched sampling on the device.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p, then draw with
the exponential race (argmax of p / E, E ~ Exp(1)), which equals sampling from p. A request
with a ``seed`` draws its noise from its own ``torch.Generator``, so its tokens do not depend
on which other requests share the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from qwen_ops.ops.kernels import cpu as cpu_kernels


# The seeds torch.Generator.manual_seed accepts (an int64 or a uint64): [SEED_MIN, SEED_END).
SEED_MIN = -2 ** 63
SEED_END = 2 ** 64


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to pick tokens. Defaults follow vLLM (temperature 1.0, 16 new tokens).

    ``max_new_tokens`` is also accepted as vLLM's ``max_tokens``. ``temperature == 0`` is greedy.
    ``top_k`` of -1 or 0 (stored as -1) and ``top_p == 1`` disable those filters; as in vLLM, a
    ``top_k`` below -1 is an error. ``seed`` must fit ``torch.Generator.manual_seed``: an int in
    [-2**63, 2**64).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __init__(self, max_new_tokens: Optional[int] = None, temperature: float = 1.0, top_k: int = -1,
                 top_p: float = 1.0, seed: Optional[int] = None, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, *, max_tokens: Optional[int] = None):
        if max_new_tokens is not None and max_tokens is not None and max_new_tokens != max_tokens:
            raise ValueError(f"max_new_tokens = {max_new_tokens} and max_tokens = {max_tokens} disagree; "
                             "give one of them")
        n = max_new_tokens if max_new_tokens is not None else (max_tokens if max_tokens is not None else 16)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens = {n!r}, expected an int >= 1")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature = {temperature!r}, expected a finite number >= 0 (0 = greedy)")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
            raise ValueError(f"top_k = {top_k!r}, expected -1 or 0 (off) or an int >= 1")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p = {top_p!r}, expected a number in (0, 1]")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or not SEED_MIN <= seed < SEED_END):
            raise ValueError(f"seed = {seed!r}, expected an int in [-2**63, 2**64) or None")
        stops = tuple(stop_token_ids)
        for i, t in enumerate(stops):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids[{i}] = {t!r}, expected an int >= 0")
        for name, value in (("max_new_tokens", n), ("temperature", float(temperature)),
                            ("top_k", top_k if top_k > 0 else -1), ("top_p", float(top_p)), ("seed", seed),
                            ("stop_token_ids", stops), ("ignore_eos", bool(ignore_eos))):
            object.__setattr__(self, name, value)

    @property
    def max_tokens(self) -> int:
        return self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        for i, t in enumerate(self.stop_token_ids):
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids[{i}] = {t}, expected < vocab_size = {vocab_size}")

    def make_generator(self, device: torch.device) -> Optional[torch.Generator]:
        if self.seed is None or self.greedy:
            return None
        g = torch.Generator(device=device)
        g.manual_seed(self.seed)
        return g


GREEDY = SamplingParams(temperature=0.0)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           default_generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` [N, vocab]; returns int64 [N] on the same device."""
    logits = logits.float()
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
            and not torch.compiler.is_compiling() and cpu_kernels.why_unavailable() is None):
        greedy_tokens = cpu_kernels.argmax_rows(logits)
    else:
        greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_tokens
    device = logits.device
    n, vocab = logits.shape
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    scaled = logits / temps[:, None]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_ks):
        k_t = torch.tensor(top_ks, device=device)
        sorted_desc = scaled.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k_t - 1)[:, None])
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    top_ps = [p.top_p for p in params]
    if any(p < 1.0 for p in top_ps):
        p_t = torch.tensor(top_ps, device=device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs   # mass strictly above each token
        drop_sorted = before > p_t[:, None]                   # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    # Exponential race; seeded rows draw from their own generator.
    noise = torch.empty_like(probs).exponential_(generator=default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.greedy for p in params], device=device)
    return torch.where(is_greedy, greedy_tokens, sampled)
