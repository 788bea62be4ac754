"""The cpu backend's build and load path (its kernels are compared with the reference, like every
backend's, in test_ops.py), and what happens without a C compiler."""

from __future__ import annotations

import pytest
import torch

import qwen_ops
from qwen_ops.ops import backend as B
from qwen_ops.ops.kernels import cpu, reference

from test_ops import make_attention_case  # noqa: E402  (tests/ is on sys.path under pytest)


def _needs_cpu_kernels():
    if cpu.why_unavailable() is not None:
        pytest.skip(f"cpu backend unavailable: {cpu.why_unavailable()}")


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


def test_long_prefills_go_to_the_reference(monkeypatch):
    """Above REFERENCE_ABOVE_QUERY_LEN query rows, SDPA (the reference) is the faster kernel."""
    _needs_cpu_kernels()
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


# --------------------------------------------------------------------------------------------
# The fused norm / RoPE kernels of the dense model's eager CPU forward
# --------------------------------------------------------------------------------------------

@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled tensors, so an output element the kernel skips shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    return monkeypatch


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_the_torch_norm(residual, poisoned_empty):
    _needs_cpu_kernels()
    from qwen_ops.models.dense import RMSNorm

    gen = torch.Generator().manual_seed(11)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=gen))
    wide = torch.randn(7, 128, generator=gen) * 3
    x = wide[:, :96]                                        # rows strided, as a view
    add = torch.randn(7, 96, generator=gen) if residual else None
    out, total = cpu.rms_norm(x, norm.weight.detach(), norm.eps, add=add)
    poisoned_empty.undo()
    with torch.no_grad():
        s = x + add if residual else x
        torch.testing.assert_close(out, norm(s), rtol=2e-6, atol=2e-6)
        if residual:
            assert torch.equal(total, s)
        else:
            assert total is None


