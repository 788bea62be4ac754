"""How much memory a device has free, and one check that a planned allocation fits, made before
anything is allocated: a size someone named (``num_kv_blocks``, ``block_size``, positions) gets an
error naming it and what it would need, instead of an allocator failure or a swapping machine."""

from __future__ import annotations

import os
from typing import Optional

import torch


def available_bytes(device: torch.device) -> Optional[int]:
    """Free memory of ``device``: CUDA's free bytes, or the host's ``MemAvailable`` (Linux);
    None where it cannot be read (then nothing is refused)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_total_bytes() -> Optional[int]:
    """The host's physical memory (MemTotal), None where it cannot be read."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_fits(nbytes: int, device: torch.device, what: str, fix: str = "") -> None:
    """Raise ``ValueError`` if ``nbytes`` for ``what`` (e.g. "num_kv_blocks = 10**12 (block_size = 16)")
    exceed the free memory of ``device``; ``fix`` says which settings to lower."""
    free = available_bytes(device)
    if free is not None and nbytes > free:
        raise ValueError(f"{what} needs {format_bytes(nbytes)} on {torch.device(device)}, but only "
                         f"{format_bytes(free)} is available" + (f"; {fix}" if fix else ""))
