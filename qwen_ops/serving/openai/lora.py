"""LoRA adapters over HTTP, as vLLM's server serves them: each adapter is a model name of its own
(``/v1/models`` lists it with its directory as ``root`` and its base model as ``parent``; a request
whose ``model`` names it runs with it), and, while ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true,
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and drop adapters at run time.

The engine parses each adapter (``AsyncLLM.add_lora``: on the core's LoRA thread, never on the
engine loop or this event loop), so a slow or bad file stalls no other request; a name is served
only once its adapter has parsed, and a failed load changes nothing.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from qwen_ops.engine.lora import LoRARequest
from qwen_ops.serving.openai import protocol as P

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's switch for the load/unload routes: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` = 1 or true."""
    return environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """vLLM's ``--lora-modules`` entry: the name requests use, the PEFT directory, and the base
    model's name that ``/v1/models`` gives as its ``parent`` (default: the served name)."""

    name: str
    path: str
    base_model_name: Optional[str] = None


class LoadLoRAAdapterRequest(P._Strict):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(P._Strict):
    lora_name: str
    lora_int_id: Optional[int] = None


class LoRAAdapters:
    """The adapters one server serves, by name (the one owner of that map). Ids are fresh positive
    ints, never reused: a name loaded again is a new adapter to the engine (and its prefix cache)."""

    def __init__(self, engine, base_names: Sequence[str]):
        self._engine = engine
        self._base_names = list(base_names)
        self._by_name: dict[str, tuple[LoRARequest, str]] = {}     # name -> (request, parent's name)
        self._loading: set[str] = set()                              # names whose adapter is parsing
        self._ids = itertools.count(1)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names; None for the base model (or no name); a 404 in
        vLLM's shape for any other name."""
        if model is None or model in self._base_names:
            return None
        found = self._by_name.get(model)
        if found is None:
            served = ", ".join(repr(n) for n in self._base_names + list(self._by_name))
            raise P.APIError(404, f"The model `{model}` does not exist; this server serves {served}", "model")
        return found[0]

    def cards(self, created: int) -> list[dict]:
        """``/v1/models`` entries of the adapters (vLLM's: ``root`` the directory, ``parent`` the base)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "qwen-ops", "root": lr.lora_path,
                 "parent": parent, "max_model_len": None} for name, (lr, parent) in self._by_name.items()]

    async def load(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Parse the adapter at ``path`` in the engine, then serve it as ``name``; a 400 (nothing
        changed) for a taken name or an adapter that does not parse."""
        if not name or not path:
            raise P.bad_request("Both 'lora_name' and 'lora_path' must be provided.",
                                "lora_name" if not name else "lora_path")
        if name in self._base_names:
            raise P.bad_request(f"lora_name = {name!r} is the base model's name; expected another name", "lora_name")
        if name in self._by_name or name in self._loading:
            raise P.bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        request = LoRARequest(name, next(self._ids), path, base_model_name)
        self._loading.add(name)
        try:
            await self._engine.add_lora(request)
        except ValueError as e:
            raise P.bad_request(f"The lora adapter '{name}' could not be loaded: {e}", "lora_path") from None
        finally:
            self._loading.discard(name)
        self._by_name[name] = (request, base_model_name or self._base_names[0])
        return request

    async def unload(self, name: str) -> None:
        """Stop serving ``name`` and free its adapter in the engine; a 404 for an unknown name, a 400
        (still served) while requests use it."""
        found = self._by_name.pop(name, None)         # no new request resolves it from here on
        if found is None:
            raise P.APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        try:
            await self._engine.remove_lora(found[0].lora_int_id)
        except ValueError as e:
            self._by_name[name] = found
            raise P.bad_request(f"The lora adapter '{name}' is in use and was not unloaded: {e}", "lora_name") from None

    async def load_static(self, modules: Sequence[LoRAModulePath]) -> None:
        """``--lora-modules`` at startup: each parses, or a ValueError naming the module stops the server."""
        for m in modules:
            try:
                await self.load(m.name, m.path, m.base_model_name)
            except P.APIError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from None
