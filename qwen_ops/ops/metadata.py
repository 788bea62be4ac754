"""Attention metadata: everything the slot ops need to know about one forward pass.

Built by the engine (or the runner's static buffers) and passed explicitly to the model's
forward; there is no global context object. Tensors are int32 on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_ids: torch.Tensor         # [num_tokens] slot each token's K/V is written to; -1 = padding
    seq_slots: torch.Tensor        # [num_seqs] slot each sequence reads; -1 = padding sequence
    block_table: torch.Tensor      # [max_slots, max_blocks_per_slot] physical block ids
    query_start_loc: torch.Tensor  # [num_seqs + 1] prefix sum of query tokens per sequence
    seq_lens: torch.Tensor         # [num_seqs] tokens in the slot after this step's write
    max_query_len: int             # static upper bound of query tokens per sequence (1 = decode)
