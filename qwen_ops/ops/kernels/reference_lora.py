"""Plain-torch references of the multi-LoRA ops ``lora_shrink`` / ``lora_expand`` (contracts in
``torch_library/qwen.schema``): the specification and the oracle of every other kernel.

One torch product per adapter slot present in the batch (the rows of that slot gathered), in fp32.
"""

from __future__ import annotations

import torch


def _rows_by_slot(lora_indices: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, row numbers) for every slot other than -1 that some row uses."""
    idx = lora_indices.long()
    return [(slot, (idx == slot).nonzero().squeeze(1)) for slot in torch.unique(idx).tolist() if slot >= 0]


def lora_shrink_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_indices: torch.Tensor,
                          scalings: torch.Tensor) -> torch.Tensor:
    """x [T, K], lora_a [L, S * R, K] -> fp32 [T, S * R]: scalings[i] * (lora_a[i] @ x[t]), i = lora_indices[t];
    zero rows for -1."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _rows_by_slot(lora_indices):
        out[rows] = (x[rows].float() @ lora_a[slot].float().T) * scalings[slot]
    return out


def lora_expand_reference(y: torch.Tensor, buffer: torch.Tensor, lora_b: torch.Tensor, lora_indices: torch.Tensor,
                          slice_sizes: list[int]) -> None:
    """In place: y[t, n] += buffer[t, s R : (s + 1) R] . lora_b[i, n] for n in slice s, in fp32, rounded once to
    y's dtype; rows with i = -1 untouched."""
    rank = lora_b.shape[2]
    for slot, rows in _rows_by_slot(lora_indices):
        delta = torch.empty(rows.numel(), lora_b.shape[1], dtype=torch.float32, device=y.device)
        start = 0
        for s, size in enumerate(slice_sizes):
            delta[:, start:start + size] = buffer[rows, s * rank:(s + 1) * rank] @ lora_b[slot, start:start + size].float().T
            start += size
        y[rows] = (y[rows].float() + delta).to(y.dtype)
