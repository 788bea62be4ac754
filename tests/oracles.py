"""Outside oracles for the end-to-end suites (issue 43 item 4): transformers' greedy tokens and logits.

The engine's own single-session API is not an oracle for its batched, chunked, preempted or cached
runs: a wrong kernel makes both agree. These are transformers' ``generate(do_sample=False)`` (fp32,
eager attention) on the same checkpoint, remembered per prompt by the instance (one per test module).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from qwen_tiny import hf_greedy, load_hf


class TransformersGreedy:
    """``oracle(prompt, n)``: transformers' first ``n`` greedy tokens after ``prompt`` (never stopping
    at an EOS id); ``eos=`` cuts them after the first token in ``eos``, as a request that stops at
    EOS ends; ``oracle.logits(prompt)``: the logits of the prompt's last position."""

    def __init__(self, path, dtype: torch.dtype = torch.float32) -> None:
        self.model = load_hf(path, dtype)
        self._tokens: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: Sequence[int], n: int, eos: Optional[Sequence[int]] = None) -> list[int]:
        key = tuple(int(t) for t in prompt)
        have = self._tokens.get(key)
        if have is None or len(have) < n:
            have = self._tokens[key] = hf_greedy(self.model, key, n)
        tokens = have[:n]
        if eos:
            for i, t in enumerate(tokens):
                if t in eos:
                    return tokens[:i + 1]
        return tokens

    @torch.no_grad()
    def logits(self, prompt: Sequence[int]) -> torch.Tensor:
        return self.model(torch.tensor([list(prompt)])).logits[0, -1]
