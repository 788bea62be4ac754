"""Beam search against transformers' (issue 44 item 2): width 4, 64 new tokens, the embedded model.

    OMP_NUM_THREADS=1 python benchmarks/bench_beam_search.py [--prompts 1 4] [--blocks 5] [--json FILE]

``LLM.beam_search`` and ``generate(num_beams=4, num_return_sequences=4)`` on the same prompts
(32 tokens of Python each), alternating in one process, ``--blocks`` blocks, the order swapped
every block; medians and the median per-block ratio (transformers' time / ours). Both search
without EOS (``ignore_eos``; transformers' ``eos_token_id=None``) and rank by cumulative
log-probability (``length_penalty=0``), where the two searches are the same: the four sequences
of every prompt must be equal, or the run fails (exit 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qwen_ops import LLM, BeamSearchParams
from qwen_ops.models.defaults import default_model_path

TEXTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "import os\nimport sys\n\n\n",
         "class Stack:\n    def __init__(self):\n        self.items = []\n", "    for i in range(len(values)):\n"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import transformers

    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(None, max_model_len=512)
    params = BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True, length_penalty=0.0)
    rows = []
    for n in args.prompts:
        prompts = [llm.tokenizer.encode(t)[:32] for t in (TEXTS * 4)[:n]]

        def ours():
            outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
            return [[s.tokens[len(p):] for s in o.sequences] for p, o in zip(prompts, outs)]

        def theirs():
            got = []
            with torch.no_grad():
                for p in prompts:          # one prompt at a time: no padding to change its numbers
                    ids = torch.tensor([p])
                    g = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4, num_return_sequences=4,
                                    max_new_tokens=64, do_sample=False, length_penalty=0.0, early_stopping=False,
                                    pad_token_id=0)
                    got.append([s[len(p):].tolist() for s in g])
            return got

        if ours() != theirs():
            raise SystemExit(f"wrong tokens: beam search and transformers' differ at {n} prompts")
        times = {"ours": [], "transformers": []}
        ratios = []
        for b in range(args.blocks):
            for name, fn in ((("ours", ours), ("transformers", theirs)) if b % 2 == 0 else
                             (("transformers", theirs), ("ours", ours))):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            ratios.append(times["transformers"][-1] / times["ours"][-1])
        rows.append({"prompts": n, "beam_width": 4, "max_tokens": 64, "ours_s": statistics.median(times["ours"]),
                     "transformers_s": statistics.median(times["transformers"]), "speedup": statistics.median(ratios)})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
