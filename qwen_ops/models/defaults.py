"""Where the embedded default model lives inside the installed package."""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """The small Qwen3 checkpoint shipped in ``qwen_ops/default_model`` (Hugging Face layout)."""
    return Path(__file__).resolve().parent.parent / "default_model"
