"""Quantized decode speed at real size (issue 28): the Qwen3-0.6B-shaped random checkpoint of
``bench_realsize.py`` in fp32, bf16, online int8 and fp8, and written by ``qwen_ops.models.quant_export``
in the GPTQ (4 and 8 bits) and AWQ layouts (group 128), one process, one variant at a time.

    OMP_NUM_THREADS=1 python benchmarks/bench_quant.py [--threads 1 2] [--variants ...] [--json FILE]

For each variant and thread count:
- decode alone: the median 1-request ``decode_step`` (tokens/s, as llama-bench's tg), the bytes of
  weights one step reads (quantized buffers, packed panels, norm vectors, the LM head) and that
  as a fraction of the machine's read bandwidth, measured between the steps (``read_bandwidth_probe``);
- end to end: ``LLM.generate`` of 1 and 8 requests (32-token prompts, 16 new tokens, greedy,
  ignore_eos): generated tokens over the wall time of the call, median of ``--reps``;
- tokens: the quantized model's greedy tokens against the same model with its quantized layers
  dequantized to fp32 ``nn.Linear`` (reference math, the oracle): a mismatch marks the row FAIL and
  the script exits 1.
Figures: benchmarks/README.md ("Quantized weights (issue 28)").
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_realsize import default_cache_dir, make_checkpoint, prompts, read_bandwidth_probe  # noqa: E402

VARIANTS = ("float32", "bfloat16", "int8", "fp8", "gptq4", "gptq8", "awq4")


def checkpoint_for(variant: str, base: Path) -> tuple[Path, dict]:
    """(checkpoint dir, LLM kwargs) of a variant; the GPTQ / AWQ files are written once beside ``base``."""
    if variant in ("float32", "bfloat16"):
        return base, {"dtype": variant}
    if variant in ("int8", "fp8"):
        return base, {"quantization": variant}
    fmt, bits = variant[:-1], int(variant[-1])
    path = base.parent / f"{base.name}-{variant}-g128"
    if not (path / "model.safetensors").exists():
        from qwen_ops.models.quant_export import export
        export(base, path, fmt, bits, 128)
    return path, {}


def step_bytes(model) -> int:
    """Bytes one decode step reads: quantized layers' buffers (not twice: a fused ``*_quant`` product
    and the layers that view it share them), packed panels, 1-D parameters."""
    total = 0
    for name, t in model.named_buffers():
        if name.endswith(("_packed", "_bias")) or (name.rpartition(".")[2] in ("qweight", "scales", "zeros")
                                                    and "_quant." not in name):
            total += t.numel() * t.element_size()
    for p in model.parameters():
        if p.dim() == 1:
            total += p.numel() * p.element_size()
    return total


def dequantized_twin(llm):
    """The engine's model with every QuantLinear replaced by an fp32 nn.Linear of its dequantized
    weight (the reference's dequantization): the oracle of the greedy tokens."""
    from qwen_ops.models.quant import QuantLinear
    from qwen_ops.ops.kernels import reference_quant as RQ

    model = llm.engine.model
    for name, m in list(model.named_modules()):
        if not isinstance(m, QuantLinear) or name.endswith("_quant"):
            continue
        if m.scheme == "int8":
            w = RQ.dequantize_int8(m.qweight, m.scales)
        elif m.scheme == "int4":
            w = RQ.dequantize_int4(m.qweight, m.scales, m.zeros)
        else:
            w = RQ.dequantize_fp8(m.qweight, m.scales, *m.block)
        lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(w)
            if m.bias is not None:
                lin.bias.copy_(m.bias.float())
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, lin)
    for name, m in list(model.named_modules()):   # the fused products are rebuilt from the new layers
        for key in [k for k in m._modules if k.endswith("_quant")]:
            del m._modules[key]
    model.process_weights_after_loading()


def measure(variant: str, base: Path, threads: int, reps: int, steps: int) -> dict:
    from qwen_ops import LLM, SamplingParams

    torch.set_num_threads(threads)
    path, kwargs = checkpoint_for(variant, base)
    t0 = time.perf_counter()
    llm = LLM(str(path), max_num_seqs=8, max_model_len=64, enable_prefix_caching=False, **kwargs)
    load_s = time.perf_counter() - t0
    eng = llm.engine
    row = {"variant": variant, "threads": threads, "load_s": load_s, "weight_gb": step_bytes(eng.model) / 1e9}
    probe = read_bandwidth_probe()
    slot = eng.allocate_slot("bench_quant")
    tok = eng.prefill(prompts(1, 32)[0], slot_id=slot).next_token
    times, bws = [], []
    for i in range(steps + 1):
        t = time.perf_counter()
        tok = eng.decode_step(tok, slot_id=slot).next_token
        if i:
            times.append(time.perf_counter() - t)
            bws.append(probe())
    eng.free_slot(slot)
    step = statistics.median(times)
    row.update(decode_tok_s=1 / step, read_gb_s=statistics.median(bws) / 1e9,
               bandwidth_fraction=row["weight_gb"] * 1e9 / step / statistics.median(bws))
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for n in (1, 8):
        ps = prompts(n, 32, seed=n)
        llm.generate(ps, sp)                                   # warm-up
        walls = []
        for _ in range(reps):
            t = time.perf_counter()
            outs = llm.generate(ps, sp)
            walls.append(time.perf_counter() - t)
        row[f"e2e_{n}_tok_s"] = 16 * n / statistics.median(walls)
        if n == 8:
            tokens = [o.outputs[0].token_ids for o in outs]
    if variant not in ("float32", "bfloat16"):
        dequantized_twin(llm)
        twin = [o.outputs[0].token_ids for o in llm.generate(prompts(8, 32, seed=8), sp)]
        row["tokens_match_dequantized"] = twin == tokens
    del llm, eng
    gc.collect()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    base = make_checkpoint(args.cache_dir or default_cache_dir())
    rows = []
    print("| variant | threads | weights read (GB) | decode alone (tok/s) | of read bandwidth | "
          "1 request e2e (tok/s) | 8 requests e2e (tok/s) | greedy = dequantized |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for variant in args.variants:
            r = measure(variant, base, threads, args.reps, args.steps)
            rows.append(r)
            match = r.get("tokens_match_dequantized")
            print(f"| {variant} | {threads} | {r['weight_gb']:.2f} | {r['decode_tok_s']:.1f} | "
                  f"{100 * r['bandwidth_fraction']:.0f}% of {r['read_gb_s']:.1f} GB/s | {r['e2e_1_tok_s']:.1f} | "
                  f"{r['e2e_8_tok_s']:.1f} | {'-' if match is None else ('yes' if match else 'FAIL')} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if any(r.get("tokens_match_dequantized") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
