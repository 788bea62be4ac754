"""LoRA adapters served by the OpenAI-compatible server (qwen_ops/serving/openai/lora.py), live on
127.0.0.1 through the official ``openai`` client: a request whose ``model`` names an adapter gives
``peft.PeftModel``'s (unmerged) greedy tokens, the base name the base model's; ``/v1/models``
lists the adapters with their parent; with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` adapters load and
unload at run time while other requests stream, and without it those routes are absent.

The tiny random checkpoint gets a word-level tokenizer (``w<id>`` per token) so that served text
maps back to token ids exactly."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import torch

from qwen_ops.serving.async_llm import AsyncLLM
from qwen_ops.serving.openai.lora import LoRAModulePath

from qwen_tiny import hf_greedy, load_hf, save_tiny_checkpoint
from server_fixture import CLIENT_TIMEOUT_S, running_server, scrape

peft = pytest.importorskip("peft")

BASE = "tiny-base"
PROMPTS = [[5, 9, 33, 2], [40, 41, 42, 43, 44], [7, 7, 1]]
MAX_TOKENS = 8
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
VOCAB = 128
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE_KWARGS = dict(max_num_seqs=4, max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8)


def _save_word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def ids_of(text: str) -> list[int]:
    return [0 if m.group(0) == "[UNK]" else int(m.group(1)) for m in re.finditer(r"w(\d+)|\[UNK\]", text)]


def _make_adapter(ckpt: Path, out: Path, r: int, targets: list[str], seed: int, rslora: bool = False):
    """A PEFT adapter with random nonzero A and B (peft's own init makes B zero: no change to test)."""
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(load_hf(ckpt), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out)
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_lora")
    ckpt = save_tiny_checkpoint(root / "ckpt", "qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=512)
    _save_word_tokenizer(ckpt)
    refs = {None: load_hf(ckpt)}
    for name, r, targets, seed, rslora in (("a1", 8, ALL_TARGETS, 1, False),
                                           ("a2", 4, ["q_proj", "v_proj", "down_proj"], 2, True),
                                           ("a3", 8, ["o_proj", "up_proj"], 3, False)):
        refs[name] = _make_adapter(ckpt, root / name, r, targets, seed, rslora)
    return ckpt, root, refs


@pytest.fixture(scope="module")
def server(models):
    """The engine in its own process (the default), two adapters from startup, runtime updates on."""
    ckpt, root, _ = models
    engine = AsyncLLM.from_pretrained(ckpt, **ENGINE_KWARGS)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
            modules = [LoRAModulePath("a1", str(root / "a1")), LoRAModulePath("a2", str(root / "a2"), "the-base")]
            with running_server(engine, served_model_name=BASE, lora_modules=modules) as srv:
                yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


def _greedy(refs, name, prompt, n=MAX_TOKENS) -> list[int]:
    return hf_greedy(refs[name], prompt, n)


def _completion_ids(client, model, prompt, **kw) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, **{**GREEDY, **kw})
    assert out.model == model
    return ids_of(out.choices[0].text)


# ----------------------------------------------------------------------------- served adapters
def test_models_lists_the_adapters_with_their_parent(client, models):
    _, root, _ = models
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards)[:3] == [BASE, "a1", "a2"]
    assert (cards["a1"].root, cards["a1"].parent) == (str(root / "a1"), BASE)
    assert (cards["a2"].root, cards["a2"].parent) == (str(root / "a2"), "the-base")
    assert cards[BASE].parent is None


def test_completions_by_adapter_name_equal_peft(client, models):
    _, _, refs = models
    for name in (None, "a1", "a2"):
        for prompt in PROMPTS:
            got = _completion_ids(client, name or BASE, prompt)
            assert got == _greedy(refs, name, prompt), (name, prompt)
    assert _greedy(refs, "a1", PROMPTS[0]) != _greedy(refs, None, PROMPTS[0]), "the adapter changes nothing"


