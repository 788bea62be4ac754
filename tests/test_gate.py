"""benchmarks/gate.py: per-vendor floors, and the lowest floors for a CPU not measured here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

GATE = Path(__file__).resolve().parent.parent / "benchmarks" / "gate.py"


@pytest.fixture(scope="module")
def gate():
    spec = importlib.util.spec_from_file_location("qwen_ops_gate", GATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_vendor_has_every_floor(gate):
    names = {frozenset(t) for t in gate.THRESHOLDS_BY_VENDOR.values()}
    assert len(names) == 1 and set(gate.THRESHOLDS_WITHOUT_CPU_KERNELS) == set(next(iter(names)))
    assert {"AuthenticAMD", "GenuineIntel"} <= set(gate.THRESHOLDS_BY_VENDOR)


def test_unmeasured_cpu_gets_the_lowest_floor_of_each_ratio(gate):
    low = gate.thresholds_for("SomeOtherVendor")
    amd, intel = gate.thresholds_for("AuthenticAMD"), gate.thresholds_for("GenuineIntel")
    assert low == {k: min(amd[k], intel[k]) for k in amd}
    assert low["generate_vs_transformers"] == intel["generate_vs_transformers"] < amd["generate_vs_transformers"]


def test_floors_stay_above_the_torch_path(gate):
    """A floor below what the engine gets without its fast CPU ops would not catch that regression."""
    for vendor, floors in gate.THRESHOLDS_BY_VENDOR.items():
        for name in ("generate_vs_transformers", "single_vs_transformers", "fast_vs_reference_decode"):
            assert floors[name] > 1.0, (vendor, name)


def test_cpu_vendor_reads_proc_cpuinfo(gate):
    vendor = gate.cpu_vendor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        assert f"vendor_id\t: {vendor}" in cpuinfo.read_text() or vendor == "unknown"
    else:
        assert vendor == "unknown"


def test_realsize_runs_in_the_full_mode_only_and_never_fails_it(gate, monkeypatch):
    """bench_realsize.py (minutes, gigabytes) runs in the full gate, not in CI's --short, and its
    figures have no floor: an error in it is reported, not a gate failure."""
    ratio = {"ratio": 100.0}
    monkeypatch.setattr(gate, "compiled_vs_eager", lambda *a, **k: dict(ratio, op_path_ms=1.0, compiled_ms=0.01,
                                                                         eager_ms=0.01))
    monkeypatch.setattr(gate, "batched_vs_loop", lambda *a, **k: ratio)
    monkeypatch.setattr(gate, "generate_vs_transformers", lambda *a, **k: {"batch": ratio, "single": ratio})
    calls = []
    monkeypatch.setattr(gate, "realsize", lambda: calls.append(1) or {"error": "RuntimeError('stub')"})
    assert gate.main(["--short"]) == 0 and calls == []
    assert gate.main([]) == 0 and calls == [1]
    assert gate.main(["--no-realsize"]) == 0 and calls == [1]


def _stub_measurements(gate, monkeypatch, *, op_path_ms=3.0, fast_ms=1.0, same="32/32", llm=("cpu",),
                       decode_implementations=None):
    implementations = decode_implementations or {"eager": ["cpu"], "compiled": ["cpu"], "op_path": ["native"]}
    decode = {"ratio": 1.0, "eager_ms": fast_ms, "compiled_ms": fast_ms, "compiled_warmup_s": 1.0,
              "op_path_ms": op_path_ms, "implementations": implementations}
    gen = {"ratio": 100.0, "same_tokens": same, "implementations": {"llm": list(llm)}}
    monkeypatch.setattr(gate, "compiled_vs_eager", lambda *a, **k: dict(decode))
    monkeypatch.setattr(gate, "batched_vs_loop", lambda *a, **k: {"ratio": 100.0})
    monkeypatch.setattr(gate, "generate_vs_transformers", lambda *a, **k: {"batch": dict(gen), "single": dict(gen)})
    monkeypatch.setattr(gate, "cpu_vendor", lambda: "GenuineIntel")


def test_main_passes_the_stubbed_good_run(gate, monkeypatch):
    _stub_measurements(gate, monkeypatch)
    assert gate.main(["--short"]) == 0


def test_main_fails_when_the_fast_ops_are_lost(gate, monkeypatch, capsys):
    """The fast ops against the reference op path: a ratio near 1 (the fast path lost) fails."""
    _stub_measurements(gate, monkeypatch, op_path_ms=1.05, fast_ms=1.0)
    assert gate.main(["--short"]) == 1
    assert "fast_vs_reference_decode" in capsys.readouterr().err


def test_main_fails_on_a_token_mismatch(gate, monkeypatch, capsys):
    """A generated sequence that differs from transformers' fails the gate whatever the speed
    (attention broken printed same_tokens=0/32 and exited 0 before)."""
    _stub_measurements(gate, monkeypatch, same="31/32")
    assert gate.main(["--short"]) == 1
    assert "same_tokens=31/32" in capsys.readouterr().err


def test_a_divergence_at_a_near_tie_passes_and_a_real_one_fails(gate, monkeypatch, capsys):
    """31/32 with the one difference at a near tie of transformers' own logits passes; the tie
    finder measures the margin at the first differing step from transformers' logits."""
    import types

    _stub_measurements(gate, monkeypatch, same="31/32")
    real = gate.generate_vs_transformers
    monkeypatch.setattr(gate, "generate_vs_transformers", lambda *a, **k: {
        name: dict(r, near_ties=[2e-5]) for name, r in real(*a, **k).items()})
    assert gate.main(["--short"]) == 0

    def fake_hf(margin):
        def forward(context):
            logits = torch.zeros(1, context.shape[1], 8)
            logits[0, -1, 5], logits[0, -1, 6] = 1.0 + margin, 1.0       # transformers' token 5, ours 6
            return types.SimpleNamespace(logits=logits)
        return forward
    prompts = torch.tensor([[1, 2, 3], [1, 2, 3]])
    ours, ref = [[4, 6, 1], [4, 5, 1]], [[4, 5, 2], [4, 5, 1]]
    assert gate.near_tie_divergences(fake_hf(1e-5), prompts, ours, ref) == [pytest.approx(1e-5, abs=1e-7)]
    assert gate.near_tie_divergences(fake_hf(0.5), prompts, ours, ref) == []   # a real difference: not a tie


def test_main_fails_when_a_timed_engine_ran_another_implementation(gate, monkeypatch, capsys):
    """The timed steps' implementation is asserted: the fast engine on the plain forward fails."""
    from qwen_ops.ops.kernels import cpu

    if cpu.why_unavailable() is not None:
        pytest.skip("without the cpu kernels every engine is plain")
    _stub_measurements(gate, monkeypatch, decode_implementations={"eager": ["native"], "compiled": ["cpu"],
                                                                   "op_path": ["native"]})
    assert gate.main(["--short"]) == 1
    assert "the eager engine's layers ran ['native']" in capsys.readouterr().err
    _stub_measurements(gate, monkeypatch, llm=("cpu", "native"))
    assert gate.main(["--short"]) == 1
