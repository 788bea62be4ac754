"""qwen_ops on Ray (qwen_ops/serving/ray/): the Ray Serve application and the Ray Data processor,
on one local Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``).

Oracles: the embedded model offline in this process (one ``LLM``, no Ray: ``LLM.generate`` /
``LLM.chat`` greedy), and Ray's node list (``ray.nodes()``) for where the replicas run (each
response names its replica's actor and the node Ray's runtime context says it is on). The argument
checks run without a cluster.

Skipped where Ray is not installed; CI installs it (``.[test]``) and runs these.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import openai  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from qwen_ops.engine.sampling import SamplingParams  # noqa: E402
from qwen_ops.serving.ray import QwenEngineProcessorConfig, build_llm_processor, build_openai_app  # noqa: E402
from qwen_ops.serving.ray import openai_deployment  # noqa: E402
from qwen_ops.serving.ray.data import REQUEST_COLUMN, request_of  # noqa: E402
from qwen_ops.serving.ray.dependency import INSTALL_HINT  # noqa: E402
from qwen_ops.serving.ray.replica import NODE_HEADER, REPLICA_HEADER  # noqa: E402
from server_fixture import ENGINE_KWARGS, SERVED_NAME  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self):"]
MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Write a function that adds two numbers."}]
NODE_CPUS = 4            # logical CPUs per simulated node: both Serve replicas and both Data actors fit at once
OBJECT_STORE_BYTES = 100 << 20
TESTS = Path(__file__).resolve().parent
MAX_ONGOING = 2          # requests a Serve replica holds at once


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node on this machine, joined by this process; Serve and Ray stopped after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")            # no network from the tests
        mp.setenv("OMP_NUM_THREADS", "1")                    # each Ray worker's torch: one thread
        # Ray's workers import this checkout's qwen_ops, and this module (the Data test's row functions)
        paths = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
        try:
            nodes.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES)
            nodes.wait_for_nodes()
            ray.init(address=nodes.address, logging_level="ERROR", log_to_driver=False)
            yield nodes
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                nodes.shutdown()


@pytest.fixture(scope="module")
def offline():
    from qwen_ops.serving.llm import LLM

    return LLM(None, **ENGINE_KWARGS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(cluster):
    """``build_openai_app(num_replicas=2)`` behind Serve's proxy (on the head node only: both simulated
    nodes share this machine's ports), at most one replica a node. Serve's router prefers the replica on
    the proxy's node; ``max_ongoing_requests`` = 2 makes it use the other one past two requests at once."""
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    app = build_openai_app(ENGINE_KWARGS, served_model_name=SERVED_NAME, num_replicas=2, max_replicas_per_node=1,
                           max_ongoing_requests=MAX_ONGOING)
    serve.run(app, name="qwen", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_serve_replicas_greedy_equal_offline_and_spread_over_nodes(serve_url, offline, cluster):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = {o.prompt: o.outputs[0] for o in offline.generate(PROMPTS, greedy, use_tqdm=False)}
    client = _client(serve_url + "/v1")

    def complete(prompt):
        raw = client.completions.with_raw_response.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                          temperature=0)
        return prompt, (raw.headers[REPLICA_HEADER], raw.headers[NODE_HEADER]), raw.parse()

    with ThreadPoolExecutor(4 * MAX_ONGOING) as pool:   # more at once than one replica takes: both must serve
        answers = list(pool.map(complete, PROMPTS * 4))
    for prompt, _, reply in answers:
        assert reply.choices[0].text == expected[prompt].text, prompt
        assert reply.usage.completion_tokens == len(expected[prompt].token_ids), prompt
    replicas = {replica for _, replica, _ in answers}
    assert len(replicas) == 2, f"every request went to one replica: {replicas}"
    nodes = {node for _, node in replicas}
    assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]}, f"the replicas are not one a node: {replicas}"

    chat = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    (want,) = offline.chat(CHAT, greedy, use_tqdm=False)
    assert chat.choices[0].message.content == want.outputs[0].text


def test_serve_autoscaling_app(serve_url, offline):
    """An autoscaling config (min 1, max 2) deploys: one replica to start, which answers as offline."""
    app = build_openai_app(ENGINE_KWARGS, served_model_name="autoscaled", engine_process=False,
                           autoscaling_config={"min_replicas": 1, "max_replicas": 2})
    serve.run(app, name="autoscaled", route_prefix="/autoscaled")
    try:
        (deployment,) = serve.status().applications["autoscaled"].deployments.values()
        assert deployment.replica_states == {"RUNNING": 1}, deployment
        reply = _client(serve_url + "/autoscaled/v1").completions.create(
            model="autoscaled", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        (want,) = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert reply.choices[0].text == want.outputs[0].text
    finally:
        serve.delete("autoscaled")


def _rows() -> list[dict]:
    """12 rows: a prompt or a chat each, with its own greedy length, so a row given another's (or no)
    sampling parameters shows."""
    rows = []
    for i in range(12):
        text = PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" # {i}")
        rows.append({"id": i, "text": text, "chat": i % 3 == 0, "max_tokens": 3 + i % 7})
    return rows


def _preprocess(row: dict) -> dict:
    chat = [{"role": "user", "content": row["text"]}] if row["chat"] else None
    return {**row, "prompt": None if chat else row["text"], "messages": chat,
            "sampling_params": {"temperature": 0.0, "max_tokens": int(row["max_tokens"])}}


