"""Device check: one run on a GPU machine (no network, preinstalled torch) that

1. runs the GPU tests (ops on every backend, the CUDA extension, CUDA-graph decode);
2. measures achieved bandwidth of kv_write and slot_attention decode on every available backend,
   against a measured device-to-device copy;
3. measures fused_moe (the Triton grouped GEMM against the reference) on a Qwen3-30B-A3B-shaped
   layer (128 experts, top 8, hidden 2048, expert intermediate 768, bf16): bandwidth on the
   expert weights a decode batch touches, TFLOP/s at a 512-token prefill;
4. times a Qwen3-0.6B-shaped model with random bf16 weights: per-step decode latency at batch
   1, 8 and 64 (eager, compiled, CUDA graph), end-to-end throughput for 256 requests, and the
   floor (weight bytes / measured copy bandwidth);
5. with 2 GPUs visible, runs LLM(tensor_parallel_size=2) (NCCL, CUDA graphs) against one
   process on a tiny model: same greedy tokens, tok/s of each;
6. writes the table to benchmarks/results/.

Usage on the GPU machine, from the repo root (no network; the preinstalled torch):
    pip install --no-deps --no-build-isolation -e .
    python benchmarks/device_check.py [--skip-tests] [--no-build] [--quick]
It first builds csrc/ in place (QWEN_OPS_BUILD_CUDA=1), so the cuda backend joins the tables.
``--smoke`` runs the measurement code on tiny CPU shapes (to check the script itself).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parent.parent
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (CUDA events on GPUs)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), reps, device)
    return 2 * nbytes / t          # read + write


def op_bandwidth(device: torch.device, smoke: bool, reps: int, copy_bw: float) -> None:
    import qwen_ops
    from qwen_ops.ops.backend import why_unavailable

    if smoke:
        batch, ctx, heads, kv_heads, head_dim, block = 2, 64, 4, 2, 32, 16
    else:
        batch, ctx, heads, kv_heads, head_dim, block = 64, 4096, 32, 8, 128, 16
    dtype = torch.bfloat16
    blocks_per_seq = ctx // block
    num_blocks = batch * blocks_per_seq
    kc = torch.randn(num_blocks, block, kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
    seq_slots = torch.arange(batch, device=device, dtype=torch.int32)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    # kv_write: a prefill-sized write of 64 x 512 tokens.
    n_tok = batch * (8 if smoke else 512)
    k = torch.randn(n_tok, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    slot_ids = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(n_tok // batch)
    positions = torch.arange(n_tok // batch, device=device, dtype=torch.int32).repeat(batch)
    attn_bytes = 2 * kc.numel() * kc.element_size() + 2 * q.numel() * q.element_size()
    write_bytes = 2 * (k.numel() * k.element_size()) * 2      # read k, v and write them
    # Prefill: 8 sequences of 512 new tokens over 4096 tokens of context (chunked prefill).
    p_seqs, p_len = (2, 8) if smoke else (8, 512)
    pq = torch.randn(p_seqs * p_len, heads, head_dim, device=device, dtype=dtype)
    p_qsl = torch.arange(0, p_seqs * p_len + 1, p_len, device=device, dtype=torch.int32)
    say(f"| op | backend | shape | time (us) | GB/s | % of copy |")
    say(f"|---|---|---|---|---|---|")
    times: dict[str, dict[str, float]] = {}
    for backend in ("reference", "triton", "cuda"):
        if why_unavailable(backend, device) is not None:
            say(f"| all | {backend} | - | - | - | unavailable: {why_unavailable(backend, device)} |")
            continue
        with qwen_ops.use_backend(backend):
            t_attn = timed(lambda: torch.ops.qwen.slot_attention(q, kc, vc, bt, seq_slots, qsl, seq_lens,
                                                                 head_dim ** -0.5, 1), reps, device)
            t_pre = timed(lambda: torch.ops.qwen.slot_attention(pq, kc, vc, bt, seq_slots[:p_seqs], p_qsl,
                                                                seq_lens[:p_seqs], head_dim ** -0.5, p_len),
                          reps, device)
            t_write = timed(lambda: torch.ops.qwen.kv_write(k, v, kc, vc, slot_ids, positions, bt), reps, device)
        times[backend] = {"slot_attention/decode": t_attn, "slot_attention/prefill": t_pre, "kv_write": t_write}
        pre_bytes = p_seqs * ctx * kv_heads * head_dim * 2 * 2 + 2 * pq.numel() * 2
        for name, t, nbytes, shape in (
                ("slot_attention decode", t_attn, attn_bytes, f"b{batch} ctx{ctx} h{heads}/{kv_heads} d{head_dim} bf16"),
                ("slot_attention prefill", t_pre, pre_bytes, f"{p_seqs}x{p_len} new over ctx{ctx} bf16"),
                ("kv_write", t_write, write_bytes, f"{n_tok} tokens, kv{kv_heads} d{head_dim} bf16")):
            bw = nbytes / t
            say(f"| {name} | {backend} | {shape} | {t * 1e6:.1f} | {bw / 1e9:.1f} | {100 * bw / copy_bw:.0f}% |")
    # The faster GPU backend per op and phase: what QWEN_OPS_BACKEND=auto should use
    # (copy into qwen_ops/ops/backend_choice.json after review).
    gpu = {b: t for b, t in times.items() if b in ("triton", "cuda")}
    if len(gpu) == 2:
        import json
        choices = {key: min(gpu, key=lambda b: gpu[b][key]) for key in gpu["triton"]}
        say(f"\nfaster backend per op/phase: {choices}")
        (ROOT / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
        (ROOT / "benchmarks" / "results" / "backend_choice.json").write_text(json.dumps(
            {"measured_on": torch.cuda.get_device_name(device), "choices": choices,
             "seconds": {b: gpu[b] for b in gpu}}, indent=2))


def long_prompt_attention(device: torch.device, smoke: bool, reps: int) -> None:
    """Issue 42 on the GPU: slot_attention over one long prompt, whole (one chunk) and in chunks of 512
    (each chunk over the keys before it), per backend: time and TFLOP/s of the causal work (2 products
    of 2 x head_dim flops a visible query-key pair and head)."""
    import qwen_ops
    from qwen_ops.ops.backend import why_unavailable

    heads, kv_heads, head_dim, block = (4, 2, 32, 16) if smoke else (16, 8, 128, 16)
    say("\n## Long prompts (issue 42): slot_attention over one prompt, bf16\n")
    say("| prompt | chunks | backend | time (ms) | TFLOP/s |")
    say("|---|---|---|---|---|")
    for length in ((96,) if smoke else (2000, 4000)):
        blocks = -(-length // block)
        kc = torch.randn(blocks, block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(blocks, device=device, dtype=torch.int32)[None]
        q = torch.randn(length, heads, head_dim, device=device, dtype=torch.bfloat16)
        flop = 2 * 2 * head_dim * heads * length * (length + 1) / 2
        chunk = 32 if smoke else 512
        for name, cuts in (("one", [(0, length)]), (f"{chunk} each", [(c, min(c + chunk, length))
                                                                      for c in range(0, length, chunk)])):
            def run():
                for a, b in cuts:
                    torch.ops.qwen.slot_attention(q[a:b], kc, vc, bt, torch.zeros(1, dtype=torch.int32, device=device),
                                                  torch.tensor([0, b - a], dtype=torch.int32, device=device),
                                                  torch.tensor([b], dtype=torch.int32, device=device),
                                                  head_dim ** -0.5, b - a)
            for backend in ("reference", "triton", "cuda"):
                if why_unavailable(backend, device) is not None:
                    continue
                with qwen_ops.use_backend(backend):
                    t = timed(run, max(1, reps // 3), device)
                say(f"| {length} | {name} | {backend} | {t * 1e3:.2f} | {flop / t / 1e12:.2f} |")


def fp8_kv_decode(device: torch.device, smoke: bool, reps: int) -> None:
    """Issue 42's fp8 KV cache on the GPU: decode slot_attention over 4,000 keys for 8 sequences from a
    bf16 cache and from an fp8 (e4m3) one, per backend, and the fp8 output's largest error against the
    reference reading the same fp8 cache."""
    import qwen_ops
    from qwen_ops.ops.backend import why_unavailable

    heads, kv_heads, head_dim, block = (4, 2, 32, 16) if smoke else (16, 8, 128, 16)
    seqs, length = (2, 96) if smoke else (8, 4000)
    say(f"\n## fp8 KV cache (issue 42): decode attention, {seqs} sequences x {length} keys, bf16 queries\n")
    say("| cache | backend | time (us) | speed vs bf16 cache | max error vs reference |")
    say("|---|---|---|---|---|")
    blocks = -(-length // block)
    kc = torch.randn(seqs * blocks, block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(seqs * blocks, device=device, dtype=torch.int32).view(seqs, blocks)
    q = torch.randn(seqs, heads, head_dim, device=device, dtype=torch.bfloat16)
    meta = (bt, torch.arange(seqs, dtype=torch.int32, device=device),
            torch.arange(seqs + 1, dtype=torch.int32, device=device),
            torch.full((seqs,), length, dtype=torch.int32, device=device))
    scale = torch.tensor([0.02], device=device)
    k8 = (kc.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    v8 = (vc.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    base = {}
    for cache, (k, v, scales) in (("bf16", (kc, vc, ())), ("fp8_e4m3", (k8, v8, (scale, scale)))):
        ref = None
        for backend in ("reference", "triton", "cuda"):
            if why_unavailable(backend, device) is not None:
                continue
            with qwen_ops.use_backend(backend):
                def run():
                    return torch.ops.qwen.slot_attention(q, k, v, *meta, head_dim ** -0.5, 1, None, *scales)
                t = timed(run, reps, device)
                out = run()
            ref = out if backend == "reference" else ref
            err = (out.float() - ref.float()).abs().max().item()
            base.setdefault(backend, t)
            say(f"| {cache} | {backend} | {t * 1e6:.1f} | {base[backend] / t:.2f}x | {err:.3g} |")


def lora_ops(device: torch.device, smoke: bool, reps: int) -> None:
    """Issue 45's LoRA ops on the GPU: shrink + expand of a q|k|v group (rank 16, 4 adapters, every row
    its own adapter at decode, runs of one adapter at prefill) per backend, against the reference, and
    the base product of the same shape for scale."""
    import qwen_ops
    from qwen_ops.ops.backend import why_unavailable

    k, sizes, r, loras = (64, [64, 32, 32], 4, 3) if smoke else (1024, [2048, 1024, 1024], 16, 4)
    say(f"\n## LoRA ops (issue 45): shrink + expand, K = {k}, slices {sizes}, rank {r}, {loras} adapters, bf16\n")
    say("| rows | backend | time (us) | base product (us) | max error vs reference |")
    say("|---|---|---|---|---|")
    a = torch.randn(loras, 3 * r, k, device=device, dtype=torch.bfloat16) * 0.05
    b = torch.randn(loras, sum(sizes), r, device=device, dtype=torch.bfloat16) * 0.05
    w = torch.randn(sum(sizes), k, device=device, dtype=torch.bfloat16) * 0.05
    scal = torch.rand(loras, device=device) + 0.5
    for rows in ((1, 8, 64) if smoke else (1, 8, 64, 512, 2048)):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        idx = (torch.arange(rows, device=device) % loras if rows <= 8 else
               torch.arange(rows, device=device) * loras // rows).to(torch.int32)
        idx[::5] = -1
        y0 = torch.randn(rows, sum(sizes), device=device, dtype=torch.bfloat16)
        base_t = timed(lambda: torch.nn.functional.linear(x, w), reps, device)
        ref = None
        for backend in ("reference", "triton", "cuda"):
            if why_unavailable(backend, device) is not None:
                continue
            with qwen_ops.use_backend(backend):
                def run():
                    y = y0.clone()
                    torch.ops.qwen.lora_expand(y, torch.ops.qwen.lora_shrink(x, a, idx, scal), b, idx, sizes)
                    return y
                t = timed(run, reps, device)
                out = run()
            ref = out if backend == "reference" else ref
            say(f"| {rows} | {backend} | {t * 1e6:.1f} | {base_t * 1e6:.1f} | "
                f"{(out.float() - ref.float()).abs().max().item():.3g} |")


def state_op_bandwidth(device: torch.device, smoke: bool, reps: int, copy_bw: float) -> None:
    """gated_delta_rule / causal_conv1d decode at Qwen3.5 shapes: bandwidth on the state bytes."""
    import qwen_ops
    from qwen_ops.ops.backend import why_unavailable

    seqs, kh, vh, dk, dv, conv_dim = (2, 2, 4, 16, 16, 64) if smoke else (64, 16, 32, 128, 128, 8192)
    dtype = torch.bfloat16
    slots = torch.arange(seqs, device=device, dtype=torch.int32)
    qsl = torch.arange(seqs + 1, device=device, dtype=torch.int32)
    lens = torch.full((seqs,), 100, device=device, dtype=torch.int32)
    q = torch.randn(seqs, kh, dk, device=device, dtype=dtype)
    v = torch.randn(seqs, vh, dv, device=device, dtype=dtype)
    g = -torch.rand(seqs, vh, device=device)
    beta = torch.rand(seqs, vh, device=device)
    state = torch.randn(seqs, vh, dk, dv, device=device)
    x = torch.randn(seqs, conv_dim, device=device, dtype=dtype)
    w = torch.randn(conv_dim, 4, device=device, dtype=dtype)
    conv_state = torch.randn(seqs, conv_dim, 3, device=device, dtype=dtype)
    state_bytes = 2 * state.numel() * 4
    conv_bytes = 2 * conv_state.numel() * 2 + 2 * x.numel() * 2
    say("\n| state op (decode) | backend | time (us) | GB/s on state bytes | % of copy |")
    say("|---|---|---|---|---|")
    for backend in ("reference", "triton", "cuda"):
        if why_unavailable(backend, device) is not None:
            continue
        with qwen_ops.use_backend(backend):
            try:
                t_gdr = timed(lambda: torch.ops.qwen.gated_delta_rule(q, q, v, g, beta, state, slots, qsl, lens,
                                                                      dk ** -0.5), reps, device)
                t_conv = timed(lambda: torch.ops.qwen.causal_conv1d(x, w, None, conv_state, slots, qsl, lens),
                               reps, device)
            except RuntimeError as e:        # e.g. a backend build without the state-op kernels
                say(f"| both | {backend} | - | - | {str(e).split(';')[0]} |")
                continue
        for name, t, nbytes in (("gated_delta_rule", t_gdr, state_bytes), ("causal_conv1d", t_conv, conv_bytes)):
            bw = nbytes / t
            say(f"| {name} b{seqs} | {backend} | {t * 1e6:.1f} | {bw / 1e9:.1f} | {100 * bw / copy_bw:.0f}% |")


def moe_throughput(device: torch.device, smoke: bool, reps: int, copy_bw: float) -> None:
    """fused_moe on a Qwen3-30B-A3B-shaped layer: decode bandwidth on the touched experts' weights
    (each read once per call), prefill TFLOP/s (2 x tokens x top_k x 3 x hidden x inter)."""
    import qwen_ops
    from qwen_ops.ops.backend import why_unavailable

    E, k, H, I = (8, 2, 64, 32) if smoke else (128, 8, 2048, 768)
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) * 0.02
    w2 = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) * 0.02
    router = torch.randn(E, H, device=device, dtype=dtype, generator=g)
    say(f"\n## fused_moe: {E} experts, top {k}, hidden {H}, inter {I}, bf16")
    say("| backend | tokens | time (us) | experts touched | GB/s on their weights | % of copy | TFLOP/s |")
    say("|---|---|---|---|---|---|---|")
    for backend in ("reference", "cpu", "triton", "cuda"):
        reason = why_unavailable(backend, device)
        if reason is not None:
            say(f"| {backend} | - | - | - | - | - | unavailable: {reason} |")
            continue
        for T in ((1, 8, 64, 512) if not smoke else (1, 8)):
            x = torch.randn(T, H, device=device, dtype=dtype, generator=g)
            weights, ids = torch.softmax(x @ router.t(), -1, dtype=torch.float32).topk(k, dim=-1)
            ids = ids.to(torch.int32)
            with qwen_ops.use_backend(backend):
                try:
                    t = timed(lambda: torch.ops.qwen.fused_moe(x, w13, w2, weights, ids), reps, device)
                except RuntimeError as e:        # a backend without the kernel (the cuda extension)
                    say(f"| {backend} | {T} | - | - | - | - | {str(e).split(';')[0]} |")
                    break
            touched = int(torch.unique(ids).numel())
            nbytes = touched * 3 * H * I * w13.element_size()
            flops = 2 * T * k * 3 * H * I
            say(f"| {backend} | {T} | {t * 1e6:.1f} | {touched} | {nbytes / t / 1e9:.1f} | "
                f"{100 * nbytes / t / copy_bw * 2:.0f}% | {flops / t / 1e12:.2f} |")


def model_timings(device: torch.device, smoke: bool, reps: int, copy_bw: float) -> None:
    import json
    import tempfile

    from qwen_ops.engine.engine import QwenBatchedRequest, QwenEngine
    from qwen_ops.serving.llm import LLM
    from qwen_ops.engine.sampling import SamplingParams
    from safetensors.torch import save_file

    # Qwen3-0.6B shape (random weights): 28 layers, hidden 1024, 16/8 heads of 128, MLP 3072, vocab 151936.
    shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936)
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=256)
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], max_position_embeddings=4096,
               rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
               attention_bias=False, eos_token_id=1, bos_token_id=0, **shape)
    vocab = shape["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="qwen3_06b_shape_"))
    (tmp / "config.json").write_text(json.dumps(cfg))
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.dense import QwenForCausalLM

    with torch.device("meta"):
        skeleton = QwenForCausalLM(QwenConfig.from_pretrained(tmp))
    g = torch.Generator().manual_seed(0)
    tensors = {n: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
               for n, p in skeleton.named_parameters() if n != "lm_head.weight"}
    for n in list(tensors):
        if n.endswith("norm.weight"):
            tensors[n] = torch.ones_like(tensors[n])
    save_file(tensors, str(tmp / "model.safetensors"))
    weight_bytes = sum(t.numel() * 2 for t in tensors.values())
    floor = weight_bytes / copy_bw * 2        # copy_bw counts read + write; a decode step only reads
    say(f"\nQwen3-0.6B shape, random bf16 weights: {weight_bytes / 1e9:.2f} GB of weights; "
        f"floor (weight bytes / read bandwidth) = {floor * 1e3:.3f} ms per step")
    say("| batch | eager (ms) | compiled (ms) | CUDA graph (ms) | graph / floor | eager / graph |")
    say("|---|---|---|---|---|---|")
    modes = {"eager": dict(compile=False, cuda_graphs=False), "compiled": dict(compile=True, cuda_graphs=False),
             "graph": dict(compile=True, cuda_graphs=device.type == "cuda")}
    engines = {m: QwenEngine.from_pretrained(tmp, dtype="bfloat16", device=device, max_slots=64, max_seq_len=1024,
                                             **kw) for m, kw in modes.items()}
    sp = SamplingParams(temperature=0.0, max_new_tokens=100_000, ignore_eos=True)
    for batch in (1, 8, 64):
        row = {}
        for m, eng in engines.items():
            reqs = [QwenBatchedRequest(i, [(i * 7 + j) % (vocab - 2) + 2 for j in range(128)], i, sp) for i in range(batch)]
            eng.batch_prefill(reqs)
            for _ in range(3):
                eng.batch_decode_step(reqs)
            row[m] = timed(lambda: eng.batch_decode_step(reqs), reps, device)
            for r in reqs:
                eng.free_slot(r.slot_id)
        say(f"| {batch} | {row['eager'] * 1e3:.3f} | {row['compiled'] * 1e3:.3f} | {row['graph'] * 1e3:.3f} | "
            f"{row['graph'] / floor:.2f}x | {row['eager'] / row['graph']:.2f}x |")
    del engines
    n_req = 16 if smoke else 256
    llm = LLM(tmp, dtype="bfloat16", device=device, max_num_seqs=64, max_model_len=1024)
    prompts = [[(i * 13 + j) % (vocab - 2) + 2 for j in range(128)] for i in range(n_req)]
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=128, ignore_eos=True), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    say(f"\nEnd to end: {n_req} requests x (128 prompt + 128 output tokens): {elapsed:.2f} s, "
        f"{n_out / elapsed:.0f} output tokens/s, stats {llm.stats()}")


def tensor_parallel_check(device: torch.device, smoke: bool, model_dir: Optional[Path] = None) -> int:
    """``LLM(tensor_parallel_size=2)`` against one process on a tiny random Qwen3 (greedy tokens
    must match), when 2 GPUs are visible (NCCL, CUDA graphs) or, with ``--smoke``, on the CPU (gloo
    and shared memory). Returns 1 on a mismatch or failure."""
    import json
    import tempfile

    from qwen_ops import LLM, SamplingParams
    from safetensors.torch import save_file

    if device.type == "cuda" and torch.cuda.device_count() < 2:
        say(f"\n## Tensor parallelism\nskipped: {torch.cuda.device_count()} GPU visible, 2 needed")
        return 0
    say("\n## Tensor parallelism (tp=2 vs 1 process, tiny random Qwen3, greedy)")
    tmp = Path(tempfile.mkdtemp(prefix="qwen3_tp_"))
    cfg = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], max_position_embeddings=512,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
               eos_token_id=1, bos_token_id=0, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=1024)
    (tmp / "config.json").write_text(json.dumps(cfg))
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.dense import QwenForCausalLM

    with torch.device("meta"):
        skeleton = QwenForCausalLM(QwenConfig.from_pretrained(tmp))
    g = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(p.shape, generator=g) * (0.08 if p.dim() == 2 else 0.0) + (p.dim() == 1)
               for n, p in skeleton.named_parameters()}, str(tmp / "model.safetensors"))
    prompts = [[3 + (7 * i + j) % 1000 for j in range(16 + i)] for i in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rows, tokens = [], {}
    for tp in (1, 2):
        llm = LLM(tmp, tensor_parallel_size=tp, device=str(device), max_model_len=256, max_num_seqs=8)
        try:
            llm.generate(prompts[:1], sp, use_tqdm=False)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
        finally:
            llm.shutdown()
        tokens[tp] = [o.outputs[0].token_ids for o in outs]
        rows.append(f"| {tp} | {len(prompts) * 32 / dt:.0f} |")
    same = sum(a == b for a, b in zip(tokens[1], tokens[2]))
    say("| tensor_parallel_size | tok/s |\n|---|---|\n" + "\n".join(rows))
    say(f"same greedy tokens: {same}/{len(prompts)}")
    return 0 if same == len(prompts) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--no-build", action="store_true", help="do not build the CUDA extension first")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU shapes: check the script itself")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU here; use --smoke to check the script on the CPU", file=sys.stderr)
        return 2
    reps = 3 if args.smoke else (10 if args.quick else 30)
    name = "cpu-smoke" if args.smoke else torch.cuda.get_device_name(device).replace(" ", "-")
    say(f"# Device check: {name}, torch {torch.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    status = 0
    if not args.smoke and not args.no_build:
        say("\n## Build csrc/ (QWEN_OPS_BUILD_CUDA=1 python setup.py build_ext --inplace)")
        env = dict(os.environ, QWEN_OPS_BUILD_CUDA="1", MAX_JOBS=os.environ.get("MAX_JOBS", "8"))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        say(f"build {'ok' if proc.returncode == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
        if proc.returncode:
            say("```\n" + "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:]) + "\n```")
    if not args.skip_tests and not args.smoke:
        tests = ["tests/test_ops.py", "tests/test_ops_gated_delta.py", "tests/test_ops_moe.py", "tests/test_cuda_ext.py",
                 "tests/test_cuda_graphs.py", "tests/test_engine.py", "tests/test_kv_fp8.py", "tests/test_ops_lora.py",
                 "-k", "not emulated"]
        say(f"\n## GPU tests: pytest {' '.join(tests)}")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *tests], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ, QWEN_OPS_REQUIRE_GPU="1"))
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        say("```\n" + "\n".join(tail) + "\n```")
        status = proc.returncode
    copy_bw = copy_bandwidth(device, (1 << 20) if args.smoke else (1 << 30), reps)
    say(f"\n## Bandwidth\nmeasured device-to-device copy: {copy_bw / 1e9:.1f} GB/s (read + write)\n")
    op_bandwidth(device, args.smoke, reps, copy_bw)
    long_prompt_attention(device, args.smoke, reps)
    fp8_kv_decode(device, args.smoke, reps)
    lora_ops(device, args.smoke, reps)
    state_op_bandwidth(device, args.smoke, reps, copy_bw)
    moe_throughput(device, args.smoke, reps, copy_bw)
    say("\n## Qwen3-0.6B-shaped decode")
    model_timings(device, args.smoke, reps, copy_bw)
    try:
        status |= tensor_parallel_check(device, args.smoke)
    except Exception as e:          # report and go on: the table above is still worth writing
        say(f"tensor parallelism FAILED: {type(e).__name__}: {e}")
        status |= 1
    out = args.out or ROOT / "benchmarks" / "results" / f"device_check_{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(LINES) + "\n")
    print(f"\nwrote {out}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
