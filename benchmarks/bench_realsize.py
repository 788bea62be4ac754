"""Real-size CPU speed (issue 20): a Qwen3-0.6B-shaped model with random weights, fp32 and bf16.

    OMP_NUM_THREADS=1 python benchmarks/bench_realsize.py [--cache-dir DIR] [--json FILE]

What it measures, in one process, alone on the machine if possible:
- tokens/s of ``qwen_ops.LLM.generate`` and of transformers' ``generate`` on the same prompts,
  at 1 and 8 requests (32-token prompts, 16 new tokens, greedy, ignore_eos), fp32 and bf16,
  median of ``--reps`` timed runs after a warm-up; whether the greedy tokens agree;
- the machine's single-thread read bandwidth (the faster of ``torch.sum`` and ``torch.mv`` over a
  1 GiB fp32 tensor), measured between the decode steps of the next item so that both see the
  same machine load;
- the 1-request decode step of qwen_ops (the model's forward on the CPU fast path's ops): time,
  the weight bytes it reads, and the effective bandwidth as a fraction of the measured one.

``--products``: the layers' products against oneDNN's prepacked GEMM (1 to 256 rows, 1 and 2
threads); ``--threads``: ``LLM.generate`` with 1 and 2 intra-op threads. Neither runs by default.

The checkpoint (2.4 GB, fp32) is written once with transformers' ``save_pretrained`` under
``--cache-dir`` (default: the qwen_ops cache dir's ``realsize``) and reused. ``benchmarks/gate.py``
runs this in its full mode; the figures live in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

# Qwen3-0.6B's shape (its config.json), tied embeddings.
SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=151643,
             eos_token_id=151645)
# Weights ~ N(0, 0.05): peaked enough logits (std 0.05 keeps greedy margins clear, as measured on
# these machines) that fp32 rounding differences between implementations do not flip greedy tokens.
WEIGHT_STD = 0.05
CHECKPOINT_NAME = "qwen3-0.6b-shaped-random-std0.05"


def default_cache_dir() -> Path:
    from qwen_ops.ops.kernels import cpu

    return cpu.cache_dir() / "realsize"


def make_checkpoint(cache_dir: Path, shape: dict = SHAPE, name: str = CHECKPOINT_NAME) -> Path:
    """The checkpoint directory (a random Qwen3 of ``shape``, weights of std WEIGHT_STD), written on first
    use (to a temporary name, then renamed)."""
    path = Path(cache_dir) / name
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**shape))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, WEIGHT_STD)
    model.save_pretrained(tmp)
    del model
    try:
        os.replace(tmp, path)
    except OSError:                # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def prompts(n: int, length: int, vocab: int = SHAPE["vocab_size"], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def read_bandwidth_probe(gib: float = 1.0):
    """A function returning one measurement of the single-thread read bandwidth (bytes/s): the
    faster of ``torch.sum`` and ``torch.mv`` (MKL's sgemv, which keeps more reads in flight: about
    15% faster here) over the same ``gib`` GiB of fp32, each reading it once."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    rows, vec = x.view(-1, 1024), torch.ones(1024)

    def probe() -> float:
        best = float("inf")
        for fn in (x.sum, lambda: torch.mv(rows, vec)):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return x.numel() * 4 / best

    return probe


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads on the fast path: every packed matrix (padding
    included: it is read too), and the norms' and biases' vectors."""
    total = 0
    for name, t in model.named_buffers():
        if name.endswith(("_packed", "_bias")):
            total += t.numel() * t.element_size()
    for name, p in model.named_parameters():
        if p.dim() == 1:
            total += p.numel() * p.element_size()
    return total


def decode_step_profile(llm, prompt: list[int], steps: int) -> dict:
    """The 1-request decode step of ``llm``'s engine: median time and the effective weight-read
    bandwidth against the machine's (``read_bandwidth_probe``), the two measured alternately so
    that both see the same load."""
    from qwen_ops.models.layers import forward_choices
    from qwen_ops.ops.kernels import cpu

    eng = llm.engine
    if set(forward_choices(eng.model).values()) != {"cpu"}:
        return {"note": "the CPU fast path does not run this model"}
    probe = read_bandwidth_probe()
    slot = eng.allocate_slot("bench_realsize")
    tok = eng.prefill(prompt, slot_id=slot).next_token
    step_s, bandwidths = [], []
    try:
        for i in range(steps + 1):
            t0 = time.perf_counter()
            tok = eng.decode_step(tok, slot_id=slot).next_token
            t = time.perf_counter() - t0
            if i == 0:                   # the first step after the prefill: not a steady state
                continue
            step_s.append(t)
            bandwidths.append(probe())
    finally:
        eng.free_slot(slot)
    step = statistics.median(step_s)
    weight_bytes = weight_bytes_per_step(eng.model)
    bandwidth = statistics.median(bandwidths)
    effective = weight_bytes / step
    return {"step_ms": 1e3 * step, "weight_gb": weight_bytes / 1e9, "read_bandwidth_gb_s": bandwidth / 1e9,
            "effective_gb_s": effective / 1e9, "bandwidth_fraction": effective / bandwidth,
            "bf16_products": cpu.bf16_products()}


def generate_side_by_side(path: Path, dtype: torch.dtype, batches: dict, new_tokens: int, reps: int,
                          profile_steps: int, with_transformers: bool = True) -> dict:
    """tok/s of LLM.generate and transformers generate on the same prompts, runs interleaved
    (medians of ``reps`` after a warm-up), whether their tokens agree, and the decode-step profile."""
    from qwen_ops.engine.sampling import SamplingParams
    from qwen_ops.serving.llm import LLM

    longest = max(len(p) for ps in batches.values() for p in ps)
    llm = LLM(path, dtype=dtype, max_num_seqs=max(len(ps) for ps in batches.values()),
              max_model_len=longest + max(new_tokens, profile_steps) + 8)
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    hf = None
    if with_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    def run_ours(ps):
        return [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]

    def run_hf(ps):
        ids = torch.tensor(ps)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    from qwen_ops.models.layers import forward_choices

    result = {"dtype": str(dtype).removeprefix("torch."),
              "implementation": sorted(set(forward_choices(llm.engine.model).values()))}
    for label, ps in batches.items():
        runners = {"qwen_ops": run_ours} | ({"transformers": run_hf} if hf is not None else {})
        tokens, times = {}, {k: [] for k in runners}
        for name, fn in runners.items():
            tokens[name] = fn(ps)                               # warm-up
        for _ in range(reps):
            for name, fn in runners.items():
                t0 = time.perf_counter()
                fn(ps)
                times[name].append(time.perf_counter() - t0)
        n_tokens = len(ps) * new_tokens
        entry = {f"{k}_tok_s": n_tokens / statistics.median(v) for k, v in times.items()}
        if hf is not None:
            same = sum(a == b for a, b in zip(tokens["qwen_ops"], tokens["transformers"]))
            entry["same_tokens"] = f"{same}/{len(ps)}"
            entry["ratio"] = entry["qwen_ops_tok_s"] / entry["transformers_tok_s"]
        result[label] = entry
    del hf
    gc.collect()
    if profile_steps:
        result["decode_step_1_request"] = decode_step_profile(llm, next(iter(batches.values()))[0], profile_steps)
    del llm
    gc.collect()
    return result


def run(cache_dir: Path | None = None, *, dtypes=("float32", "bfloat16"), requests=(1, 8), prompt_len: int = 32,
        new_tokens: int = 16, reps: int = 3, profile_steps: int = 12, with_transformers: bool = True) -> dict:
    """Every measurement of the module doc; returns them as a dict (``print_report`` prints it)."""
    path = make_checkpoint(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    all_prompts = prompts(max(requests), prompt_len)
    batches = {f"{n}_requests": all_prompts[:n] for n in requests}
    results = {"checkpoint": str(path), "threads": torch.get_num_threads(), "cpu": _cpu_model()}
    for dtype in dtypes:
        results[dtype] = generate_side_by_side(path, getattr(torch, dtype), batches, new_tokens, reps, profile_steps,
                                               with_transformers)
    return results


def products_vs_onednn(rows=(1, 8, 32, 96, 256), dtypes=("float32", "bfloat16"), reps: int = 7,
                       threads=(1,), stream_bytes: int = 600 << 20) -> list[dict]:
    """The layers' products (q, k, v, o, gate, up, down at this model's shapes) on ``rows`` input
    rows: the packed product of torch.ops.qwen.linear_packed (``cpu.linear_packed``) against oneDNN's prepacked
    one (``torch.ops.mkldnn._linear_pointwise``, the weight reordered for that row count, as
    Inductor's freezing does), each with each of ``threads`` intra-op threads. Enough
    distinct layers (``stream_bytes`` of weights each way, more than the L3) that the weights come
    from DRAM, as in a real step. Interleaved runs; GFLOP/s from the best of ``reps`` (compute-
    bound above a few rows, and another process on the other core only ever slows a run down)."""
    from qwen_ops.ops.kernels import cpu

    h, qd, kd, inter = SHAPE["hidden_size"], SHAPE["num_attention_heads"] * SHAPE["head_dim"], \
        SHAPE["num_key_value_heads"] * SHAPE["head_dim"], SHAPE["intermediate_size"]
    shapes = [(qd, h), (kd, h), (kd, h), (h, qd), (inter, h), (inter, h), (h, inter)]   # (N, K)
    g = torch.Generator().manual_seed(0)
    threads_before = torch.get_num_threads()
    out = []
    try:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            layer_bytes = sum(n * k for n, k in shapes) * dtype.itemsize
            layers = max(1, -(-stream_bytes // layer_bytes))
            weights = [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for _ in range(layers) for n, k in shapes]
            packed = [cpu.pack_panels(w) for w in weights]
            for m in rows:
                xs = {k: torch.randn(m, k, generator=g).to(dtype) for k in {k for _, k in shapes}}
                xs32 = {k: x.float() for k, x in xs.items()}
                onednn = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
                work = list(zip(shapes * layers, packed, onednn))

                def ours():
                    for (n, k), pk, _ in work:
                        cpu.linear_packed(xs32[k], pk, None, n)

                def theirs():
                    for (n, k), _, pk in work:
                        torch.ops.mkldnn._linear_pointwise(xs[k], pk, None, "none", [], "")

                fns = {("ours", t): ours for t in threads} | {("onednn", t): theirs for t in threads}
                times = {k: [] for k in fns}
                for _ in range(reps + 1):
                    for (name, t), fn in fns.items():
                        torch.set_num_threads(t)
                        t0 = time.perf_counter()
                        fn()
                        times[name, t].append(time.perf_counter() - t0)
                del onednn, work
                flops = 2 * m * layers * sum(n * k for n, k in shapes)
                entry = {"dtype": dtype_name, "rows": m, "layers": layers}
                for (name, t), ts in times.items():
                    entry[f"{name}_{t}t_gflop_s"] = flops / min(ts[1:]) / 1e9
                out.append(entry)
            del weights, packed
    finally:
        torch.set_num_threads(threads_before)
    return out


def threads_side_by_side(path: Path, dtype: torch.dtype, batches: dict, new_tokens: int, reps: int,
                         threads=(1, 2)) -> dict:
    """tok/s of LLM.generate with each intra-op thread count (interleaved runs, medians): the
    packed products split across the threads (OpenMP builds)."""
    from qwen_ops.engine.sampling import SamplingParams
    from qwen_ops.serving.llm import LLM

    longest = max(len(p) for ps in batches.values() for p in ps)
    llm = LLM(path, dtype=dtype, max_num_seqs=max(len(ps) for ps in batches.values()),
              max_model_len=longest + new_tokens + 8)
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    before = torch.get_num_threads()
    result = {"dtype": str(dtype).removeprefix("torch.")}
    try:
        for label, ps in batches.items():
            times = {t: [] for t in threads}
            for rep in range(reps + 1):
                for t in threads:
                    torch.set_num_threads(t)
                    t0 = time.perf_counter()
                    llm.generate(ps, sp, use_tqdm=False)
                    if rep:                          # the first round warms up each setting
                        times[t].append(time.perf_counter() - t0)
            result[label] = {f"{t}_threads_tok_s": len(ps) * new_tokens / statistics.median(v)
                             for t, v in times.items()}
    finally:
        torch.set_num_threads(before)
    del llm
    gc.collect()
    return result


def print_products(entries: list[dict], out=sys.stdout) -> None:
    names = [k for k in entries[0] if k.endswith("_gflop_s")]
    print(f"{'dtype':<9} {'rows':>5} " + " ".join(f"{n.removesuffix('_gflop_s'):>10}" for n in names)
          + "   GFLOP/s over the layers' products (weights from DRAM); ours / oneDNN 1 thread", file=out)
    for e in entries:
        ratio = e["ours_1t_gflop_s"] / e["onednn_1t_gflop_s"] if "onednn_1t_gflop_s" in e else float("nan")
        print(f"{e['dtype']:<9} {e['rows']:>5} " + " ".join(f"{e[n]:>10.1f}" for n in names) + f"   {ratio:.2f}x",
              file=out)


def _cpu_model() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gate import _cpu_model as model_name     # one /proc/cpuinfo reader for the benchmarks

    return model_name()


def print_report(results: dict, out=sys.stdout) -> None:
    print(f"real-size model ({results['checkpoint']}), {results['cpu']}, {results['threads']} thread(s)", file=out)
    print(f"{'dtype':<9} {'requests':<12} {'qwen_ops tok/s':>15} {'transformers':>13} {'ratio':>6}  same tokens",
          file=out)
    for dtype, r in results.items():
        if not isinstance(r, dict) or "dtype" not in r:
            continue
        for label, e in r.items():
            if not label.endswith("_requests"):
                continue
            hf = e.get("transformers_tok_s")
            print(f"{dtype:<9} {label:<12} {e['qwen_ops_tok_s']:>15.2f} {'-' if hf is None else f'{hf:.2f}':>13} "
                  f"{e.get('ratio', float('nan')):>5.2f}x  {e.get('same_tokens', '-')}", file=out)
    for dtype, r in results.items():
        p = r.get("decode_step_1_request") if isinstance(r, dict) else None
        if not p or "step_ms" not in p:
            continue
        print(f"{dtype} decode step, 1 request: {p['step_ms']:.1f} ms; reads {p['weight_gb']:.3f} GB "
              f"of weights = {p['effective_gb_s']:.2f} GB/s = {100 * p['bandwidth_fraction']:.0f}% of the measured "
              f"{p['read_bandwidth_gb_s']:.2f} GB/s (torch.sum / torch.mv, 1 GiB); bf16 products: {p['bf16_products']}",
              file=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the checkpoint is kept "
                        f"(default: {default_cache_dir()})")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--requests", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--profile-steps", type=int, default=12, help="decode steps profiled (0: none)")
    parser.add_argument("--no-transformers", action="store_true", help="qwen_ops only")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    parser.add_argument("--products", action="store_true",
                        help="only the layer products vs oneDNN's (rows 1-256, 1 and 2 threads for oneDNN)")
    parser.add_argument("--threads", action="store_true",
                        help="only LLM.generate with 1 and 2 intra-op threads (medians of --reps)")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        print("warning: set OMP_NUM_THREADS=1; the figures in benchmarks/README.md are single-threaded",
              file=sys.stderr)
    for name in ("requests", "reps"):
        values = getattr(args, name)
        for v in values if isinstance(values, list) else [values]:
            if v < 1:
                parser.error(f"--{name} = {v}, expected >= 1")
    if args.products:
        entries = products_vs_onednn(dtypes=args.dtypes, threads=(1, 2))
        print_products(entries)
        if args.json:
            args.json.write_text(json.dumps(entries, indent=2))
        return 0
    if args.threads:
        path = make_checkpoint(args.cache_dir or default_cache_dir())
        ps = prompts(max(args.requests), 32)
        batches = {f"{n}_requests": ps[:n] for n in args.requests}
        entries = [threads_side_by_side(path, getattr(torch, d), batches, 16, args.reps) for d in args.dtypes]
        for e in entries:
            for label, r in e.items():
                if label != "dtype":
                    print(e["dtype"], label, ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
        if args.json:
            args.json.write_text(json.dumps(entries, indent=2))
        return 0
    results = run(args.cache_dir, dtypes=args.dtypes, requests=args.requests, reps=args.reps,
                  profile_steps=args.profile_steps, with_transformers=not args.no_transformers)
    print_report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
