"""Data-parallel serving (qwen_ops/serving/data_parallel.py): a real ``qwen-ops serve
--data-parallel-size 2`` subprocess, driven through the official ``openai`` client and read
through ``/metrics`` (each replica's samples under vLLM's ``engine`` label).

Oracles: greedy text of one engine offline (``LLM.generate``, no balancer, no second replica);
each replica's own engine counters (iterations, prefix-cache hits), which the balancer never
writes. The routing policy itself is tested on a fake replica set in tests/test_balancer.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from qwen_ops.engine.sampling import SamplingParams
from server_fixture import ENGINE_KWARGS, SERVED_NAME, cli_server_port, scrape, stop_cli_server

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self):"]
MAX_TOKENS = 12
NUM_CHATS = 20
BLOCK = 16


@pytest.fixture(scope="module")
def dp_server():
    """``qwen-ops serve -dp 2 --threads-per-replica 1``: (base url, its start-up lines)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "qwen_ops.serving.cli", "serve", "--port", "0",
                             "-dp", "2", "--threads-per-replica", "1", "--disable-log-stats",
                             "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
                             "--max-num-seqs", str(ENGINE_KWARGS["max_num_seqs"])],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        port, seen = cli_server_port(proc, timeout_s=180.0)
        yield f"http://127.0.0.1:{port}", seen
    finally:
        stop_cli_server(proc)


@pytest.fixture(scope="module")
def client(dp_server):
    with openai.OpenAI(base_url=dp_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    from qwen_ops.serving.llm import LLM

    return LLM(None, **ENGINE_KWARGS)


def per_engine(url: str, name: str) -> dict[str, float]:
    """``name``'s samples in ``/metrics``, by engine label (prometheus_client's parse)."""
    out = {}
    for key, value in scrape(url).items():
        m = re.fullmatch(re.escape(name) + r"\{engine=(\d+)\}", key)
        if m:
            out[m.group(1)] = value
    return out


def test_startup_line_and_engine_labels(dp_server):
    url, seen = dp_server
    (summary,) = [line for line in seen if line.startswith("qwen-ops serve: ")]
    assert "2 threads in 2 data-parallel replicas" in summary, summary
    assert sorted(per_engine(url, "vllm:kv_cache_blocks_total")) == ["0", "1"]
    assert sorted(per_engine(url, "qwen_ops:num_requests_running")) == ["0", "1"]


def test_greedy_equals_one_engine_offline(client, offline):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:       # concurrently: both replicas serve some
        got = list(pool.map(lambda p: client.completions.create(model=SERVED_NAME, prompt=p, temperature=0,
                                                                max_tokens=MAX_TOKENS), PROMPTS))
    assert [g.choices[0].text for g in got] == expected
    assert all(g.usage.completion_tokens == MAX_TOKENS for g in got)
    streamed = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=MAX_TOKENS,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected[0]


def test_seeded_sampling_is_the_same_on_every_replica(client):
    kw = dict(model=SERVED_NAME, prompt=PROMPTS[2], temperature=1.0, seed=11, max_tokens=MAX_TOKENS)
    with ThreadPoolExecutor(4) as pool:                   # at once: spread over both replicas
        texts = list(pool.map(lambda _: client.completions.create(**kw).choices[0].text, range(4)))
    assert len(set(texts)) == 1, texts


def test_every_replica_gets_work_under_concurrency(dp_server, client):
    url = dp_server[0]
    before = per_engine(url, "qwen_ops:iteration_tokens_total_count")
    prompts = [f"# task {i}\ndef solve_{i}(values):" for i in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=24, temperature=0),
                      prompts))
    after = per_engine(url, "qwen_ops:iteration_tokens_total_count")
    assert sorted(after) == ["0", "1"]
    assert all(after[e] > before.get(e, 0) for e in after), (before, after)


def _first_turn(i: int) -> list[dict]:
    # long enough for several full 16-token blocks, and unlike any other chat's from the first token
    return [{"role": "user", "content": f"Chat number {i}: " + " ".join(f"item{i}_{k}" for k in range(24))
             + ". Write a short Python function that sums them."}]


def test_second_turns_land_on_the_replica_of_the_first(dp_server, client):
    url = dp_server[0]
    chats = [_first_turn(i) for i in range(NUM_CHATS)]
    queries0 = per_engine(url, "qwen_ops:prefix_cache_queries_total")
    with ThreadPoolExecutor(NUM_CHATS) as pool:               # concurrent first turns spread over the replicas
        answers = list(pool.map(lambda m: client.chat.completions.create(model=SERVED_NAME, messages=m,
                                                                         temperature=0, max_tokens=8), chats))
    queries1 = per_engine(url, "qwen_ops:prefix_cache_queries_total")
    assert all(queries1[e] > queries0.get(e, 0) for e in ("0", "1")), (queries0, queries1)   # both served some
    for i, (messages, answer) in enumerate(zip(chats, answers)):
        first_blocks = answer.usage.prompt_tokens // BLOCK
        second = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                             {"role": "user", "content": "Now make it return the mean instead."}]
        hits0 = per_engine(url, "qwen_ops:prefix_cache_hits_total")
        client.chat.completions.create(model=SERVED_NAME, messages=second, temperature=0, max_tokens=4)
        hits1 = per_engine(url, "qwen_ops:prefix_cache_hits_total")
        gained = {e: hits1[e] - hits0.get(e, 0) for e in hits1}
        # Only the replica that ran the first turn holds its blocks: the second turn found them there.
        assert sorted(gained.values())[0] == 0 and max(gained.values()) >= (first_blocks - 1) * BLOCK, (i, gained)


