"""The cpu backend's build and load path (its kernels are compared with the reference, like every
backend's, in test_ops.py), and what happens without a C compiler."""

from __future__ import annotations

import pytest
import torch

import qwen_ops
from qwen_ops.ops import backend as B
from qwen_ops.ops.kernels import cpu, reference

from test_ops import Seq, make_attention_case  # noqa: E402  (tests/ is on sys.path under pytest)


def _needs_cpu_kernels():
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """cpu.library() uncached, building into an empty cache directory."""
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_builds_once_into_the_cache_dir_and_reuses_it(fresh_library, monkeypatch, caplog):
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    with caplog.at_level("WARNING", logger=cpu.__name__):
        lib = cpu.library.__wrapped__()
    # The first-use build says what it is doing (it takes seconds), and then that it is done.
    said = [r.getMessage() for r in caplog.records if r.name == cpu.__name__]
    assert len(said) == 2 and "compiling the CPU kernels" in said[0] and str(fresh_library) in said[0]
    assert said[1].startswith("qwen_ops: CPU kernels compiled in ")
    caplog.clear()
    built = list(fresh_library.glob("qwen_cpu_*.so"))
    assert len(built) == 1 and hasattr(lib, "qwen_slot_attention")
    monkeypatch.setattr(cpu, "_build", lambda cc, cxx, out: pytest.fail("rebuilt although the cache holds the library"))
    cpu.library.__wrapped__()
    assert not caplog.records                       # a cached library loads silently
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


def test_without_a_cxx_compiler_the_backend_is_unavailable(fresh_library, monkeypatch):
    """One build: the C kernels and the fast ops' C++ kernels together, so no C++ compiler (or no
    torch headers) means no CPU library at all, said plainly."""
    monkeypatch.setattr(cpu, "_cxx_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found"):
        cpu.library.__wrapped__()
    assert not fresh_library.exists() or not any(fresh_library.iterdir())


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
    _needs_cpu_kernels()
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
    _needs_cpu_kernels()
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


def test_long_prefills_run_the_c_kernel_except_fp16(monkeypatch):
    """fp32 and bf16 prompts of any length run the C kernel (its flash path); fp16, which has no flash
    path, goes to the reference (SDPA) above FP16_REFERENCE_ABOVE_QUERY_LEN query rows."""
    _needs_cpu_kernels()
    calls = []
    monkeypatch.setattr(cpu, "slot_attention_reference", lambda *a: calls.append(a[8]) or reference.slot_attention_reference(*a))
    for dtype in (torch.float32, torch.bfloat16):
        case = make_attention_case((Seq(0, 3, 120),), dtype=dtype, device="cpu", block_size=16)
        out = cpu.slot_attention_cpu(*case.args())
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out, reference.slot_attention_reference(*case.args()), rtol=tol, atol=tol)
    assert calls == []
    case = make_attention_case((Seq(0, 3, 120),), dtype=torch.float16, device="cpu", block_size=16)
    cpu.slot_attention_cpu(*case.args())
    assert calls == [120] and 120 > cpu.FP16_REFERENCE_ABOVE_QUERY_LEN


