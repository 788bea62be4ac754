"""Speculative decoding (issue 29): the configuration (vLLM's ``speculative_config``), the n-gram
proposer (``"method": "ngram"``, prompt lookup) and the acceptance rules that keep the target
model's output, greedy token for token and sampled in distribution.

Where it runs: the scheduler asks the proposer for a request's drafts when it plans the request's
decode (``Scheduler._drafts``: the drafts count against the token budget and get KV blocks), the
runner verifies them in the step's one forward pass (``Sampler.verify``, engine/sampler.py: the
target's logits at the last token and at every draft), and the scheduler keeps the KV of the
accepted prefix only (``Scheduler.update``). Rejected rows are past the slot's token count: never
read, overwritten by the next step. Linear-attention state (hybrid models) cannot be cut back that
way; the runner saves the slots' state rows before the pass and, where a draft was rejected,
restores them and feeds the accepted prefix again (``ModelRunner._rollback_linear_state``).

A proposer drafts k tokens; one forward pass of the target model over the k + 1 positions (the last
accepted token and the k drafts) gives ``target_probs [k + 1, V]``: row i is the target's
distribution after the context and drafts ``1..i``. Then:

* greedy (``greedy_accept``): drafts are kept while each equals the target's argmax at its position;
  the first that does not is replaced by the argmax, and if all k are kept the argmax of row k is
  the bonus token. The emitted tokens are exactly what k + 1 greedy steps would give.
* sampled, deterministic drafts (n-gram's point masses; ``accept_picks``): row i's token is the
  plain sampler's pick (``sampling.sample``, the request's uniform at output position p + i), and
  draft i is kept iff it is that token. The draft is kept with probability p_i(d_i), as rejection
  sampling keeps a point mass, and a rejected row emits the pick, which given "not d_i" is
  distributed as ``normalize(p_i - p_i(d_i) e_{d_i})``: the same law, and for a seeded request
  (or any request under ``LLM(seed=...)``) the same tokens as without speculation, whatever the batch.
* sampled, drafts drawn from a proposer's ``q_i`` (``rejection_sample``, Leviathan et al. 2023 /
  Chen et al. 2023): draft i is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
  rejection the token is drawn from ``normalize(max(0, p_i - q_i))``, and if all are kept the bonus
  token is the plain pick of row k. Each emitted token then has the target's distribution given
  those before it.

Random numbers come from the request's noise (``sampling.SeededNoise``, or None: torch's default
generator) at the output position each row decides: the plain pick's uniform (``PICK``) for picks,
and uniforms of their own for the accept test (``ACCEPT``) and the residual draw (``RESIDUAL``); a
draw from a distribution is an inverse-CDF pick with one uniform (``sampling.cdf_pick``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from qwen_ops.engine.sampling import ACCEPT, PICK, RESIDUAL, cdf_pick, uniforms

SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# The speculative_config keys each method takes (vLLM's names).
_COMMON_KEYS = {"method", "num_speculative_tokens", "disable_by_batch_size"}
# Drafts per decode: the verify buffers hold 1 + k rows per sequence, sized from k at start. vLLM
# setups use 1-10; past this many, acceptance makes the extra rows pure cost.
MAX_SPECULATIVE_TOKENS = 64
_METHOD_KEYS = {"ngram": _COMMON_KEYS | {"prompt_lookup_min", "prompt_lookup_max"},
                "draft_model": _COMMON_KEYS | {"model"}, "mtp": _COMMON_KEYS}


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r}, expected an int >= {low}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``LLM(speculative_config={...})`` in vLLM's shape: ``method`` and ``num_speculative_tokens``
    (drafts per step); for ``"ngram"`` ``prompt_lookup_min`` / ``prompt_lookup_max`` (the n-gram
    sizes tried, longest first), for ``"draft_model"`` ``model`` (a checkpoint directory with the
    target's vocabulary: ``engine/draft.py``); ``"mtp"`` runs the target checkpoint's own
    multi-token-prediction layer (Qwen3-Next / Qwen3.5 ``mtp.*`` weights: ``engine/mtp.py``). ``disable_by_batch_size`` (vLLM V0's
    ``speculative_disable_by_batch_size``): no drafts in a step with at least that many decodes,
    where the step is no longer bound by reading the weights and k + 1 rows a sequence cost about
    k + 1 times the work (on the CPU from a few sequences on: benchmarks/README.md). Unknown keys
    and methods are errors naming them."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: Optional[int] = None
    model: Optional[str] = None
    disable_by_batch_size: Optional[int] = None

    @classmethod
    def from_dict(cls, config: Union[Mapping[str, Any], "SpeculativeConfig", None]) -> Optional["SpeculativeConfig"]:
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(f"speculative_config = {config!r}, expected a dict such as "
                             "{'method': 'ngram', 'num_speculative_tokens': 4} or None")
        method = config.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method = {method!r}, expected one of {list(SPECULATIVE_METHODS)}")
        unknown = sorted(set(config) - _METHOD_KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]} = {config[unknown[0]]!r} is not a {method!r} "
                             f"setting; expected only {sorted(_METHOD_KEYS[method])}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config.num_speculative_tokens is missing; expected an int >= 1")
        if method == "draft_model" and not isinstance(config.get("model"), (str, os.PathLike)):
            raise ValueError(f"speculative_config.model = {config.get('model')!r}, expected the draft checkpoint's "
                             "directory (a str)")
        out = cls(method, config["num_speculative_tokens"], config.get("prompt_lookup_min", 1),
                  config.get("prompt_lookup_max"), str(config["model"]) if method == "draft_model" else None,
                  config.get("disable_by_batch_size"))
        if out.disable_by_batch_size is not None:
            _check_int("speculative_config.disable_by_batch_size", out.disable_by_batch_size, 1)
        for name in ("num_speculative_tokens", "prompt_lookup_min"):
            _check_int(f"speculative_config.{name}", getattr(out, name), 1)
        if out.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:      # bounded before any buffer is sized
            raise ValueError(f"speculative_config.num_speculative_tokens = {out.num_speculative_tokens}, expected "
                             f"at most {MAX_SPECULATIVE_TOKENS} (MAX_SPECULATIVE_TOKENS)")
        if out.prompt_lookup_max is not None:
            _check_int("speculative_config.prompt_lookup_max", out.prompt_lookup_max, 1)
            if out.prompt_lookup_max < out.prompt_lookup_min:
                raise ValueError(f"speculative_config.prompt_lookup_max = {out.prompt_lookup_max} < "
                                 f"prompt_lookup_min = {out.prompt_lookup_min}; expected max >= min")
        return out

    def proposer(self):
        """The scheduler's proposer: n-gram lookup, or k places that the runner fills (the draft
        model's or the MTP layer's)."""
        if self.method in ("draft_model", "mtp"):
            return DraftModelProposer(self.num_speculative_tokens)
        return NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)


class DraftModelProposer:
    """The scheduler's side of a draft model: it only asks for ``k`` draft places per decode (the
    runner fills them), so budget and blocks are reserved as for any drafts."""

    reads_tokens = False              # the scheduler passes no tokens (propose ignores them)

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        return [0] * self.k               # placeholders: DraftRunner.propose writes the drafts


class NgramProposer:
    """Prompt lookup: the longest suffix n-gram of the tokens so far (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens) that occurred earlier; the up to ``num_speculative_tokens`` tokens
    that followed its latest earlier occurrence are the draft. Finding nothing drafts nothing."""

    reads_tokens = True               # the scheduler passes the request's tokens so far

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
        if length < 2 or self.min_n > length - 1:
            return []
        # Every earlier n-gram that matches ends where the last token occurs earlier: one pass over
        # the tokens finds those ends, then each longer n only checks them (a search that finds
        # nothing, the common case off repetitive text, costs one comparison per token).
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hits = ends[ends >= n - 1]
            for j in range(1, n):
                if not hits.size:
                    break
                hits = hits[tokens[hits - j] == tokens[length - 1 - j]]
            if hits.size:
                start = int(hits[-1]) + 1
                return tokens[start:start + self.k].tolist()
        return []


def accept_picks(picks: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """The tokens one verify pass emits given the target's pick at each of its k + 1 rows (the argmax,
    or the plain sampler's pick): the drafts while each equals the pick at its row, then the pick
    where one does not (or, all k kept, the bonus pick of row k)."""
    k = len(draft_tokens)
    if len(picks) != k + 1:
        raise ValueError(f"picks has {len(picks)} tokens, expected k + 1 = {k + 1}")
    out = []
    for i, d in enumerate(draft_tokens):
        if d != picks[i]:
            break
        out.append(int(d))
    out.append(int(picks[len(out)]))
    return out


def greedy_accept(target_probs: torch.Tensor, draft_tokens: Sequence[int]) -> list[int]:
    """Greedy verification: ``accept_picks`` of each row's argmax (exactly what k + 1 greedy steps emit)."""
    return accept_picks(target_probs.argmax(dim=-1).tolist(), draft_tokens)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: Sequence[int], draft_probs: Optional[torch.Tensor],
                     noise, position: int, bonus: Optional[int] = None) -> list[int]:
    """The tokens one verify pass emits under sampling (module docstring): target_probs ``[k + 1, V]``
    (each row a distribution), ``draft_tokens`` (k ids, for output positions ``position``, ``position +
    1``, ...), ``draft_probs [k, V]`` or None (a deterministic proposer: point masses on the drafts),
    the request's ``noise`` (a ``SeededNoise`` or None), and ``bonus``: the plain sampler's pick of
    row k (None: drawn here from row k with the same uniform). Returns 1 to k + 1 tokens."""
    k = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [k + 1 = {k + 1}, vocab]")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected [{k}, {target_probs.shape[1]}]")
    p = target_probs.double()
    out = []
    for i, d in enumerate(draft_tokens):
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(uniforms([noise], [position + i], ACCEPT)[0])
        if q_d > 0 and u * q_d < float(p[i, d]):                  # u < p / q
            out.append(int(d))
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft_probs[i].double()).clamp(min=0.0)
        dist = residual if float(residual.sum()) > 0 else p[i]
        out.append(int(cdf_pick(dist[None], uniforms([noise], [position + i], RESIDUAL))[0]))
        return out
    if bonus is None:
        bonus = int(cdf_pick(p[k:k + 1], uniforms([noise], [position + k], PICK))[0])
    out.append(int(bonus))
    return out
