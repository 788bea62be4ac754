"""The checkpoint format layer: a checkpoint's tensors by name, whatever file holds them.

A safetensors directory (``model.safetensors``, or ``model.safetensors.index.json`` and its shards) or a
GGUF file (``models/gguf.py``): ``weight_files`` maps each tensor's Hugging Face name to the file holding
it, ``open_file`` opens one with safetensors' ``safe_open`` interface (``keys``, ``get_tensor``,
``get_slice``; a GGUF file's through ``gguf.GGUFHandle``, which also gives ``raw`` blocks), and
``MappedFiles`` reads tensors from several files a window of bytes at a time. The loader
(``models/loader.py``, full-precision tensors) and the quantized formats (``models/quant_load.py``) both
read through it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from qwen_ops.models.config import ARCHITECTURES, QwenConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAP_WINDOW_BYTES = 64 << 20
# safetensors dtype codes a floating-point weight may be stored in.
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# qwen3_5 / qwen3_5_moe (multimodal) checkpoints hold the language model under this prefix instead of "model.".
LANGUAGE_MODEL_PREFIX = "model.language_model."


class CheckpointError(ValueError):
    """A checkpoint file is unreadable or disagrees with its config; the message names the file."""


def checkpoint_name(param_name: str, config: QwenConfig, bare: bool = False) -> str:
    """The checkpoint's name of a model parameter: ``model.X`` is ``model.language_model.X`` in the
    multimodal wrappers (qwen3_5, qwen3_5_moe), and ``X`` in a bare decoder's checkpoint (``bare``:
    saved as transformers' ``Qwen3Model``)."""
    if bare and param_name.startswith("model."):
        return param_name.removeprefix("model.")
    if ARCHITECTURES[config.model_type].text_model_type is not None and param_name.startswith("model."):
        return LANGUAGE_MODEL_PREFIX + param_name.removeprefix("model.")
    return param_name


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (from the index, or the single file's header); for a
    GGUF file, its tensors' Hugging Face names -> the file (a ``GGUFPath``, which ``_open`` reads through)."""
    from qwen_ops.models.gguf import gguf_of, weight_path

    gguf = gguf_of(path)
    if gguf is not None:
        file = weight_path(gguf)
        return {name: file for name in gguf.names()}
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint directory")
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty 'weight_map' object of tensor name -> file")
        files = {name: path / file for name, file in weight_map.items()}
        for name, file in files.items():
            if not file.is_file():
                raise FileNotFoundError(f"{file}: weight file is missing (named in {index} for tensor {name!r})")
        return files
    single = path / SINGLE_FILE
    if single.is_file():
        with open_file(single) as f:
            return {name: single for name in f.keys()}
    others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.safetensors"))
    found = f"; found only {', '.join(others)} (only safetensors are supported)" if others else ""
    raise FileNotFoundError(f"{path}: no weight file: expected {SINGLE_FILE} or {INDEX_FILE}{found}")


class MappedFiles:
    """The checkpoint's tensors by name, each file mapped on first use and its mapping closed after
    ``MAP_WINDOW_BYTES`` of tensors read from it (``release``, once the caller holds no view of
    them: as :func:`_copy_tensors`, so touched pages stop counting as ours); all closed at exit."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.handles: dict[Path, Any] = {}
        self.mapped: dict[Path, int] = defaultdict(int)

    def __enter__(self) -> "MappedFiles":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles.values():
            handle.__exit__(None, None, None)
        self.handles.clear()

    def _read(self, name: str, read) -> torch.Tensor:
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = open_file(file).__enter__()
        t = read(self.handles[file])
        self.mapped[file] += t.numel() * t.element_size()
        return t

    def tensor(self, name: str) -> torch.Tensor:
        return self._read(name, lambda h: h.get_tensor(name))

    def raw(self, name: str):
        """A GGUF tensor's stored blocks and type (``gguf.GGUFHandle.raw``)."""
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = open_file(file).__enter__()
        return self.handles[file].raw(name)

    def row(self, name: str, index: int) -> torch.Tensor:
        """``name[index]`` (one expert of a stacked tensor), reading only that row of the file."""
        return self._read(name, lambda h: h.get_slice(name)[index])

    def release(self) -> None:
        for file in [f for f, n in self.mapped.items() if n >= MAP_WINDOW_BYTES]:
            self.handles.pop(file).__exit__(None, None, None)
            self.mapped[file] = 0


def open_file(file: Path):
    """``safe_open`` of ``file`` (memory-mapped), its errors rewritten to name the file; a GGUF file's
    tensors through the same interface (``gguf.GGUFHandle``)."""
    from safetensors import SafetensorError, safe_open

    carried = getattr(file, "gguf", None)
    if carried is not None:
        from qwen_ops.models.gguf import GGUFHandle

        return GGUFHandle(carried)

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{file}: corrupt or unreadable safetensors file ({e})") from e
    except OSError as e:
        raise CheckpointError(f"{file}: cannot open ({e})") from e


def read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data