@pytest.mark.parametrize("norms", [True, False], ids=["qwen3-qk-norm", "qwen2-no-norm"])
def test_qk_norm_rope_matches_the_torch_code(norms, poisoned_empty):
    _needs_cpu_kernels()
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.dense import RMSNorm, apply_rope, rope_table

    gen = torch.Generator().manual_seed(12)
    T, nq, nk, D = 5, 6, 2, 32
    config = QwenConfig.from_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64,
                                   "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": nq,
                                   "num_key_value_heads": nk, "head_dim": D, "max_position_embeddings": 300,
                                   "rope_theta": 10000.0})
    table = rope_table(config, torch.device("cpu"))
    qkv = torch.randn(T, (nq + 2 * nk) * D, generator=gen)          # q and k as views of one projection
    q = qkv[:, :nq * D].view(T, nq, D)
    k = qkv[:, nq * D:(nq + nk) * D].view(T, nk, D)
    positions = torch.tensor([0, 3, 299, 17, 128], dtype=torch.int32)
    q_norm, k_norm = RMSNorm(D, 1e-6), RMSNorm(D, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        k_norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
    qo, ko = cpu.qk_norm_rope(q, k, q_norm.weight.detach() if norms else None,
                              k_norm.weight.detach() if norms else None, 1e-6, table, positions)
    poisoned_empty.undo()
    with torch.no_grad():
        rows = table[positions.long()]
        cos, sin = rows[:, None, :D // 2], rows[:, None, D // 2:]
        qr, kr = (q_norm(q), k_norm(k)) if norms else (q, k)
        torch.testing.assert_close(qo, apply_rope(qr, cos, sin), rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(ko, apply_rope(kr, cos, sin), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_fused_model_forward_matches_the_torch_forward(model_type, tmp_path, monkeypatch):
    """A prefill and a decode step walking the modules (as for a model the one-call forward does not
    cover): fused kernels (auto on CPU) vs the pure-torch forward (reference)."""
    _needs_cpu_kernels()
    from qwen_ops.models.loader import load_checkpoint
    from qwen_ops.models import dense as model_mod
    from qwen_tiny import new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata

    path = save_tiny_checkpoint(tmp_path / model_type, model_type, vocab_size=96, hidden_size=64,
                                intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=128, **(
                                    {"head_dim": 16} if model_type == "qwen3" else {}))
    model = load_checkpoint(path).model
    monkeypatch.setattr(model_mod.QwenForCausalLM, "_native_plan", lambda self: None)   # walk the modules
    calls = []
    fused = model_mod.cpu_kernels.rms_norm
    monkeypatch.setattr(model_mod.cpu_kernels, "rms_norm", lambda *a, **k: calls.append(1) or fused(*a, **k))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    table = shuffled_block_table(2, 4)
    logits = {}
    for backend in ("auto", "reference"):
        caches = new_kv_caches(model.config, table.numel() + 1, 4, torch.float32)
        with qwen_ops.use_backend(backend), torch.inference_mode():
            pos, attn, last = step_metadata([(0, 0, 9), (1, 0, 7)], table)
            first = model(torch.cat([ids[0], ids[1, :7]]), pos, attn, caches, last)
            pos, attn, last = step_metadata([(0, 9, 1), (1, 7, 1)], table)
            second = model(first.argmax(-1), pos, attn, caches, last)
        logits[backend] = (first, second)
        if backend == "auto":
            assert calls, "the fused kernels were not used"
            calls.clear()
    assert not calls, "the reference backend must keep the torch forward"
    for got, want in zip(logits["auto"], logits["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path_taken", ["one-call", "module-walk"])
def test_fused_forward_rejects_positions_outside_the_rope_table(path_taken, tmp_path, monkeypatch):
    """The C code reads the RoPE table by position: both eager CPU paths refuse positions past it."""
    _needs_cpu_kernels()
    from qwen_ops.models import dense as model_mod
    from qwen_ops.models.loader import load_checkpoint
    from qwen_tiny import new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata

    path = save_tiny_checkpoint(tmp_path / "q3", "qwen3", vocab_size=64, hidden_size=32, intermediate_size=32,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                max_position_embeddings=16)
    model = load_checkpoint(path).model
    table = shuffled_block_table(1, 8)
    caches = new_kv_caches(model.config, table.numel() + 1, 4, torch.float32)
    pos, attn, last = step_metadata([(0, 16, 1)], table)       # position 16 of a 16-entry table
    if path_taken == "module-walk":
        monkeypatch.setattr(model_mod.QwenForCausalLM, "_native_plan", lambda self: None)
    calls = _count_native_calls(monkeypatch)
    with torch.inference_mode(), pytest.raises(ValueError, match="max_position_embeddings = 16"):
        model(torch.tensor([3]), pos, attn, caches, last)
    assert len(calls) == (1 if path_taken == "one-call" else 0)


def test_portable_build_without_avx512_matches_the_reference(tmp_path, monkeypatch):
    """The C file has AVX-512 paths for fp32; a build without AVX-512 runs the portable loops."""
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("QWEN_OPS_CPU_CFLAGS", "-mno-avx512f")
    portable = cpu.library.__wrapped__()
    monkeypatch.setattr(cpu, "library", lambda: portable)
    for scenario, dtype in (("decode", torch.float32), ("mixed", torch.float32), ("chunk", torch.bfloat16)):
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

    calls = []
    native = cpu.argmax_rows
    monkeypatch.setattr(cpu, "argmax_rows", lambda t: calls.append(1) or native(t))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    got = sampling.sample(logits, [sampling.GREEDY] * 4, [None] * 4)
    assert calls == [1] and torch.equal(got, logits.argmax(-1))
    with qwen_ops.use_backend("reference"):
        assert torch.equal(sampling.sample(logits, [sampling.GREEDY] * 4, [None] * 4), logits.argmax(-1))
    assert calls == [1]


def test_silu_mul_matches_torch(poisoned_empty):
    _needs_cpu_kernels()
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(14)
    gate = torch.randn(33, 200, generator=gen) * 6
    gate[0, :6] = torch.tensor([-100.0, -87.5, 0.0, 50.0, 88.0, 100.0])   # the exp's clamps
    up = torch.randn(33, 256, generator=gen)[:, :200]                       # strided rows
    got = cpu.silu_mul(gate, up)
    poisoned_empty.undo()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------
# The small-batch native path: qwen_linear_rows and the whole dense forward in one C call
# --------------------------------------------------------------------------------------------

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


def _tiny_dense(tmp_path, model_type: str, **overrides):
    from qwen_ops.models.loader import load_checkpoint
    from qwen_tiny import save_tiny_checkpoint

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return load_checkpoint(save_tiny_checkpoint(tmp_path / model_type, model_type, **kwargs)).model


def _count_native_calls(monkeypatch) -> list:
    from qwen_ops.models import dense as model_mod

    calls = []
    native = model_mod.cpu_kernels.dense_forward
    monkeypatch.setattr(model_mod.cpu_kernels, "dense_forward", lambda *a, **k: calls.append(1) or native(*a, **k))
    return calls


def _run_steps(model, steps, table, block_size=4):
    """The logits of each step and the caches after them (a fresh cache, NaN in unwritten rows
    would show through attention, so the caches start random instead)."""
    from qwen_tiny import new_kv_caches, step_metadata

    gen = torch.Generator().manual_seed(21)
    caches = new_kv_caches(model.config, table.numel() + 1, block_size, torch.float32)
    for kc, vc in caches:
        kc.copy_(torch.randn(kc.shape, generator=gen))
        vc.copy_(torch.randn(vc.shape, generator=gen))
    outs = []
    with torch.inference_mode():
        for chunks in steps:
            pos, attn, last = step_metadata(chunks, table)
            ids = torch.randint(0, model.config.vocab_size, (int(pos.shape[0]),), generator=gen)
            outs.append(model(ids, pos, attn, caches, last))
    return outs, caches


def _assert_same_steps(got, got_caches, want, want_caches) -> None:
    """Logits of every step and the final caches of two ``_run_steps`` runs agree to fp32 rounding."""
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


# (slot, start position, tokens) per sequence, per step: a 9-token prefill of one slot and 14 of
# another, decodes of both, a decode next to a 3-token chunk, and a step with a padding sequence
# (slot -1): 23, 2, 4 and 2 tokens, over the 12-row blocks of the packed products.
NATIVE_STEPS = [[(0, 0, 9), (2, 0, 14)], [(0, 9, 1), (2, 14, 1)], [(2, 15, 1), (0, 10, 3)], [(0, 13, 1), (-1, 0, 1)]]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_native_forward_matches_the_torch_forward(model_type, tmp_path, monkeypatch):
    """Logits and cache contents of the one-call C forward vs the pure-torch forward (reference
    backend), over prefills, decodes, a chunk mixed with a decode and padding; Qwen2 has q/k/v
    biases and no q/k norms, Qwen3 the reverse."""
    _needs_cpu_kernels()
    from qwen_tiny import shuffled_block_table

    model = _tiny_dense(tmp_path, model_type)
    calls = _count_native_calls(monkeypatch)
    table = shuffled_block_table(3, 5)
    got, got_caches = _run_steps(model, NATIVE_STEPS, table)
    assert len(calls) == len(NATIVE_STEPS), "every step should take the one-call forward"
    with qwen_ops.use_backend("reference"):
        want, want_caches = _run_steps(model, NATIVE_STEPS, table)
    assert len(calls) == len(NATIVE_STEPS)
    _assert_same_steps(got, got_caches, want, want_caches)


def test_native_forward_portable_build_matches(tmp_path, monkeypatch):
    if cpu._compiler() is None:
        pytest.skip("no C compiler here")
    from qwen_tiny import shuffled_block_table

    model = _tiny_dense(tmp_path, "qwen3", hidden_size=40, intermediate_size=56, head_dim=16)  # off the vectors
    table = shuffled_block_table(3, 5)
    with qwen_ops.use_backend("reference"):
        want, _ = _run_steps(model, NATIVE_STEPS, table)
    monkeypatch.setenv("QWEN_OPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("QWEN_OPS_CPU_CFLAGS", "-mno-avx512f")
    portable = cpu.library.__wrapped__()
    monkeypatch.setattr(cpu, "library", lambda: portable)
    calls = _count_native_calls(monkeypatch)
    got, _ = _run_steps(model, NATIVE_STEPS, table)
    assert len(calls) == len(NATIVE_STEPS)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_native_forward_falls_back_for_models_it_does_not_cover(tmp_path, monkeypatch):
    """A replaced module or a non-contiguous weight takes the torch path, with the same results;
    so does a sequence chunk of more than REFERENCE_ABOVE_QUERY_LEN query rows."""
    _needs_cpu_kernels()
    from qwen_tiny import shuffled_block_table

    model = _tiny_dense(tmp_path, "qwen3")
    table = shuffled_block_table(3, 5)
    calls = _count_native_calls(monkeypatch)
    want, _ = _run_steps(model, NATIVE_STEPS[:2], table)
    assert len(calls) == 2
    with torch.no_grad():
        w = model.model.layers[1].mlp.up_proj.weight
        model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(w.t().contiguous().t())  # same values, strided
    got, _ = _run_steps(model, NATIVE_STEPS[:2], table)
    assert len(calls) == 2, "a strided weight must take the torch path"
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-5)
    long_table = shuffled_block_table(1, 26)
    _run_steps(model, [[(0, 0, cpu.REFERENCE_ABOVE_QUERY_LEN + 1)]], long_table)
    assert len(calls) == 2, "a long prefill chunk takes the torch path (SDPA)"


@pytest.mark.parametrize("tokens", [1, 9])
def test_native_paths_check_metadata_before_writing(tokens, tmp_path):
    """Bad slot ids, block ids or row indices raise the ops' errors, and the caches stay as they
    were, for 2 and 18 tokens."""
    _needs_cpu_kernels()
    import dataclasses

    from qwen_tiny import new_kv_caches, shuffled_block_table, step_metadata

    model = _tiny_dense(tmp_path, "qwen3")
    table = shuffled_block_table(2, 8)
    caches = new_kv_caches(model.config, table.numel() + 1, 4, torch.float32)
    for kc, vc in caches:
        kc.normal_()
        vc.normal_()
    before = [(kc.clone(), vc.clone()) for kc, vc in caches]
    pos, attn, last = step_metadata([(0, 3, tokens), (1, 5, tokens)], table)
    ids = torch.arange(2 * tokens) + 5
    bad_slot_ids = attn.slot_ids.clone()
    bad_slot_ids[-1] = 2
    cases = [
        (dataclasses.replace(attn, slot_ids=bad_slot_ids), last, ValueError, "slot_ids"),
        (dataclasses.replace(attn, block_table=table.clone().fill_(999)), last, ValueError, "block_table"),
        (attn, torch.tensor([0, 2 * tokens]), IndexError, "index"),
    ]
    for bad_attn, rows, exc, name in cases:
        with torch.inference_mode(), pytest.raises(exc, match=name):
            model(ids, pos, bad_attn, caches, rows)
        for (kc, vc), (kb, vb) in zip(caches, before):
            assert torch.equal(kc, kb) and torch.equal(vc, vb), f"caches changed by the call with bad {name}"


def test_attention_blocks_match_the_ops_path(tmp_path, monkeypatch):
    """Walking the modules (a model the one-call forward does not cover), each layer's attention
    runs as one C call (norms, RoPE, kv write, attention); the same model with the cpu ops called
    one by one gives the same logits and caches."""
    _needs_cpu_kernels()
    from qwen_ops.models import dense as model_mod
    from qwen_tiny import shuffled_block_table

    model = _tiny_dense(tmp_path, "qwen2")        # q/k/v biases, no q/k norms
    steps = [[(0, 0, 9), (2, 0, 8)], [(0, 9, 12), (2, 8, 1), (1, 0, 5)]]
    table = shuffled_block_table(3, 8)
    monkeypatch.setattr(model_mod.QwenForCausalLM, "_native_plan", lambda self: None)   # walk the modules
    calls = []
    block = model_mod.cpu_kernels.attention_block
    monkeypatch.setattr(model_mod.cpu_kernels, "attention_block", lambda *a, **k: calls.append(1) or block(*a, **k))
    got, got_caches = _run_steps(model, steps, table)
    assert len(calls) == 2 * model.config.num_hidden_layers
    monkeypatch.setattr(model_mod.QwenForCausalLM, "_native_caches", lambda self, kv: False)
    want, want_caches = _run_steps(model, steps, table)
    assert len(calls) == 2 * model.config.num_hidden_layers
    _assert_same_steps(got, got_caches, want, want_caches)


def test_native_plan_follows_weight_writes_replacements_and_copies(tmp_path, monkeypatch):
    """The one-call forward caches its weight addresses: in-place writes are seen (same storage),
    a moved storage (``param.data = ...``) or a deep copy (new storages) gets a new plan."""
    _needs_cpu_kernels()
    import copy

    from qwen_tiny import shuffled_block_table

    model = _tiny_dense(tmp_path, "qwen3")
    table = shuffled_block_table(3, 5)
    steps = NATIVE_STEPS[1:2]      # one 2-token decode step (on random caches)
    calls = _count_native_calls(monkeypatch)

    def check(m):
        got, _ = _run_steps(m, steps, table)
        with qwen_ops.use_backend("reference"):
            want, _ = _run_steps(m, steps, table)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)

    check(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(-3.0)                 # in place
        model.model.layers[1].self_attn.q_proj.weight.data = torch.randn(64, 64)   # new storage
        model.lm_head.weight.data = model.lm_head.weight.data.clone()         # tied weight moved, untied now
    check(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.layers[0].self_attn.o_proj.weight.normal_()                # the copy has its own weights
    check(twin)
    check(model)
    assert len(calls) == 4
    model.float()                                   # _apply: the plan and the packed copies go
    assert "_native_cache" not in model.__dict__ and model.lm_head._panels is None
    check(model)
    assert len(calls) == 5


def test_the_engine_packs_the_weights_at_construction(tmp_path, monkeypatch):
    """The runner builds the one-call forward's plan up front: the first request packs nothing."""
    _needs_cpu_kernels()
    from qwen_ops.engine.engine import QwenEngine
    from qwen_tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "q3", "qwen3", vocab_size=96, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=128)
    eng = QwenEngine.from_pretrained(path, max_slots=2, max_seq_len=64)
    assert eng.model.__dict__["_native_cache"][2] is not None
    packs = []
    pack = cpu.pack_panels
    monkeypatch.setattr(cpu, "pack_panels", lambda w: packs.append(1) or pack(w))
    calls = _count_native_calls(monkeypatch)
    r = eng.prefill([5, 6, 7], slot_id=0)
    eng.decode_step(r.next_token, slot_id=0)
    assert packs == [] and len(calls) == 2


def test_with_more_threads_the_projections_stay_with_torch(tmp_path, monkeypatch):
    """The C code is single-threaded: with 2 intra-op threads neither Linear nor the model takes
    the packed products (torch's threaded ones run), and the logits are the same."""
    _needs_cpu_kernels()
    from qwen_tiny import shuffled_block_table

    model = _tiny_dense(tmp_path, "qwen3")
    table = shuffled_block_table(3, 5)
    calls = _count_native_calls(monkeypatch)
    packed = []
    product = cpu.linear_packed
    monkeypatch.setattr(cpu, "linear_packed", lambda *a: packed.append(1) or product(*a))
    want, _ = _run_steps(model, NATIVE_STEPS[:2], table)
    assert len(calls) == 2
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, _ = _run_steps(model, NATIVE_STEPS[:2], table)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2 and packed == []
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