def _postprocess(row: dict) -> dict:
    return {"id": row["id"], "text": row["generated_text"], "tokens": [int(t) for t in row["generated_tokens"]],
            "num_input_tokens": row["num_input_tokens"], "num_generated_tokens": row["num_generated_tokens"],
            "engine": row["engine_actor_id"]}


def test_data_processor_equals_offline_row_by_row(cluster, offline):
    config = QwenEngineProcessorConfig(engine_kwargs=ENGINE_KWARGS, concurrency=2, batch_size=3)
    processor = build_llm_processor(config, preprocess=_preprocess, postprocess=_postprocess)
    rows = _rows()
    out = sorted(processor(ray.data.from_items(rows, override_num_blocks=4)).take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    for row, got in zip(rows, out):
        params = SamplingParams(temperature=0.0, max_tokens=row["max_tokens"])
        if row["chat"]:
            (want,) = offline.chat([{"role": "user", "content": row["text"]}], params, use_tqdm=False)
        else:
            (want,) = offline.generate(row["text"], params, use_tqdm=False)
        assert got["tokens"] == list(want.outputs[0].token_ids), row
        assert got["text"] == want.outputs[0].text, row
        assert got["num_input_tokens"] == len(want.prompt_token_ids), row
        assert got["num_generated_tokens"] == len(want.outputs[0].token_ids), row
    assert len({r["engine"] for r in out}) == 2, "one engine actor did every batch"


# ---------------------------------------------------------------------- checks without a cluster
@pytest.mark.parametrize("options, match", [
    ({"num_replicas": 2, "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}, "expected one of them"),
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "not a valid Ray Serve autoscaling config"),
    ({"autoscaling_config": {"min_replica": 1, "max_replicas": 2}}, r"unknown key\(s\) \['min_replica'\]"),
    ({"autoscaling_config": [1, 2]}, "expected a dict"),
    ({"num_replicas": 0}, r"num_replicas = 0, expected an int >= 1"),
    ({"ray_actor_options": "cpu"}, "ray_actor_options = 'cpu'"),
    ({"app_kwargs": {"lora_modules": []}}, "not served on Ray yet"),
    ({"app_kwargs": {"api_kee": "k"}}, r"app_kwargs\['api_kee'\] is not a keyword of build_app"),
    ({"engine_process": False, "num_threads": 2}, "num_threads = 2 with engine_process = False"),
])
def test_openai_deployment_refuses_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        openai_deployment(ENGINE_KWARGS, **options)


def test_openai_deployment_options():
    fixed = openai_deployment(ENGINE_KWARGS, num_replicas=3)
    assert (fixed.num_replicas, fixed.ray_actor_options) == (3, {"num_cpus": 1})
    scaled = openai_deployment(ENGINE_KWARGS, autoscaling_config={"min_replicas": 1, "max_replicas": 2})
    assert scaled.num_replicas != 3       # Serve's own count is not a fixed one with autoscaling
    with pytest.raises(ValueError, match=r"engine_args = \{'max_model_lenn': 512\}.*did you mean 'max_model_len'"):
        openai_deployment({"max_model_lenn": 512})
    with pytest.raises(ValueError, match="data_parallel_size = 2, but a replica is one engine"):
        openai_deployment({"data_parallel_size": 2})


@pytest.mark.parametrize("kwargs, match", [
    ({"concurrency": 0}, "concurrency = 0"),
    ({"concurrency": (2, 1)}, r"concurrency = \(2, 1\)"),
    ({"batch_size": 0}, "batch_size = 0"),
    ({"num_cpus_per_actor": 0}, "num_cpus_per_actor = 0"),
    ({"engine_kwargs": {"model": "x"}}, "model=, not in engine_kwargs"),
    ({"engine_kwargs": {"data_parallel_size": 2}}, "an actor holds one engine"),
])
def test_processor_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QwenEngineProcessorConfig(**kwargs)


@pytest.mark.parametrize("row, match", [
    ({"text": "x"}, "neither of 'prompt' and 'messages'"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "both 'prompt' and 'messages'"),
    ({"prompt": 3}, r"row\['prompt'\] = 3, expected a str"),
    ({"prompt": "x", "sampling_params": {"max_tokens": 0}}, r"row\['sampling_params'\] = \{'max_tokens': 0\}"),
    ({"prompt": "x", "sampling_params": {"max_tokenz": 4}}, "max_tokenz"),
])
def test_request_of_refuses_bad_rows(row, match):
    with pytest.raises(ValueError, match=match):
        request_of(row)


def test_request_of_plain_json():
    """What Ray Data hands a row (numpy arrays for lists, numpy ints) becomes plain JSON types."""
    import numpy as np

    row = {"messages": np.array([{"role": "user", "content": "hi"}], dtype=object),
           "sampling_params": {"max_tokens": np.int64(4), "stop": np.array(["\n"])}, REQUEST_COLUMN: "old"}
    assert request_of(row) == {"messages": [{"role": "user", "content": "hi"}],
                               "sampling_params": {"max_tokens": 4, "stop": ["\n"]}}


def test_import_needs_no_ray_and_missing_ray_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"            # as if Ray were not installed
            "import qwen_ops.serving.ray as r\n"
            "try:\n    r.build_openai_app()\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert INSTALL_HINT in done.stdout, done.stdout
