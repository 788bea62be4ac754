"""Structured outputs against unconstrained sampling, in one run, on the embedded model (issue 30).

32 requests at once (temperature 1.0, seeded, ``--new-tokens`` at most): a JSON schema (nested
object, enum, bounded strings and array), and the same requests unconstrained (``ignore_eos``, so
both generate about as many tokens). Engines alternate (constrained, unconstrained, ...), medians
of ``--repeats``. Reported: generated tokens/s, the ratio, time to first token (p50), and the
same constrained run with the bitmask always filled on the worker thread beside the forward pass
(the default does that only for fills slower than ``sampler.GRAMMAR_OVERLAP_MIN_S``). Every constrained output that ends must validate against the schema
(``jsonschema``), or the script exits 1; outputs cut by ``max_tokens`` are counted apart.

    OMP_NUM_THREADS=1 python benchmarks/bench_structured.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from qwen_ops import LLM, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "color", "tags", "address"],
}


def run(llm: LLM, n: int, new_tokens: int, constrained: bool) -> dict:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=new_tokens, ignore_eos=not constrained,
                             structured_outputs={"json": SCHEMA} if constrained else None) for s in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(["A person as JSON: "] * n, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ttft = statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return {"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "ttft": ttft,
            "texts": [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"],
            "cut": sum(o.outputs[0].finish_reason == "length" for o in outs)}


def main(argv=None) -> int:
    import jsonschema

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from qwen_ops.engine import sampler as R

    llm = LLM(max_num_seqs=args.requests)
    runner = llm.engine.runner.sampler
    cases = {"unconstrained": False, "json schema": True, "json schema, mask always beside the forward": True}
    for name, c in cases.items():                                  # warm up (and compile the schema once)
        run(llm, 4, 8, c)
    res = {name: [] for name in cases}
    bad = cut = 0
    for _ in range(args.repeats):
        for name, c in cases.items():
            # "beside": the worker thread whatever the fill costs; else the default threshold.
            runner.grammar_overlap_min_s = -1.0 if "beside" in name else R.GRAMMAR_OVERLAP_MIN_S
            r = run(llm, args.requests, args.new_tokens, c)
            res[name].append(r)
            if c:
                cut += r["cut"]
                for text in r["texts"]:
                    try:
                        jsonschema.validate(json.loads(text), SCHEMA)
                    except Exception:                              # noqa: BLE001 - counted, reported
                        bad += 1
    runner.grammar_overlap_min_s = R.GRAMMAR_OVERLAP_MIN_S
    rows = {}
    for name, rs in res.items():
        tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        rows[name] = {"tok_s": tps, "ttft_ms": 1000 * statistics.median(r["ttft"] for r in rs),
                      "tokens": statistics.median(r["tokens"] for r in rs)}
    base = rows["unconstrained"]
    print(f"embedded model, {args.requests} requests at once, temperature 1.0, <= {args.new_tokens} tokens each; "
          f"medians of {args.repeats}, interleaved; grammar compiles: {llm.core.grammar_backend().compiles}")
    print("\n| case | tok/s | vs unconstrained | TTFT p50 (ms) | vs unconstrained | tokens |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['tok_s']:.0f} | {r['tok_s'] / base['tok_s']:.2f}x | {r['ttft_ms']:.1f} | "
              f"{r['ttft_ms'] / base['ttft_ms']:.2f}x | {r['tokens']:.0f} |")
    print(f"\nconstrained outputs that ended (stop) and do not validate: {bad}; cut by max_tokens: {cut}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "invalid": bad, "requests": args.requests,
                                         "new_tokens": args.new_tokens}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