def test_chat_by_adapter_name_equals_peft(client, server, models):
    _, _, refs = models
    messages = [{"role": "user", "content": "w5 w9 w33"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    out = client.chat.completions.create(model="a2", messages=messages, **GREEDY)
    assert out.model == "a2"
    assert ids_of(out.choices[0].message.content) == _greedy(refs, "a2", ids)


def test_unknown_model_is_404_in_openai_shape(client):
    for call in (lambda: client.completions.create(model="a9", prompt=PROMPTS[0], **GREEDY),
                 lambda: client.chat.completions.create(model="a9", messages=[{"role": "user", "content": "w1"}],
                                                        **GREEDY)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["param"] == "model" and "`a9` does not exist" in e.value.body["message"]


def test_lora_requests_info_metric(server):
    families = scrape(server.url)
    (key,) = [k for k in families if k.startswith("vllm:lora_requests_info{")]
    assert "max_lora=2" in key and "running_lora_adapters=," in key


# ----------------------------------------------------------------------------- runtime updates
def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{route}", json=body, timeout=CLIENT_TIMEOUT_S)


def test_load_while_streaming_then_use_unload(client, server, models):
    _, root, refs = models
    n = 48
    stream = client.completions.create(model="a1", prompt=PROMPTS[1], stream=True, **{**GREEDY, "max_tokens": n})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    loaded = _post(server, "load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")})
    assert loaded.status_code == 200, loaded.text
    text += "".join(c.choices[0].text for c in chunks)
    assert ids_of(text) == _greedy(refs, "a1", PROMPTS[1], n), "the stream beside the load"
    assert "a3" in [m.id for m in client.models.list().data]
    assert _completion_ids(client, "a3", PROMPTS[0]) == _greedy(refs, "a3", PROMPTS[0])
    duplicate = _post(server, "load_lora_adapter", {"lora_name": "a3", "lora_path": str(root / "a3")})
    assert duplicate.status_code == 400 and "already been loaded" in duplicate.json()["error"]["message"]
    assert _post(server, "unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
    assert "a3" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt=PROMPTS[0], **GREEDY)
    again = _post(server, "unload_lora_adapter", {"lora_name": "a3"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


def test_unload_in_use_is_400_and_metric_names_it(client, server, models):
    _, _, refs = models
    n = 400
    stream = client.completions.create(model="a2", prompt=PROMPTS[2], stream=True, **{**GREEDY, "max_tokens": n})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    key = [k for k in scrape(server.url) if k.startswith("vllm:lora_requests_info{")]
    busy = _post(server, "unload_lora_adapter", {"lora_name": "a2"})
    text += "".join(c.choices[0].text for c in chunks)
    assert busy.status_code == 400 and "in use" in busy.json()["error"]["message"], busy.text
    assert key and ("running_lora_adapters=a2" in key[0] or "waiting_lora_adapters=a2" in key[0]), key
    assert ids_of(text) == _greedy(refs, "a2", PROMPTS[2], n)
    assert _completion_ids(client, "a2", PROMPTS[0]) == _greedy(refs, "a2", PROMPTS[0]), "still served"


@pytest.mark.parametrize("kind", ["missing", "corrupt"])
def test_bad_adapter_is_400_and_nothing_changes(client, server, models, tmp_path, kind):
    _, _, refs = models
    path = tmp_path / "nowhere"
    if kind == "corrupt":
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
        (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    before = [m.id for m in client.models.list().data]
    r = _post(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "lora_path" and "nowhere" in r.json()["error"]["message"]
    assert [m.id for m in client.models.list().data] == before
    assert _completion_ids(client, BASE, PROMPTS[0]) == _greedy(refs, None, PROMPTS[0])
    assert _post(server, "load_lora_adapter", {"lora_name": "bad"}).status_code == 400     # no lora_path


def test_routes_absent_without_the_env_var_thread_core(models, monkeypatch):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes are 404; the engine on a thread of this
    process (ThreadCore) serves an adapter too."""
    ckpt, root, refs = models
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    engine = AsyncLLM.from_pretrained(ckpt, engine_process=False, **ENGINE_KWARGS)
    try:
        with running_server(engine, served_model_name=BASE,
                            lora_modules=[LoRAModulePath("a3", str(root / "a3"))]) as srv:
            for route in ("load_lora_adapter", "unload_lora_adapter"):
                assert _post(srv, route, {"lora_name": "a1", "lora_path": str(root / "a1")}).status_code == 404
            with openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S) as c:
                assert _completion_ids(c, "a3", PROMPTS[2]) == _greedy(refs, "a3", PROMPTS[2])
        # ThreadCore's remove goes through the loop's inbox: the adapter (id 1) was loaded, then it is not.
        assert asyncio.run(engine.remove_lora(1)) is True
        assert asyncio.run(engine.remove_lora(1)) is False
    finally:
        engine.shutdown()


def test_cli_lora_flags(tmp_path):
    from qwen_ops.serving.cli import build_parser
    from qwen_ops.serving.engine_args import EngineArgs
    from qwen_ops.serving.openai.server import _lora_modules

    parse = build_parser().parse_args
    args = parse(["serve", "--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x",
                  '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank,
            engine_args.max_cpu_loras) == (True, 2, 16, None)
    assert _lora_modules(args) == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y", "m")]
    for argv, fragment in ((["--lora-modules", "a=/x"], "needs --enable-lora"),
                           (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "names 'a' twice")):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            _lora_modules(parse(["serve", *argv]))
    # The sizes are the engine's arguments: EngineArgs.validate names them as LLM(...) does.
    for argv, fragment in ((["--enable-lora", "--max-loras", "0"], "max_loras = 0"),
                           (["--enable-lora", "--max-lora-rank", "0"], "max_lora_rank = 0"),
                           (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras = 1")):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            EngineArgs.from_cli_args(parse(["serve", *argv])).validate()
    for bad in ("nameonly", '{"name": "a"}', '{"name": "a", "path": "/p", "rank": 2}', "[1]"):
        with pytest.raises(SystemExit):
            parse(["serve", "--enable-lora", "--lora-modules", bad])


def test_bad_lora_module_at_startup_names_it(models):
    from qwen_ops.serving.openai import build_app

    ckpt, root, _ = models
    engine = AsyncLLM.from_pretrained(ckpt, engine_process=False, **ENGINE_KWARGS)
    try:
        with pytest.raises(ValueError, match=r"--lora-modules x=/no/such/adapter"):
            build_app(engine, served_model_name=BASE, lora_modules=[LoRAModulePath("x", "/no/such/adapter")])
    finally:
        engine.shutdown()
