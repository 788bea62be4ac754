"""What an embedding checkpoint says about its pooling: the sentence-transformers files beside the
weights (``modules.json``, the ``Pooling`` module's ``config.json``, a ``Normalize`` module).

    modules.json           [{"path": "", "type": "sentence_transformers.models.Transformer"},
                            {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                            {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    1_Pooling/config.json  {"pooling_mode_lasttoken": true, "pooling_mode_mean_tokens": false, ...}

Qwen3-Embedding ships exactly this (last token, then L2 normalization). A checkpoint without
``modules.json`` has no ``PoolerConfig``; the pooling runner then uses last-token pooling with
normalization, vLLM's default for decoder models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

MODULES_FILE = "modules.json"
ST_PREFIX = "sentence_transformers.models."
# 1_Pooling/config.json's modes, and the pooling type each means here.
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_cls_token": "cls"}
UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                     "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolerConfig:
    """A checkpoint's pooling: ``pooling_type`` ("last", "mean" or "cls") and whether a
    ``Normalize`` module follows it."""

    pooling_type: str = "last"
    normalize: bool = True


def _read(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: not readable JSON: {e}") from None


def read_pooler_config(path: Path) -> Optional[PoolerConfig]:
    """The sentence-transformers pooling of checkpoint ``path``, or None when it has no
    ``modules.json`` with a ``Pooling`` module. A module this package cannot run (a ``Dense``
    projection, max or weighted-mean pooling) is a ValueError naming the file."""
    file = Path(path) / MODULES_FILE
    if not file.is_file():
        return None
    modules = _read(file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{file}: expected a list of module objects with 'path' and 'type'")
    kinds = [str(m.get("type", "")).removeprefix(ST_PREFIX) for m in modules]
    if "Pooling" not in kinds:
        return None
    for kind in kinds:
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise ValueError(f"{file}: module type {ST_PREFIX}{kind} is not supported; expected only "
                             "Transformer, Pooling and Normalize")
    pool_dir = Path(path) / str(modules[kinds.index("Pooling")].get("path", ""))
    cfg = _read(pool_dir / "config.json")
    if not isinstance(cfg, dict):
        raise ValueError(f"{pool_dir / 'config.json'}: expected a JSON object of pooling_mode_* flags")
    for key in UNSUPPORTED_MODES:
        if cfg.get(key):
            raise ValueError(f"{pool_dir / 'config.json'}: {key} = true is not supported; expected one of "
                             f"{', '.join(POOLING_MODES)}")
    chosen = [kind for key, kind in POOLING_MODES.items() if cfg.get(key)]
    if len(chosen) != 1:
        raise ValueError(f"{pool_dir / 'config.json'}: {len(chosen)} of {', '.join(POOLING_MODES)} are true; "
                         "expected exactly one")
    return PoolerConfig(chosen[0], "Normalize" in kinds)


# config.json architectures of a bare decoder: hidden states out, nothing to generate with.
BARE_DECODERS = ("Qwen2Model", "Qwen3Model")
SEQUENCE_CLASSIFIERS = ("Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


def is_embedding_checkpoint(path: Path) -> bool:
    """Whether ``path`` says it is a pooling model: a sentence-transformers ``Pooling`` module, or a
    config.json whose ``architectures`` name the bare decoder (saved as ``Qwen3Model``) or a
    sequence classifier (``Qwen3ForSequenceClassification``)."""
    if read_pooler_config(path) is not None:
        return True
    file = Path(path) / "config.json"
    cfg = _read(file) if file.is_file() else {}
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    return isinstance(archs, list) and bool(archs) and all(
        a in BARE_DECODERS or a in SEQUENCE_CLASSIFIERS for a in archs)