def test_greedy_equals_transformers(client):
    """The outside oracle: transformers' greedy ``generate`` on the embedded checkpoint."""
    import torch
    import transformers

    from qwen_ops.models.defaults import default_model_path

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path())
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: client.completions.create(model=SERVED_NAME, prompt=p, temperature=0,
                                                                max_tokens=MAX_TOKENS), PROMPTS))
    for prompt, g in zip(PROMPTS, got):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert g.choices[0].text == tok.decode(out[0, ids.shape[1]:]), prompt


def test_offline_llm_data_parallel(offline):
    """``LLM(data_parallel_size=2)``: two engine processes; greedy outputs in prompt order equal one
    engine's, both replicas ran some, and what needs a local engine names the argument."""
    from qwen_ops import LLM
    from qwen_ops.serving.llm import LLM as OneEngine

    with pytest.raises(ValueError, match=r"data_parallel_size = 2, but this LLM class .*runs one engine"):
        OneEngine(None, data_parallel_size=2)
    prompts = [f"# {i}\n" + p for i in range(3) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    llm = LLM(None, data_parallel_size=2, **ENGINE_KWARGS)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.prompt for o in got] == prompts
        assert [list(o.outputs[0].token_ids) for o in got] == [list(e) for e in expected]
        assert all(r["num_iterations"] > 0 for r in llm.stats()["replicas"])
        chat = [{"role": "user", "content": "Say hi."}]
        assert llm.chat(chat, params, use_tqdm=False)[0].outputs[0].text == \
            offline.chat(chat, params, use_tqdm=False)[0].outputs[0].text
        with pytest.raises(ValueError, match=r"data_parallel_size = 2: .*\(\.add_requests\)"):
            llm.add_request("x")
    finally:
        llm.shutdown()


def test_health_reports_each_replica(dp_server):
    import httpx

    body = httpx.get(dp_server[0] + "/health", timeout=10).json()
    assert [r["engine"] for r in body["replicas"]] == [0, 1]
    assert all(r["running"] and r["state"] == "running" and r["pid"] for r in body["replicas"])


def test_merge_stats_sums_counts_and_recomputes_ratios():
    from qwen_ops.serving.data_parallel import merge_stats

    a = {"num_running": 1, "num_iterations": 10, "mean_batch_size": 2.0, "prefix_cache_queries": 100,
         "prefix_cache_hits": 50, "prefix_cache_hit_rate": 0.5, "iteration_tokens_buckets": [1, 2],
         "block_size": 16, "dtype": "float32", "lora_running": ["x"], "prefix_caching": True}
    b = {"num_running": 3, "num_iterations": 30, "mean_batch_size": 4.0, "prefix_cache_queries": 300,
         "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "iteration_tokens_buckets": [3, 4],
         "block_size": 16, "dtype": "float32", "lora_running": ["y"], "prefix_caching": True}
    m = merge_stats([a, b])
    assert (m["num_running"], m["num_iterations"], m["iteration_tokens_buckets"]) == (4, 40, [4, 6])
    assert m["mean_batch_size"] == (2.0 * 10 + 4.0 * 30) / 40 and m["prefix_cache_hit_rate"] == 50 / 400
    assert (m["block_size"], m["dtype"], m["lora_running"], m["prefix_caching"]) == (16, "float32", ["x", "y"], True)
    assert m["replicas"] == [a, b]


def test_replica_cpus_pins_only_where_each_gets_its_own():
    from qwen_ops.serving.data_parallel import replica_cpus

    assert replica_cpus(2, 1, [4, 5]) == [[4], [5]]
    assert replica_cpus(2, 2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert replica_cpus(2, 2, [0, 1, 2]) == [None, None]


@pytest.mark.parametrize("argv,message", [
    (["serve", "-dp", "0"], "data_parallel_size = 0, expected an int >= 1"),
    (["serve", "-dp", "2", "--no-engine-process"], "--data-parallel-size = 2 with --no-engine-process"),
    (["serve", "--threads-per-replica", "0"], "--threads-per-replica = 0, expected >= 1"),
])
def test_serve_rejects_bad_data_parallel_flags(argv, message, capsys, monkeypatch):
    from qwen_ops_cli import main

    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    assert main(argv + ["--port", "0"]) == 2
    assert message in capsys.readouterr().err