def test_flash_path_without_tiles_matches_the_reference(tmp_path, monkeypatch):
    """bf16 long prompts on a CPU without AMX (or with the tiles turned off): the flash path's fp32
    products on the bf16 caches as stored (a fresh load of the library, which reads the setting anew)."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    from qwen_tiny import fresh_library

    lib = fresh_library(tmp_path, monkeypatch, QWEN_OPS_BF16_PRODUCTS="widening")
    assert lib.qwen_bf16_products() == 0
    monkeypatch.setattr(cpu, "library", lambda: lib)
    for seqs, group in (((Seq(0, 0, 130),), 2), ((Seq(1, 70, 67), Seq(0, 5, 1), Seq(2, 0, 16)), 8)):
        case = make_attention_case(seqs, dtype=torch.bfloat16, device="cpu", group=group, block_size=16, seed=3)
        got = cpu.slot_attention_cpu(*case.args())
        torch.testing.assert_close(got, reference.slot_attention_reference(*case.args()), rtol=1.6e-2, atol=3e-2)


# --------------------------------------------------------------------------------------------
# The packed product under linear_packed, and sampling's argmax (the fast ops: test_ops_fused.py)
# --------------------------------------------------------------------------------------------

def test_portable_build_without_avx512_matches_the_reference(portable_library, monkeypatch):
    """The C file has AVX-512 paths for fp32; a build without AVX-512 runs the portable loops."""
    monkeypatch.setattr(cpu, "library", lambda: portable_library)
    # a long prompt too: without AVX-512 there is no flash path, its rows take the row-by-row loop
    for scenario, dtype in (("decode", torch.float32), ("mixed", torch.float32), ("chunk", torch.bfloat16),
                            ((Seq(0, 7, 70),), torch.float32)):
        case = make_attention_case(scenario, dtype=dtype, device="cpu", group=4, head_dim=64)
        got = cpu.slot_attention_cpu(*case.args())
        want = reference.slot_attention_reference(*case.args())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_argmax_rows_matches_torch_argmax_with_ties_nan_and_inf():
    _needs_cpu_kernels()
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, 1000, generator=gen)
    x[1, 10] = x[1, 700] = x[1].max() + 1              # a tie: the first index wins
    x[2, 5] = x[2, 300] = float("nan")                  # NaN wins, the first one
    x[3] = float("-inf")
    x[4, 999] = float("inf")
    x[5] = 0.0                                          # all equal
    wide = torch.randn(9, 1024, generator=gen)
    wide[:, :1000] = x
    for t in (x, wide[:, :1000]):                       # contiguous and strided rows
        assert torch.equal(cpu.argmax_rows(t), t.argmax(dim=-1))


def test_greedy_sampling_uses_the_c_argmax(monkeypatch):
    _needs_cpu_kernels()
    from qwen_ops.engine import sampling
    from qwen_ops.ops import host        # the engine's way to the C kernels

    calls = []
    native = host.argmax_rows
    monkeypatch.setattr(host, "argmax_rows", lambda t: calls.append(1) or native(t))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    got = sampling.sample(logits, [sampling.GREEDY] * 4, [None] * 4, [0] * 4)
    assert calls == [1] and torch.equal(got, logits.argmax(-1))
    # Sampling does not follow the op backend choice (that is per op call, for the ops only).
    with qwen_ops.use_backend("reference"):
        assert torch.equal(sampling.sample(logits, [sampling.GREEDY] * 4, [None] * 4, [0] * 4), logits.argmax(-1))
    assert calls == [1, 1]
    monkeypatch.setattr(host, "why_unavailable", lambda: "no C compiler")      # without the library: torch
    assert torch.equal(sampling.sample(logits, [sampling.GREEDY] * 4, [None] * 4, [0] * 4), logits.argmax(-1))
    assert calls == [1, 1]


@pytest.mark.parametrize("rows", [1, 2, 5, 11, 12, 13, 40])
@pytest.mark.parametrize("shape", [(64, 256), (13, 40), (70, 7)], ids=["n64-k256", "n13-k40", "n70-k7"])
def test_linear_packed_matches_f_linear(rows, shape, poisoned_empty):
    """Row counts around the 12-row blocks, output counts off the 32-feature panels (masked
    stores), odd inner dims, strided input rows, with and without a bias."""
    _needs_cpu_kernels()
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(15 + rows)
    n, k = shape
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 5, generator=gen)[:, :k]
    packed = cpu.pack_panels(weight)
    got = [cpu.linear_packed(x, packed, None, n), cpu.linear_packed(x, packed, bias, n)]
    poisoned_empty.undo()
    assert packed.shape == ((n + 31) // 32, k, 32)
    torch.testing.assert_close(got[0], F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 12, 13, 40])
@pytest.mark.parametrize("shape", [(160, 256), (13, 40), (70, 7)], ids=["n160-k256", "n13-k40", "n70-k7"])
def test_linear_packed_bf16_weights(rows, shape, poisoned_empty):
    """bf16 weights (packed in k pairs; odd K leaves a pair half empty) against F.linear of the same
    values in fp32: both accumulate exact products in fp32, so fp32 tolerances hold. The inputs
    hold bf16 values, as a bf16 model's activations do (the AVX512-BF16 path reads them as bf16)."""
    _needs_cpu_kernels()
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(25 + rows)
    n, k = shape
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 5, generator=gen).to(torch.bfloat16).float()[:, :k]
    packed = cpu.pack_panels(weight)
    got = [cpu.linear_packed(x, packed, None, n), cpu.linear_packed(x, packed, bias, n)]
    poisoned_empty.undo()
    assert packed.dtype == torch.bfloat16 and packed.shape == ((n + 31) // 32, (k + 1) // 2, 32, 2)
    torch.testing.assert_close(got[0], F.linear(x, weight.float()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], F.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_packed_rows_do_not_depend_on_the_batch(dtype):
    """A row's result is bit-identical whatever the rows around it (one row, the two-panel blocks
    of up to 4 rows, the one-panel blocks up to 12, the 6-row two-panel blocks above and their
    tails) and however many threads share the panels: a request's tokens do not depend on which
    others share its step, nor on torch.set_num_threads."""
    _needs_cpu_kernels()
    gen = torch.Generator().manual_seed(3)
    n, k = 200, 300
    packed = cpu.pack_panels(torch.randn(n, k, generator=gen).to(dtype))
    bias = torch.randn(n, generator=gen)
    x = torch.randn(30, k, generator=gen).to(dtype).float()
    alone = torch.cat([cpu.linear_packed(x[i:i + 1], packed, bias, n) for i in range(30)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for rows in (1, 2, 3, 4, 5, 12, 13, 19, 30):
                got = cpu.linear_packed(x[:rows], packed, bias, n)
                assert torch.equal(got, alone[:rows]), f"{rows} rows, {t} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k", [1024, 544, 600], ids=["k1024-parts", "k544-part-tail", "k600-whole"])
@pytest.mark.parametrize("n", [2048, 100], ids=["n2048-streamed", "n100-tail"])
def test_linear_packed_bf16_prefill_sizes(n, k, poisoned_empty):
    """bf16 products at a prefill's row counts, where the AMX kernel runs long panels in parts and
    streams large outputs past the cache: against F.linear in float64 of the same bf16 values (rounded
    once to bf16: almost every element bit-equal, none further than one bf16 step), and every row
    bit-identical to the same row computed alone (the one-row kernel: no dependence on the batch).
    k = 1024 runs four whole parts, 544 two and a short one, 600 (pairs not a multiple of 16) whole
    panels; n = 100 ends on a partial panel, and its output is too small to stream."""
    _needs_cpu_kernels()
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(41)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(300, k, generator=gen).to(torch.bfloat16)
    packed = cpu.pack_panels(weight)
    with qwen_ops.use_backend("cpu"):    # bf16 rows in, bf16 out (the op's C++ kernel)
        got = torch.ops.qwen.linear_packed(x, packed, bias, n)
        alone = torch.cat([torch.ops.qwen.linear_packed(x[i:i + 1], packed, bias, n) for i in (0, 17, 299)])
    got_f32 = cpu.linear_packed(x.float(), packed, bias, n)    # fp32 rows holding bf16 values: fp32 out
    poisoned_empty.undo()
    exact = F.linear(x.double(), weight.double(), bias.double())
    want = exact.float().to(torch.bfloat16)
    same = got.view(torch.int16) == want.view(torch.int16)
    assert same.double().mean().item() >= 0.99, f"{same.double().mean().item():.4f} of elements bit-equal"
    # one bf16 step, plus fp32 accumulation's error where the sum cancels (a bound from the terms' sizes)
    terms = F.linear(x.double().abs(), weight.double().abs(), bias.double().abs())
    off = (got.double() - want.double()).abs()[~same]
    step = torch.maximum(got.double().abs(), want.double().abs())[~same] * 2.0 ** -7 + 1e-5 * terms[~same]
    assert bool((off <= step).all()), "an element more than one bf16 step from the float64 product"
    torch.testing.assert_close(got_f32.double(), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(alone, got[[0, 17, 299]]), "a row differs from the same row computed alone"
