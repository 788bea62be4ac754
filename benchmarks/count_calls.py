"""Python calls into ``qwen_ops`` in one ``LLM.step()`` decode iteration of the embedded model
(``sys.setprofile``; issue 61's target: below 150 for one request).

    OMP_NUM_THREADS=1 python benchmarks/count_calls.py [--requests 1 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys


def count(requests: int) -> tuple[int, collections.Counter]:
    from qwen_ops import LLM, SamplingParams

    llm = LLM(max_num_seqs=max(requests, 1))
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(requests):
        llm.add_request(f"def f{i}(x):", params)
    for _ in range(4):                   # the prefill, then a few decodes (warm)
        llm.step()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__import__("qwen_ops").__file__)))
    package = os.path.join(root, "qwen_ops") + os.sep
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls[f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        llm.step()
    finally:
        sys.setprofile(None)
    return sum(calls.values()), calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--top", type=int, default=0, help="also print the N most called functions")
    args = parser.parse_args()
    out = {}
    for n in args.requests:
        total, calls = count(n)
        out[n] = total
        print(f"{n} request(s): {total} Python calls into qwen_ops in one decode iteration")
        for name, c in calls.most_common(args.top):
            print(f"  {c:5d}  {name}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
