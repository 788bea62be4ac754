"""torch.ops.qwen.*: the one public entry to the kernels.

The schemas come from ``torch_library/qwen.schema`` (installed as ``qwen_ops.torch_library``).
This module defines them, registers one CPU and one CUDA implementation per op that
validate the arguments and dispatch to the selected backend (``qwen_ops.backend``), and
registers the fake kernels that ``torch.compile`` traces with. The C++ extension, when
built, only adds kernels in its own private namespace, which the ``cuda`` backend calls.
"""

from __future__ import annotations

from typing import Optional

import torch

from qwen_ops import _validation as V
from qwen_ops.backend import kernels, resolve_backend, value_checks_enabled
from qwen_ops.torch_library import NAMESPACE, SCHEMAS

# Holds the op definitions alive for the life of the process; never mutated after import.
_LIB = torch.library.Library(NAMESPACE, "DEF")
for _name, _schema in SCHEMAS.items():
    _LIB.define(_name + _schema)


def _kv_write_impl(key, value, key_cache, value_cache, slot_ids, positions, block_table) -> None:
    V.check_kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table)
    backend = resolve_backend(key.device)
    if value_checks_enabled(backend):
        V.check_kv_write_values(key_cache, slot_ids, positions, block_table)
    getattr(kernels(backend), f"kv_write_{backend}")(key, value, key_cache, value_cache, slot_ids,
                                                      positions, block_table)


def _slot_attention_impl(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                         scale, max_query_len, gate=None) -> torch.Tensor:
    V.check_slot_attention(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                           scale, max_query_len, gate)
    backend = resolve_backend(query.device)
    if value_checks_enabled(backend):
        V.check_slot_attention_values(query, key_cache, block_table, seq_slots, query_start_loc, seq_lens,
                                      max_query_len)
    return getattr(kernels(backend), f"slot_attention_{backend}")(
        query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens, scale,
        max_query_len, gate)


for _key in ("CPU", "CUDA"):
    _LIB.impl("kv_write", _kv_write_impl, _key)
    _LIB.impl("slot_attention", _slot_attention_impl, _key)


@torch.library.register_fake(f"{NAMESPACE}::kv_write", lib=_LIB)
def _kv_write_fake(key, value, key_cache, value_cache, slot_ids, positions, block_table) -> None:
    V.check_kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table)


@torch.library.register_fake(f"{NAMESPACE}::slot_attention", lib=_LIB)
def _slot_attention_fake(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                         scale, max_query_len, gate=None) -> torch.Tensor:
    V.check_slot_attention(query, key_cache, value_cache, block_table, seq_slots, query_start_loc, seq_lens,
                           scale, max_query_len, gate)
    return torch.empty_like(query)


def kv_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches.

    Token i goes to slot ``slot_ids[i]`` (int32, -1 = padding, nothing written) at position
    ``positions[i]`` (int32), i.e. block ``block_table[slot, pos // block_size]``, row
    ``pos % block_size`` of ``key_cache``/``value_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``.
    """
    torch.ops.qwen.kv_write(key, value, key_cache, value_cache, slot_ids, positions, block_table)


def slot_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_slots: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, max_query_len: int,
                   gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal GQA attention over slot-indexed paged KV, for prefill, chunks, decode and mixes.

    query ``[num_tokens, num_heads, head_dim]``; sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]`` and reads slot ``seq_slots[i]`` (-1 = padding,
    rows zero) holding ``seq_lens[i]`` tokens after this step's write. Row j of a sequence with
    q rows sits at position ``seq_len - q + j``. ``max_query_len`` is a static upper bound on q
    (1 selects the decode kernel). ``gate`` multiplies the output by ``sigmoid(gate)``.
    Returns ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    return torch.ops.qwen.slot_attention(query, key_cache, value_cache, block_table, seq_slots,
                                         query_start_loc, seq_lens, scale, max_query_len, gate)
