"""Serving many LoRA adapters from one base model (vLLM's LoRA API): ``LoRARequest`` names an
adapter, ``LoRAManager`` (one per engine) keeps their parsed weights in host memory and puts them
into the model's ``max_loras`` slots (``models/lora.py``) as requests need them.

Adapters are parsed from disk off the engine loop (``prepare``: the caller's thread, or a worker
thread while the request waits held, as grammars compile). A slot is taken when a request is
admitted (``acquire``) and given back when it finishes, is preempted or swapped out (``release``);
a slot whose adapter no running request uses is reused least recently used first. When every slot
serves running requests, a request of another adapter waits (the scheduler skips it; requests of
resident adapters and of the base model go ahead), so a step never holds more than ``max_loras``
distinct adapters.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

from qwen_ops.models.lora import LoRAAdapter, LoRAError, load_peft_adapter


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: an adapter's name (what a served request names as its ``model``), a
    positive int id that identifies it in the engine, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name = {self.lora_name!r}, expected a non-empty str")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id = {self.lora_int_id!r}, expected an int >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path = {self.lora_path!r}, expected the adapter's directory (a non-empty str)")

    @property
    def cache_key(self) -> bytes:
        """What keys a request's KV blocks besides its tokens (prefix caching): its adapter."""
        return f"lora:{self.lora_int_id}:{self.lora_path}".encode()


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA arguments: ``max_loras`` adapters in one step (the model's slots),
    ``max_lora_rank`` the largest rank served, ``max_cpu_loras`` parsed adapters kept in host memory
    (default ``max_loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}, expected an int >= 1")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras = {cpu!r}, expected an int >= max_loras = {self.max_loras} or None")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


class LoRAManager:
    """One engine's adapters (module docstring). ``load(slot, adapter)`` writes into the model's
    slot (the runner's ``load_lora``); ``module_names`` (with their full in / out features) and
    ``checkpoint_name`` say what an adapter may target and what its weights must fit (``models/lora.py``)."""

    def __init__(self, config: LoRAConfig, load: Callable[[int, Optional[LoRAAdapter]], Any],
                 module_names: dict[str, tuple[int, int]], checkpoint_name: Callable[[str], str] = lambda n: n) -> None:
        self.config = config
        self._load = load
        self._names = module_names
        self._checkpoint_name = checkpoint_name
        self._lock = threading.Lock()              # prepare runs on callers' threads
        self._parsed: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()   # LRU, host memory
        self._slots: list[Optional[int]] = [None] * config.max_loras     # adapter id in each slot
        self._refs = [0] * config.max_loras                               # running requests per slot
        self._used: OrderedDict[int, None] = OrderedDict()                # slots, least recently used first
        self._held: dict[int, int] = {}          # adapter id -> unfinished requests naming it (hold / unhold)
        self.num_loads = 0

    # ------------------------------------------------------------------ host memory
    def prepare(self, req: LoRARequest) -> LoRAAdapter:
        """The parsed adapter of ``req`` (from disk on first use; any thread). Raises ``LoRAError``
        naming the file or field, and ValueError for an id already used by another adapter."""
        with self._lock:
            have = self._parsed.get(req.lora_int_id)
            if have is not None:
                if have[0].lora_path != req.lora_path:
                    raise ValueError(f"lora_int_id = {req.lora_int_id} is already {have[0].lora_name!r} at "
                                     f"{have[0].lora_path!r}; expected a new id for {req.lora_path!r}")
                self._parsed.move_to_end(req.lora_int_id)
                return have[1]
        adapter = load_peft_adapter(req.lora_path, self._names, self.config.max_lora_rank, self._checkpoint_name)
        with self._lock:
            self._parsed[req.lora_int_id] = (req, adapter)
            self._parsed.move_to_end(req.lora_int_id)
            keep = {i for i in self._slots if i is not None} | {i for i, n in self._held.items() if n}
            while len(self._parsed) > self.config.cpu_capacity:
                victim = next((i for i in self._parsed if i not in keep and i != req.lora_int_id), None)
                if victim is None:
                    break
                del self._parsed[victim]
        return adapter

    def hold(self, lora_int_id: int) -> None:
        """An unfinished request names this adapter: its parsed weights stay in host memory (past
        ``max_cpu_loras`` if need be), so taking a slot never reads the disk (nor fails) in a step."""
        with self._lock:
            self._held[lora_int_id] = self._held.get(lora_int_id, 0) + 1

    def unhold(self, lora_int_id: int) -> None:
        with self._lock:
            n = self._held.get(lora_int_id, 0) - 1
            if n < 0:
                raise RuntimeError(f"lora_int_id = {lora_int_id} released by more requests than held it")
            if n:
                self._held[lora_int_id] = n
            else:
                del self._held[lora_int_id]

    def list_loras(self) -> list[LoRARequest]:
        """The adapters held in host memory, least recently used first."""
        with self._lock:
            return [r for r, _ in self._parsed.values()]

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (vLLM's ``remove_lora``): out of host memory, and out of its slot. False if
        it was not loaded; ValueError while unfinished requests name it."""
        with self._lock:
            slot = self._slots.index(lora_int_id) if lora_int_id in self._slots else None
            if self._held.get(lora_int_id) or (slot is not None and self._refs[slot]):
                raise ValueError(f"lora_int_id = {lora_int_id} serves {self._held.get(lora_int_id, 0)} unfinished "
                                 "requests; expected none (abort them first)")
            found = self._parsed.pop(lora_int_id, None) is not None
        if slot is not None:
            self._slots[slot] = None
            self._load(slot, None)
            found = True
        return found

    # ------------------------------------------------------------------ slots
    def acquire(self, req: LoRARequest) -> Optional[int]:
        """The slot serving ``req``'s adapter for one more running request, loading it into a free or
        unused slot if needed; None when every slot serves running requests of other adapters."""
        if req.lora_int_id in self._slots:
            slot = self._slots.index(req.lora_int_id)
        else:
            free = [s for s in self._used if self._refs[s] == 0] + [s for s in range(len(self._slots))
                                                                     if s not in self._used]
            if not free:
                return None
            slot = next((s for s in free if self._slots[s] is None), free[0])
            adapter = self.prepare(req)
            self._slots[slot] = req.lora_int_id
            self._load(slot, adapter)
            self.num_loads += 1
        self._refs[slot] += 1
        self._used[slot] = None
        self._used.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if self._refs[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self._refs[slot] -= 1

    def active(self) -> dict[int, int]:
        """``{lora_int_id: running requests}`` of the resident adapters (metrics)."""
        return {i: self._refs[s] for s, i in enumerate(self._slots) if i is not None}


__all__ = ["LoRAConfig", "LoRAError", "LoRAManager", "LoRARequest"]
