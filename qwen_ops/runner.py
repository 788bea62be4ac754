"""Model runner: owns the paged KV caches and the device block table, and turns a list of
sequence chunks into one forward pass of the model.

The engine decides what to run (which slot, which tokens, from which position); the runner
only packs it into flat token tensors plus ``AttentionMetadata`` and calls the model once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from qwen_ops.attention import AttentionMetadata


@dataclass(frozen=True)
class SeqChunk:
    """``token_ids`` of slot ``slot`` at positions ``start, start + 1, ...``."""

    slot: int
    token_ids: Sequence[int]
    start: int


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int, block_size: int, max_slots: int, max_blocks_per_slot: int,
                 dtype: torch.dtype, device: torch.device):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zero-filled so that unused rows never hold NaN; reads past seq_len are masked anyway.
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        self.block_table = torch.zeros((max_slots, max_blocks_per_slot), dtype=torch.int32, device=device)

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]

    def set_block_row(self, slot: int, blocks: Sequence[int]) -> None:
        """Make ``block_table[slot, :len(blocks)]`` name ``blocks`` (later columns are left as junk)."""
        if blocks:
            self.block_table[slot, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32).to(self.device)

    def grow_slots(self, max_slots: int) -> None:
        rows, cols = self.block_table.shape
        if max_slots > rows:
            grown = torch.zeros((max_slots, cols), dtype=torch.int32, device=self.device)
            grown[:rows] = self.block_table
            self.block_table = grown

    def grow_blocks(self, num_blocks: int) -> None:
        """Add physical blocks at the end; existing block ids keep their contents."""
        old = self.num_blocks
        if num_blocks <= old:
            return
        grown = []
        for k, v in self.kv_caches:
            k2 = torch.zeros((num_blocks,) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
            v2 = torch.zeros_like(k2)
            k2[:old] = k
            v2[:old] = v
            grown.append((k2, v2))
        self.kv_caches = grown

    def copy_blocks_out(self, blocks: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of ``blocks`` of every layer (for swap-out)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return [(k[idx].to("cpu"), v[idx].to("cpu")) for k, v in self.kv_caches]

    def copy_blocks_in(self, blocks: Sequence[int], saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for (k, v), (hk, hv) in zip(self.kv_caches, saved):
            k[idx] = hk.to(self.device)
            v[idx] = hv.to(self.device)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """One forward over all chunks; returns fp32 logits [len(chunks), vocab] of each chunk's last token."""
        token_ids: list[int] = []
        positions: list[int] = []
        slot_ids: list[int] = []
        seq_slots: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        for c in chunks:
            n = len(c.token_ids)
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + n))
            slot_ids.extend([c.slot] * n)
            seq_slots.append(c.slot)
            seq_lens.append(c.start + n)
            query_start_loc.append(query_start_loc[-1] + n)
        dev = self.device

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(dev, non_blocking=True)

        attn = AttentionMetadata(
            slot_ids=i32(slot_ids), seq_slots=i32(seq_slots), block_table=self.block_table,
            query_start_loc=i32(query_start_loc), seq_lens=i32(seq_lens),
            max_query_len=max(len(c.token_ids) for c in chunks))
        input_ids = torch.tensor(token_ids, dtype=torch.long).to(dev, non_blocking=True)
        pos = i32(positions)
        logits_indices = torch.tensor(query_start_loc[1:], dtype=torch.long).to(dev) - 1
        logits = self.model(input_ids, pos, attn, self.kv_caches, logits_indices)
        return logits.float()
