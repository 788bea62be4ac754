"""Mixture-of-experts speed ratios, measured in ONE run (interleaved medians, ``OMP_NUM_THREADS=1``).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py            # full sizes
    OMP_NUM_THREADS=1 python benchmarks/bench_moe.py --short    # fewer repetitions, 16 new tokens
    ... [--json out.json] [--skip-generate] [--skip-op]

1. The op. ``torch.ops.qwen.fused_moe`` on each available backend (reference, cpu; triton and cuda
   only on CUDA tensors: the CPU interpreter says nothing about speed) and our MoE block (the
   router in torch plus the op, as the model runs it) against transformers' own
   ``Qwen3MoeSparseMoeBlock`` on the same weights, built inside a ``Qwen3MoeForCausalLM`` so that it
   runs transformers' default experts implementation (``grouped_mm`` on torch 2.13; the ``eager``
   per-expert loop is timed too). Decode T = 1, 4, 16, 64 and prefill T = 512, on two layer shapes:
   the end-to-end model's layer and a Qwen3-30B-A3B layer scaled by 1/4 in width.
2. End to end. ``LLM.generate`` against ``transformers.generate`` on a tiny random ``qwen3_moe``
   (4 layers, hidden 256, 16 experts, top 4), 32 requests x (64 prompt + 64 new) tokens, greedy,
   counting identical continuations (benchmarks/gate.py's ``generate_vs_transformers``), and one
   request; the CPU default engine (eager, the layers on the CPU fast path's ops, the routed
   experts on ``moe_packed``) and, unless ``--short``, ``LLM(compile=True)`` (compile time excluded).

Issue 19's CPU targets: the cpu fused_moe >= 3x transformers' MoE block at T = 512 and no slower
at T = 1; LLM.generate >= 2x transformers.generate. Figures live in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# name -> (num_experts, top_k, hidden, moe_intermediate)
LAYER_SHAPES = {
    "e2e-layer": (16, 4, 256, 128),
    "a3b-quarter": (128, 8, 512, 192),
}
TOKENS = (1, 4, 16, 64, 512)
# The end-to-end model: the embedded default model's attention and size class, MoE MLPs.
E2E_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                  num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=True,
                  max_position_embeddings=512, rms_norm_eps=1e-6)


def _median_interleaved(fns: dict, reps: int) -> dict[str, float]:
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()                                  # warm-up (first-call allocations, oneDNN setup)
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _hf_block(num_experts: int, top_k: int, hidden: int, inter: int, implementation: str):
    """transformers' Qwen3MoeSparseMoeBlock inside a one-layer model, so the model's init chooses its
    experts implementation (``None`` = transformers' default)."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=hidden, intermediate_size=inter,
                                      moe_intermediate_size=inter, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=num_experts,
                                      num_experts_per_tok=top_k, norm_topk_prob=True)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    if implementation != "default":
        model.set_experts_implementation(implementation)
    return model.model.layers[0].mlp, model.config._experts_implementation


