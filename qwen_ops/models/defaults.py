"""Where the embedded default model lives inside the installed package."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def default_model_path() -> Path:
    """The small Qwen3 checkpoint shipped in ``qwen_ops/default_model`` (Hugging Face layout)."""
    return Path(__file__).resolve().parent.parent / "default_model"


# What a model id's snapshot needs: configs, weights, tokenizer, chat template.
SNAPSHOT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def resolve_model_path(model, revision: Optional[str] = None, cache_dir: Optional[str] = None,
                       token=None) -> Path:
    """A checkpoint directory from vLLM's ``model`` argument: None is the embedded model; an
    existing path is itself (a GGUF file: a ``GGUFPath`` carrying the file, read once); otherwise a Hugging Face model id (``"Qwen/Qwen3-0.6B"``), looked
    up in the local Hugging Face cache first (all that ``HF_HUB_OFFLINE=1`` allows), downloaded
    with ``huggingface_hub`` if not there. A ValueError names the id when neither works.
    ``revision`` (a branch, tag or commit), ``cache_dir`` (vLLM's ``download_dir``) and ``token``
    (``hf_token``) go to ``huggingface_hub`` as vLLM passes them."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    text = str(model)
    if path.is_file():                  # a GGUF file: read once here, carried by the path (models/gguf.py)
        from qwen_ops.models.gguf import open_path

        return open_path(path)
    if path.exists() or text.count("/") != 1 or text.startswith((".", "/", "~")) or text.endswith("/"):
        return path                     # a path (the loader says what is wrong with it), not an id
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ValueError(f"model = {text!r} is not a directory, and huggingface_hub (to look it up as a "
                         "Hugging Face model id) is not installed") from None
    hub = {k: v for k, v in (("revision", revision), ("cache_dir", cache_dir), ("token", token)) if v is not None}
    try:
        return Path(snapshot_download(text, allow_patterns=SNAPSHOT_PATTERNS, local_files_only=True, **hub))
    except Exception:                   # noqa: BLE001 - not cached (or not fully): try the hub
        pass
    if constants.HF_HUB_OFFLINE:
        raise ValueError(f"model = {text!r} is not a directory and not in the Hugging Face cache "
                         f"({cache_dir or constants.HF_HUB_CACHE}); HF_HUB_OFFLINE is set, so it is not downloaded")
    try:
        return Path(snapshot_download(text, allow_patterns=SNAPSHOT_PATTERNS, **hub))
    except Exception as e:              # noqa: BLE001 - every failure is the same answer to the caller
        raise ValueError(f"model = {text!r} is not a directory, not in the Hugging Face cache "
                         f"({constants.HF_HUB_CACHE}), and could not be downloaded: {type(e).__name__}: {e}") from None
