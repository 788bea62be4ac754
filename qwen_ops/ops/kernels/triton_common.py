"""What the Triton kernel modules share: a launch plan (:class:`Launch`) and the search that maps a
program to its sequence (``_find_sequence``). Kernels only: nothing here knows backends or the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, block_id, num_seqs, BLOCK_T: tl.constexpr):
    """The last sequence s whose first token-block id ``query_start_loc[s] // BLOCK_T + s`` is <= block_id.

    Programs are numbered across the whole batch (a sequence of q tokens owns q // BLOCK_T + 1
    ids), so grids depend on shapes only; a binary search over the non-decreasing first ids.
    """
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs   # a tensor even when num_seqs is specialised to 1
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_T + mid
        if first <= block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1



@dataclass(frozen=True)
class Launch:
    """One kernel launch: everything ``kernel[grid](*args, **constexprs, ...)`` needs."""
    kernel: Any                              # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]                    # runtime arguments in kernel order
    constexprs: tuple[tuple[str, Any], ...]  # (name, value) for every tl.constexpr parameter
    num_warps: int = 4
    num_stages: int = 2

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **dict(self.constexprs), num_warps=self.num_warps,
                               num_stages=self.num_stages)