def op_ratios(reps: int) -> dict:
    import qwen_ops
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.moe import SparseMoeBlock
    from qwen_ops.ops.backend import why_unavailable

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    backends = [b for b in ("reference", "cpu", "triton", "cuda")
                if why_unavailable(b, device) is None and not (b == "triton" and device.type != "cuda")]
    results = {}
    for name, (E, k, H, I) in LAYER_SHAPES.items():
        hf, hf_impl = _hf_block(E, k, H, I, "default")
        hf_eager, _ = _hf_block(E, k, H, I, "eager")
        config = QwenConfig.from_dict(dict(model_type="qwen3_moe", vocab_size=16, hidden_size=H, intermediate_size=I,
                                           moe_intermediate_size=I, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=k,
                                           norm_topk_prob=True, rope_theta=1e4))
        ours = SparseMoeBlock(config).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in hf.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            hf_eager.load_state_dict(hf.state_dict())
            ours.gate.weight.copy_(hf.gate.weight)
            ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
            ours.experts.down_proj.copy_(hf.experts.down_proj)
        hf, hf_eager, ours = hf.to(device), hf_eager.to(device), ours.to(device)
        print(f"\n{name}: {E} experts, top {k}, hidden {H}, inter {I}, fp32 on {device}; "
              f"transformers' experts implementation: {hf_impl}", flush=True)
        print(f"{'T':>4} " + " ".join(f"{c:>11}" for c in ["hf block", "hf eager"] + [f"op {b}" for b in backends]
                                      + ["our block"])
              + "   hf/op-cpu  hf/our-block  ref/cpu")
        rows = {}
        for T in TOKENS:
            x = torch.randn(T, H, generator=g).to(device)
            with torch.inference_mode():
                weights, ids = ours.gate(x)
                args = (x, ours.experts.gate_up_proj, ours.experts.down_proj, weights, ids)
                fns = {"hf block": lambda: hf(x[None]), "hf eager": lambda: hf_eager(x[None]),
                       "our block": lambda: ours(x)}
                for b in backends:
                    fns[f"op {b}"] = (lambda b=b: _with_backend(qwen_ops, b, torch.ops.qwen.fused_moe, *args))
                n = reps if T < 512 else max(5, reps // 4)
                med = _median_interleaved(fns, n)
                err = (hf(x[None])[0] - ours(x)).abs().max().item()
            fast = med.get("op cpu", med.get("op triton", med["op reference"]))
            row = {k: v * 1e3 for k, v in med.items()} | {
                "hf_over_op": med["hf block"] / fast, "hf_over_our_block": med["hf block"] / med["our block"],
                "reference_over_cpu": med["op reference"] / med["op cpu"] if "op cpu" in med else None,
                "max_abs_diff_vs_hf": err}
            rows[T] = row
            cols = ["hf block", "hf eager"] + [f"op {b}" for b in backends] + ["our block"]
            ref_cpu = row["reference_over_cpu"]
            print(f"{T:>4} " + " ".join(f"{row[c]:>9.3f}ms" for c in cols)
                  + f"   {row['hf_over_op']:>8.2f}x {row['hf_over_our_block']:>11.2f}x"
                  + (f" {ref_cpu:>7.2f}x" if ref_cpu else ""), flush=True)
        results[name] = {"shape": dict(num_experts=E, top_k=k, hidden=H, inter=I), "hf_implementation": hf_impl,
                         "ms_and_ratios": rows}
    return results


def _with_backend(qwen_ops, backend, op, *args):
    with qwen_ops.use_backend(backend):
        return op(*args)


def make_e2e_checkpoint(path: Path) -> Path:
    """A tiny random qwen3_moe saved by transformers; weights peaked enough for clear greedy margins."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**E2E_CONFIG, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 0.06)
    model.save_pretrained(path)
    return path


def generate_ratio(new_tokens: int, compiled: bool) -> dict:
    """LLM.generate (eager, the CPU default; and with compile=True when ``compiled``) vs transformers."""
    from gate import generate_vs_transformers

    results = {}
    with tempfile.TemporaryDirectory(prefix="tiny_qwen3_moe_") as tmp:
        path = make_e2e_checkpoint(Path(tmp))
        for compile in (False, True) if compiled else (False,):
            gen = generate_vs_transformers(path, n_requests=32, prompt_len=64, new_tokens=new_tokens, compile=compile)
            mode = "compiled" if compile else "eager"
            for label, r in gen.items():
                print(f"LLM.generate ({mode}) / transformers.generate, {label}: {r['ratio']:.2f}x "
                      f"({r['ours_tok_s']:.0f} vs {r['hf_tok_s']:.0f} tok/s), same tokens {r['same_tokens']}",
                      flush=True)
                results[f"{label}_{mode}"] = r
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help="fewer repetitions, 16 new tokens")
    parser.add_argument("--skip-op", action="store_true")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: set OMP_NUM_THREADS=1; timings with more threads are erratic here", file=sys.stderr)
    torch.set_num_threads(1)
    results = {}
    if not args.skip_op:
        results["op"] = op_ratios(reps=10 if args.short else 40)
    if not args.skip_generate:
        print("\nend to end: tiny qwen3_moe, 32 requests x (64 + "
              f"{16 if args.short else 64}) tokens, greedy", flush=True)
        results["generate"] = generate_ratio(16 if args.short else 64, compiled=not args.short)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
