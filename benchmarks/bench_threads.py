"""The main job (``qwen-ops generate`` on the embedded model) with the default thread count
against one thread and against torch's one-thread-per-core pool, on a quiet machine and with a
competing busy process on another core. Issue 25: the default must never be catastrophically
slower than one thread when other processes compete for the cores.

    python benchmarks/bench_threads.py --repeats 5

Each run is a fresh ``qwen-ops generate`` (64 greedy tokens); the runs of all settings are
interleaved, and the table gives the median tokens/s of each, and its ratio to one thread in the
same condition. The tokens are checked too: every run must print the same completion.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys

PROMPT = "def fibonacci(n):"
RATE = re.compile(r"\[(\d+) tokens in [\d.]+ s: ([\d.]+) tokens/s")
BUSY = "while True:\n    pass\n"


def settings() -> dict[str, dict[str, str]]:
    cores = str(os.cpu_count() or 1)
    return {"default": {}, "one thread (OMP_NUM_THREADS=1)": {"OMP_NUM_THREADS": "1"},
            f"torch's pool ({cores} threads)": {"QWEN_OPS_CPU_THREADS": cores}}


def run_once(extra: dict[str, str], max_tokens: int) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "QWEN_OPS_CPU_THREADS")}
    env.update(extra)
    exe = shutil.which("qwen-ops") or sys.executable
    cmd = ([exe] if exe.endswith("qwen-ops") else [exe, "-m", "qwen_ops.serving.cli"]) + \
        ["generate", "--max-tokens", str(max_tokens), PROMPT]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    m = RATE.search(out.stdout)
    if m is None:
        raise RuntimeError(f"no tokens/s line in:\n{out.stdout[-1000:]}")
    return float(m.group(2)), out.stdout[:m.start()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    rates: dict[tuple[str, str], list[float]] = {}
    texts = set()
    for condition in ("quiet", "busy core"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if condition == "busy core" else None
        try:
            for _ in range(args.repeats):
                for name, extra in settings().items():
                    rate, text = run_once(extra, args.max_tokens)
                    rates.setdefault((condition, name), []).append(rate)
                    texts.add(text)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    if len(texts) != 1:
        print(f"error: the runs printed {len(texts)} different completions", file=sys.stderr)
        return 1
    print(f"{'condition':<10}  {'threads':<34}  {'median tok/s':>12}  {'vs one thread':>13}  runs")
    for condition in ("quiet", "busy core"):
        one = statistics.median(rates[(condition, "one thread (OMP_NUM_THREADS=1)")])
        for name in settings():
            values = rates[(condition, name)]
            med = statistics.median(values)
            runs = " ".join(f"{v:.0f}" for v in values)
            print(f"{condition:<10}  {name:<34}  {med:>12.1f}  {med / one:>12.2f}x  {runs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
