"""Backend choice under auto: per op and phase from backend_choice.json, else triton, else cuda."""

from __future__ import annotations

import json

import pytest
import torch

from qwen_ops.ops import backend as B


def test_packaged_choice_file_parses():
    assert isinstance(B.measured_choices(), dict)
    data = json.loads(B.BACKEND_CHOICE_FILE.read_text())
    assert set(data.get("choices", {}).values()) <= {"triton", "cuda"}


def test_auto_follows_measured_choice_per_op_and_phase(tmp_path, monkeypatch):
    choice = tmp_path / "backend_choice.json"
    choice.write_text(json.dumps({"choices": {"slot_attention/decode": "cuda", "kv_write": "triton"}}))
    read = B.measured_choices.__wrapped__           # uncached: this test's file, not the packaged one
    monkeypatch.setattr(B, "measured_choices", lambda: read(choice))
    monkeypatch.setattr(B, "why_unavailable", lambda name, device: None)     # pretend both GPU backends exist
    cuda = torch.device("cuda")
    with B.use_backend("auto"):
        assert B.resolve_backend(cuda, "slot_attention", "decode") == "cuda"
        assert B.resolve_backend(cuda, "slot_attention", "prefill") == "triton"   # no entry: triton first
        assert B.resolve_backend(cuda, "kv_write") == "triton"
        assert B.resolve_backend(torch.device("cpu"), "kv_write") == "cpu"            # native CPU kernels
        assert B.resolve_backend(torch.device("cpu"), "slot_attention", "decode") == "cpu"
        assert B.resolve_backend(torch.device("cpu"), "gated_delta_rule") == "reference"  # none native
    # A measured choice that is unavailable falls back quietly.
    monkeypatch.setattr(B, "why_unavailable", lambda name, device: "not built" if name == "cuda" else None)
    with B.use_backend("auto"):
        assert B.resolve_backend(cuda, "slot_attention", "decode") == "triton"
    with B.use_backend("cuda"), pytest.raises(RuntimeError, match="backend 'cuda' is unavailable: not built"):
        B.resolve_backend(cuda, "kv_write")
    # Without the native CPU kernels (no C compiler), auto keeps the reference on the CPU.
    monkeypatch.setattr(B, "why_unavailable", lambda name, device: "no C compiler" if name == "cpu" else None)
    with B.use_backend("auto"):
        assert B.resolve_backend(torch.device("cpu"), "slot_attention", "decode") == "reference"
