"""Speculative decoding's model-free parts (issue 29; the engine does not call them yet): the n-gram
proposer (vLLM's ``"method": "ngram"``, prompt lookup) and the acceptance rules that keep the target
model's output, greedy token for token and sampled in distribution.

A proposer drafts k tokens; one forward pass of the target model over the k + 1 positions (the last
accepted token and the k drafts) gives ``target_probs [k + 1, V]``: row i is the target's
distribution after the context and drafts ``1..i``. Then:

* greedy (``greedy_accept``): drafts are kept while each equals the target's argmax at its position;
  the first that does not is replaced by the argmax, and if all k are kept the argmax of row k is
  the bonus token. The emitted tokens are exactly what k + 1 greedy steps would give.
* sampled (``rejection_sample``, Leviathan et al. 2023 / Chen et al. 2023): draft i, drawn from
  ``q_i`` (``draft_probs``; a deterministic proposer such as n-gram is a point mass, so ``q_i(d_i) =
  1``), is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the token is
  drawn from ``normalize(max(0, p_i - q_i))``, and if all are kept a bonus token is drawn from
  ``p_k``. Each emitted token then has the target's distribution given those before it.

Random numbers come from a ``torch.Generator`` the caller owns (per request for seeded requests).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}, expected an int >= {low}")


class NgramProposer:
    """Prompt lookup: the longest suffix n-gram of the tokens so far (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens) that occurred earlier; the up to ``num_speculative_tokens`` tokens
    that followed its latest earlier occurrence are the draft. Finding nothing drafts nothing."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1,
                 prompt_lookup_max: Optional[int] = None) -> None:
        _check_int("num_speculative_tokens", num_speculative_tokens, 1)
        _check_int("prompt_lookup_min", prompt_lookup_min, 1)
        if prompt_lookup_max is None:
            prompt_lookup_max = max(prompt_lookup_min, 3)
        _check_int("prompt_lookup_max", prompt_lookup_max, 1)
        if prompt_lookup_max < prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max = {prompt_lookup_max} < prompt_lookup_min = {prompt_lookup_min}; "
                             "expected max >= min")
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows of n tokens that start early enough to be followed by one more token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + self.k].tolist()
        return []


def greedy_accept(target_probs: torch.Tensor, draft_tokens: Sequence[int]) -> list[int]:
    """The tokens greedy decoding emits from one verify pass: the drafts that equal the target's
    argmax at their position, then the argmax where the first one does not (or the bonus)."""
    best = target_probs.argmax(dim=-1).tolist()                 # [k + 1]
    out = []
    for i, d in enumerate(draft_tokens):
        if d != best[i]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def rejection_sample(target_probs: torch.Tensor, draft_tokens: Sequence[int],
                     draft_probs: Optional[torch.Tensor], generator: torch.Generator) -> list[int]:
    """The tokens one verify pass emits under sampling (module docstring): target_probs ``[k + 1, V]``
    (each row a distribution), ``draft_tokens`` (k ids), ``draft_probs [k, V]`` or None (a
    deterministic proposer: point masses on the drafts). Returns 1 to k + 1 tokens."""
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [k + 1 = {k + 1}, vocab]")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected [{k}, {target_probs.shape[1]}]")
    p = target_probs.double()
    out = []
    for i, d in enumerate(draft_tokens):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q_d > 0 and u * q_d < float(p[i, d]):                  # u < p / q
            out.append(int(d))
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i].double()).clamp(min=0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return out
