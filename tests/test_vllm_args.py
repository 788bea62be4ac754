"""Issue 44 item 3: vLLM's offline arguments run unchanged: ``seed``, ``enforce_eager``,
``gpu_memory_utilization``, ``use_tqdm``, ``generation_config`` / ``get_default_sampling_params()``,
``StructuredOutputsParams`` / ``GuidedDecodingParams`` from the top, and model ids through the
Hugging Face cache. Oracle for the tokens: transformers' greedy ``generate`` on the same checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import qwen_ops
from qwen_ops import LLM, SamplingParams

from checkpoints import make_qwen3_checkpoint
from oracles import TransformersGreedy

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("vllm_args"))


@pytest.fixture(scope="module")
def oracle(ckpt):
    return TransformersGreedy(ckpt)


def sampled(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, sp, use_tqdm=False)]


def test_seed_makes_unseeded_sampling_repeat(ckpt):
    a, b, c = sampled(LLM(ckpt, seed=7)), sampled(LLM(ckpt, seed=7)), sampled(LLM(ckpt, seed=8))
    assert a == b
    assert a != c
    assert a[0] != a[2] or a[1] != a[3]        # one generator for the LLM: a second draw is new noise


@pytest.mark.parametrize("kwargs, match", [
    ({"seed": "1"}, "seed = '1'"), ({"seed": True}, "seed = True"),
    ({"enforce_eager": 1}, "enforce_eager = 1"), ({"enforce_eager": True, "compile": True}, "compile = True"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization = 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization = 1.5"),
    ({"generation_config": "/no/such/dir"}, "generation_config = '/no/such/dir'"),
])
def test_bad_arguments_name_themselves(ckpt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(ckpt, **kwargs)


def test_enforce_eager_and_gpu_memory_utilization(ckpt, oracle):
    llm = LLM(ckpt, enforce_eager=True)
    assert not llm.engine.runner.compiled and not llm.engine.runner.cuda_graphs
    # On the CPU gpu_memory_utilization is vLLM-CPU's: the share of the RAM the process may hold, the KV cache
    # getting what is left of it (tests/test_vllm_engine_args.py checks the amount); here a share that leaves
    # about 64 MiB for it.
    total = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    half = LLM(ckpt, gpu_memory_utilization=(rss + (64 << 20)) / total, max_num_seqs=100000, max_model_len=64)
    outs = half.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [oracle(p, 6) for p in PROMPTS]


def test_use_tqdm(ckpt, capsys):
    llm = LLM(ckpt)
    sp = SamplingParams(temperature=0, max_tokens=3)
    llm.generate(PROMPTS, sp, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate(PROMPTS, sp)                               # on by default, as vLLM
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "toks/s" in err

    seen = {}

    class Recorder:                                         # a tqdm-like class, as vLLM accepts
        def __init__(self, total, **kwargs):
            seen["total"], seen["n"], self.postfix = total, 0, None

        def update(self, n):
            seen["n"] += n

        def close(self):
            seen["closed"] = True

    llm.generate(PROMPTS + PROMPTS[:1], sp, use_tqdm=Recorder)
    assert seen == {"total": 3, "n": 3, "closed": True}


def test_generation_config_defaults(ckpt, tmp_path, oracle):
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt, path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5, "top_k": 20,
                                                             "eos_token_id": 1}))
    llm = LLM(path)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.max_tokens, d.top_k) == (0.0, 5, 20)
    out = llm.generate(PROMPTS, use_tqdm=False)                     # no SamplingParams: the checkpoint's
    assert [o.outputs[0].token_ids for o in out] == [oracle(p, 5, eos=[1]) for p in PROMPTS]
    plain = LLM(path, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.max_tokens, plain.top_k) == (1.0, 16, -1)


def test_structured_outputs_names_from_the_top():
    assert qwen_ops.GuidedDecodingParams is qwen_ops.StructuredOutputsParams
    sp = SamplingParams(guided_decoding=qwen_ops.GuidedDecodingParams(choice=["yes", "no"]))
    assert sp.structured_outputs.choice == ("yes", "no")
    with pytest.raises(ValueError, match="guided_decoding and structured_outputs"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def fake_hub_cache(root, repo_id: str, checkpoint) -> None:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(checkpoint, repo / "snapshots" / commit)


def test_model_id_from_the_hugging_face_cache(ckpt, tmp_path, monkeypatch, oracle):
    from huggingface_hub import constants

    fake_hub_cache(tmp_path, "tiny-org/tiny-qwen3", ckpt)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    llm = LLM("tiny-org/tiny-qwen3")
    assert llm.model_path.parent.name == "snapshots"
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [oracle(p, 6) for p in PROMPTS]
    with pytest.raises(ValueError, match=r"model = 'tiny-org/missing' is not a directory and not in the Hugging "
                                         r"Face cache .*HF_HUB_OFFLINE"):
        LLM("tiny-org/missing")


def test_server_fills_unset_fields_from_generation_config(tmp_path):
    """vLLM's server: a request's unset sampling fields take the checkpoint's generation_config
    (here greedy, 5 tokens); set fields win. Oracle: transformers' greedy tokens of the prompt the
    server renders (its own /tokenize). The engine runs in its own process, as qwen-ops serve's."""
    import httpx
    import torch
    import transformers

    from qwen_ops.models.defaults import default_model_path
    from qwen_ops.serving.async_llm import AsyncLLM
    from server_fixture import running_server

    path = tmp_path / "model"
    shutil.copytree(default_model_path(), path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5,
                                                             "eos_token_id": [2, 0]}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = AsyncLLM.from_pretrained(str(path), max_num_seqs=4, max_model_len=256)
    try:
        with running_server(engine, served_model_name="m") as srv:
            messages = [{"role": "user", "content": "Write a loop."}]
            ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
            r = httpx.post(srv.base_url + "/chat/completions", json={"model": "m", "messages": messages}, timeout=60)
            assert r.status_code == 200, r.text
            with torch.no_grad():
                want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=5, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
            got = r.json()
            assert got["usage"]["completion_tokens"] == len(want) <= 5
            assert got["choices"][0]["message"]["content"] == engine.tokenizer.decode(want)
            longer = httpx.post(srv.base_url + "/chat/completions", timeout=60, json={
                "model": "m", "messages": messages, "max_tokens": 9, "temperature": 0, "ignore_eos": True})
            assert longer.json()["usage"]["completion_tokens"] == 9                  # set fields win
    finally:
        engine.shutdown()
