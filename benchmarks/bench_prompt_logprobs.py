"""What scoring a prompt costs (issue 44 item 1): the time to the first token of one prompt with
``prompt_logprobs`` against the same prompt without, alternating in one process.

    OMP_NUM_THREADS=1 python benchmarks/bench_prompt_logprobs.py [--realsize] [--lengths 2000] [--json FILE]

Default: the embedded model at 512 and 2,000 tokens (fp32). ``--realsize``: the Qwen3-0.6B-shaped
checkpoint of ``bench_realsize.py`` in bf16 (written on first use). A fresh random prompt per
repetition, no prefix caching; ``--blocks`` blocks, the order swapped every block; the ratio is the
median of the per-block ratios (with / without). The greedy first token must be the same with and
without (a wrong-token run exits 1).

The floor: scoring needs the LM head over every prompt row instead of the last one. Its share of a
prefill is about ``vocab * hidden / (per-token weights of the body + vocab * hidden)`` at the same
FLOP rate (printed as ``head_share``); attention only lowers it for long prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_ops import LLM, SamplingParams  # noqa: E402


def head_share(model) -> float:
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    return head / (body + head)


def measure(path, dtype: str, lengths, blocks: int, max_len: int) -> list[dict]:
    llm = LLM(path, dtype=dtype, max_model_len=max_len, max_num_batched_tokens=max_len, enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        plain = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        scored = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
        llm.generate([torch.randint(0, vocab, (n,), generator=g).tolist()], scored, use_tqdm=False)      # warm-up
        times = {"with": [], "without": []}
        ratios = []
        for b in range(blocks):
            prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
            got = {}
            order = (("without", plain), ("with", scored))
            for name, sp in order if b % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                out = llm.generate([prompt], sp, use_tqdm=False)[0]
                times[name].append(time.perf_counter() - t0)
                got[name] = out
            if got["with"].outputs[0].token_ids != got["without"].outputs[0].token_ids:
                raise SystemExit(f"wrong tokens: scoring changed the first token at {n} tokens")
            if len(got["with"].prompt_logprobs) != n or got["with"].prompt_logprobs[0] is not None:
                raise SystemExit(f"prompt_logprobs has {len(got['with'].prompt_logprobs)} entries, expected {n}")
            ratios.append(times["with"][-1] / times["without"][-1])
        rows.append({"prompt_tokens": n, "dtype": dtype, "ttft_without_s": statistics.median(times["without"]),
                     "ttft_with_s": statistics.median(times["with"]), "ratio": statistics.median(ratios),
                     "head_share": head_share(llm.engine.model), "blocks": blocks})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--realsize", action="store_true")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.realsize:
        from bench_realsize import default_cache_dir, make_checkpoint

        rows = measure(make_checkpoint(default_cache_dir()), "bfloat16", args.lengths or [2000], args.blocks, 4096)
    else:
        rows = measure(None, "float32", args.lengths or [512, 2000], args.blocks, 2048)
    if args.json:
        args.json.write_text(json.dumps({"machine": torch.__config__.parallel_info().splitlines()[0], "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
