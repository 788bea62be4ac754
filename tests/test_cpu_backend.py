"""The cpu backend's build and load path (its kernels are compared with the reference, like every
backend's, in test_ops.py), and what happens without a C compiler."""

from __future__ import annotations

import pytest
import torch

import qwen_ops
from qwen_ops import backend as B
from qwen_ops.kernels import cpu, reference

from test_ops import make_attention_case  # noqa: E402  (tests/ is on sys.path under pytest)


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """cpu.library() uncached, building into an empty cache directory."""
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_builds_once_into_the_cache_dir_and_reuses_it(fresh_library, monkeypatch):
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    lib = cpu.library.__wrapped__()
    built = list(fresh_library.glob("qwen_cpu_*.so"))
    assert len(built) == 1 and hasattr(lib, "qwen_slot_attention")
    monkeypatch.setattr(cpu, "_build", lambda cc, out: pytest.fail("rebuilt although the cache holds the library"))
    cpu.library.__wrapped__()
    assert list(fresh_library.glob("qwen_cpu_*.so")) == built
    assert not list(fresh_library.glob("*.so.tmp*")) and len(list(fresh_library.iterdir())) == 1  # no leftovers


def test_without_a_compiler_the_backend_is_unavailable_and_auto_keeps_the_reference(fresh_library, monkeypatch):
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler found"):
        cpu.library.__wrapped__()
    monkeypatch.setattr(B, "why_unavailable",
                        lambda name, device: "no C compiler found" if name == "cpu" else None)
    with B.use_backend("auto"):
        assert B.resolve_backend(torch.device("cpu"), "slot_attention", "decode") == "reference"


def test_compile_errors_are_reported(fresh_library, monkeypatch, tmp_path):
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    monkeypatch.setattr(cpu, "SOURCE", bad)
    with pytest.raises(RuntimeError, match="compiling the qwen_ops CPU kernels failed"):
        cpu.library.__wrapped__()
    assert not list(fresh_library.glob("*.so*")), "a failed build left a file behind"


def test_auto_runs_the_native_kernels_on_cpu_tensors(monkeypatch):
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    calls = []
    native = cpu.slot_attention_cpu
    monkeypatch.setattr(cpu, "slot_attention_cpu", lambda *a: calls.append(1) or native(*a))
    case = make_attention_case("decode", dtype=torch.float32, device="cpu")
    with qwen_ops.use_backend("auto"):
        out = torch.ops.qwen.slot_attention(*case.args())
    assert calls == [1]
    torch.testing.assert_close(out, reference.slot_attention_reference(*case.args()), rtol=1e-5, atol=1e-5)


def test_long_contexts_match_the_reference(monkeypatch):
    """Contexts spanning many blocks (the kernels prefetch the next block) and a long softmax."""
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    gen = torch.Generator().manual_seed(7)
    num_seqs, block_size, blocks_per_slot, kv_heads, heads, head_dim = 3, 16, 40, 2, 8, 32
    num_blocks = num_seqs * blocks_per_slot + 5
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks_per_slot].view(num_seqs, -1).to(torch.int32)
    seq_lens = torch.tensor([640, 17, 333], dtype=torch.int32)
    q_lens = [1, 17, 5]                                   # decode, a whole prompt, a chunk
    qsl = torch.tensor([0, 1, 18, 23], dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, head_dim, generator=gen) * 3   # peaked softmax
    args = (query, key_cache, value_cache, table, torch.tensor([2, 0, 1], dtype=torch.int32), qsl, seq_lens,
            head_dim ** -0.5, max(q_lens))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))  # poisoned output
    out = cpu.slot_attention_cpu(*args)
    monkeypatch.undo()
    torch.testing.assert_close(out, reference.slot_attention_reference(*args), rtol=1e-5, atol=1e-5)


def test_long_prefills_go_to_the_reference(monkeypatch):
    """Above REFERENCE_ABOVE_QUERY_LEN query rows, SDPA (the reference) is the faster kernel."""
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")
    calls = []
    monkeypatch.setattr(cpu, "slot_attention_reference", lambda *a: calls.append(a[8]) or reference.slot_attention_reference(*a))
    case = make_attention_case("chunk", dtype=torch.float32, device="cpu")
    args = case.args()
    cpu.slot_attention_cpu(*args)
    assert calls == []                                     # short queries: the C kernel
    long_args = args[:8] + (cpu.REFERENCE_ABOVE_QUERY_LEN + 1,) + args[9:]
    out = cpu.slot_attention_cpu(*long_args)
    assert calls == [cpu.REFERENCE_ABOVE_QUERY_LEN + 1]
    torch.testing.assert_close(out, reference.slot_attention_reference(*args), rtol=1e-5, atol=1e-5)
