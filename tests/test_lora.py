"""Multi-LoRA (issue 45) against the outside oracle: transformers + ``peft.PeftModel`` (unmerged), on tiny
random checkpoints with adapters made by peft (random, nonzero A and B; several ranks and target sets;
rsLoRA), saved with ``save_pretrained``. Mixed batches (the base model and several adapters, more
adapters than ``max_loras``), the CPU fast path and the plain forwards, the dense, MoE and hybrid
families, prefix caching, preemption (recompute and swap), n-gram speculation, compiled decode; PEFT
fields that are not served fail with errors naming them; a slow adapter parse holds only its own request.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from checkpoints import make_lora_adapter as make_adapter, make_moe_checkpoint, make_qwen3_5_checkpoint  # noqa: E402
from qwen_tiny import hf_greedy, load_hf, new_kv_caches, save_tiny_checkpoint, shuffled_block_table, step_metadata  # noqa: E402

import qwen_ops  # noqa: E402
from qwen_ops import LLM, LoRARequest, SamplingParams  # noqa: E402
from qwen_ops.models import lora as LM  # noqa: E402
from qwen_ops.models.layers import forward_choices  # noqa: E402
from qwen_ops.models.loader import load_model  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class PeftGreedy:
    """Greedy tokens of the base model or of ``PeftModel(base, adapter)`` (unmerged), per prompt."""

    def __init__(self, base: Path):
        self.base = base
        self.models = {None: load_hf(base)}

    def __call__(self, adapter, prompt, n):
        if adapter not in self.models:
            self.models[adapter] = peft.PeftModel.from_pretrained(load_hf(self.base), str(adapter)).eval()
        return hf_greedy(self.models[adapter], prompt, n)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_checkpoint(root / "base", "qwen3", vocab_size=128, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=256, eos_token_id=1)
    adapters = [make_adapter(base, root / "a1", 8, ALL, 1),
                make_adapter(base, root / "a2", 4, ["q_proj", "v_proj", "down_proj"], 2, rslora=True),
                make_adapter(base, root / "a3", 16, "model\\.layers\\.1\\..*(gate|up|o)_proj", 3),
                make_adapter(base, root / "a4", 2, ALL, 4, layers_to_transform=[0])]
    return base, adapters, PeftGreedy(base)


def _requests(adapters):
    return [LoRARequest(f"a{i + 1}", i + 1, str(a)) for i, a in enumerate(adapters)]


PROMPTS = [[5, 9, 33, 2], [7, 7, 1], [40, 41, 42, 43, 44], [5, 9, 33, 2, 8], [3] * 20, [11, 12], [60, 2, 61, 3, 62, 4]]


def _check(llm, dense, picks, prompts=PROMPTS, sp=GREEDY):
    base, adapters, oracle = dense
    reqs = _requests(adapters)
    loras = [None if i is None else reqs[i] for i in picks]
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    for p, i, o in zip(prompts, picks, outs):
        assert o.outputs[0].token_ids == oracle(None if i is None else adapters[i], p, sp.max_tokens), (p, i)
    return outs


# ------------------------------------------------------------------------------------------------
# The model's forward: one batch, every row its own adapter
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_mixed_batch_logits_equal_peft(dense, backend):
    """One forward over rows of three adapters and the base model (CPU fast path: deltas after the
    packed products; reference: the plain forwards) gives each row peft's logits."""
    base, adapters, oracle = dense
    with qwen_ops.use_backend(backend):
        model = load_model(base)
        ctx = LM.enable_lora(model, 4, 16, 64)
        model.process_weights_after_loading()
    names = LM.lora_module_names(model)
    for slot, a in ((0, adapters[0]), (1, adapters[2]), (3, adapters[1])):
        LM.write_adapter(model, slot, LM.load_peft_adapter(a, names, 16))
    prompts, slots = PROMPTS[:5], [0, -1, 3, 1, 0]
    table = shuffled_block_table(len(prompts), 8)
    positions, attn, _ = step_metadata([(i, 0, len(p)) for i, p in enumerate(prompts)], table)
    ctx.set_indices(torch.tensor([s for p, s in zip(prompts, slots) for _ in p], dtype=torch.int32))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    with torch.no_grad(), qwen_ops.use_backend(backend):
        logits = model(torch.tensor([t for p in prompts for t in p]), positions, attn,
                       new_kv_caches(model.config, 41, 4, torch.float32), ends)
    by_slot = {0: adapters[0], 1: adapters[2], 3: adapters[1], -1: None}
    for i, (p, s) in enumerate(zip(prompts, slots)):
        oracle(by_slot[s], p, 1)
        with torch.no_grad():
            want = oracle.models[by_slot[s]](torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)


def test_engine_mixed_batch_more_adapters_than_slots(dense):
    """Four adapters and the base model in one generate, two slots: every request's greedy tokens are
    peft's; adapters wait for a slot without holding up the others."""
    llm = LLM(str(dense[0]), enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64)
    _check(llm, dense, [0, None, 1, 2, 3, 0, None])
    assert llm.engine.lora.num_loads >= 4
    # host memory: max_cpu_loras (= max_loras = 2) least recently used, past it only adapters in slots
    assert llm.list_loras() <= {1, 2, 3, 4} and len(llm.list_loras()) <= 2 + 2


def test_one_slot_plain_forwards_and_chunked_prefill(dense):
    """``max_loras=1`` (adapters take turns), every layer on its plain forward, 3-token prefill chunks."""
    with qwen_ops.use_backend("reference"):           # every layer chooses its plain forward, once
        llm = LLM(str(dense[0]), enable_lora=True, max_loras=1, max_lora_rank=16, max_num_seqs=3, max_model_len=64,
                  max_num_batched_tokens=3)
    assert set(forward_choices(llm.engine.model).values()) <= {"native", "int8"}
    _check(llm, dense, [1, 0, None, 1, 2, 3, 0])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_adapter(dense, mode):
    """A KV cache too small for every request: preempted requests come back with their own adapters."""
    llm = LLM(str(dense[0]), enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=48,
              block_size=4, num_kv_blocks=14, preemption_mode=mode, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    _check(llm, dense, [0, 1, None, 2, 0, 1, 3], sp=sp)
    assert llm.scheduler.num_preemptions > 0


def test_prefix_cache_never_shares_blocks_across_adapters(dense):
    """The same 16-token prompt under two adapters and the base: no block of one serves another
    (each gets its own tokens); the same adapter again hits its own blocks."""
    llm = LLM(str(dense[0]), enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64,
              block_size=4)
    prompt = [7, 3, 9, 21, 5, 5, 60, 61, 2, 8, 13, 44, 90, 91, 92, 17]
    for run, picks in enumerate(([0], [1], [None], [0])):
        hits = llm.engine.prefix_cache_hits
        _check(llm, dense, picks, prompts=[prompt])
        gained = llm.engine.prefix_cache_hits - hits
        assert gained == (12 if run == 3 else 0), (picks, gained)     # 3 full blocks, the last token computed


def test_ngram_speculation_with_adapters(dense):
    llm = LLM(str(dense[0]), enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    _check(llm, dense, [0, None, 1, 0, 1], prompts=[[4, 5, 4, 5, 4, 5], [7, 7, 7, 7], [1, 2, 3, 1, 2, 3, 1],
                                                   [9, 8, 9, 8], [30, 31, 30, 31, 30]],
           sp=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))


def test_compiled_decode_does_not_recompile_for_a_new_adapter(dense):
    """The adapter slots are static inputs of the compiled decode step: a new adapter loads into a
    slot, and the step's graphs stay as they were."""
    import torch._dynamo

    torch._dynamo.reset()
    llm = LLM(str(dense[0]), enable_lora=True, max_loras=1, max_lora_rank=16, max_num_seqs=2, max_model_len=64,
              compile=True, decode_buckets=[1, 2], compile_backend="inductor")
    _check(llm, dense, [0, 0], prompts=PROMPTS[:2])
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _check(llm, dense, [1, 1], prompts=PROMPTS[2:4])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


# ------------------------------------------------------------------------------------------------
# Other families
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5"])
def test_moe_and_hybrid_models_equal_peft(tmp_path, family):
    """Qwen3-MoE (attention projections; its experts are not LoRA targets) and the Qwen3.5 hybrid
    (its full-attention layers' q, k, v, o with the output gate in q, and every MLP)."""
    if family == "qwen3_moe":
        base = make_moe_checkpoint(tmp_path / "base", "qwen3_moe")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    else:
        base = make_qwen3_5_checkpoint(tmp_path / "base")
        targets = "model\\.layers\\.\\d+\\.(self_attn\\.(q|k|v|o)_proj|mlp\\.(gate|up|down)_proj)"
    adapters = [make_adapter(base, tmp_path / "x", 4, targets, 5), make_adapter(base, tmp_path / "y", 8, targets, 6)]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=3, max_model_len=64)
    _check(llm, (base, adapters, PeftGreedy(base)), [0, None, 1, 1], prompts=PROMPTS[:4])


# ------------------------------------------------------------------------------------------------
# Adapters that cannot be served, and bad arguments
# ------------------------------------------------------------------------------------------------

def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_unservable_adapters_fail_naming_the_field(dense, tmp_path):
    base, adapters, _ = dense
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=4, max_num_seqs=2, max_model_len=64)
    cases = [
        (LoRARequest("big", 1, str(adapters[0])), r"r = 8 is above max_lora_rank = 4"),
        (LoRARequest("dora", 2, str(_edit_config(adapters[1], tmp_path / "dora", use_dora=True))),
         r"use_dora = True: DoRA is not supported"),
        (LoRARequest("save", 3, str(_edit_config(adapters[1], tmp_path / "save", modules_to_save=["lm_head"]))),
         r"modules_to_save"),
        (LoRARequest("none", 4, str(tmp_path / "nowhere")), r"no adapter_config.json there"),
    ]
    import shutil
    from safetensors.torch import load_file, save_file

    wrong = shutil.copytree(adapters[1], tmp_path / "wrong")          # made for a model twice as wide
    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.randn(4, 128)
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    cases.append((LoRARequest("wrong", 7, str(wrong)),
                  r"layers.0.self_attn.q_proj has lora_A \(4, 128\) .* expected \[4, 64\]"))
    head = make_adapter(base, tmp_path / "head", 2, ["lm_head", "q_proj"], 9)
    cases.append((LoRARequest("head", 5, str(head)), r"targets 'lm_head', which LoRA does not support here"))
    for req, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([[5, 6]], GREEDY, lora_request=req, use_tqdm=False)
    ok = llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("ok", 6, str(adapters[1])), use_tqdm=False)
    assert ok[0].outputs[0].token_ids == dense[2](adapters[1], [5, 6], 8)     # nothing else changed


def test_bad_arguments_are_named(dense):
    base = str(dense[0])
    with pytest.raises(ValueError, match=r"max_loras = 0, expected an int >= 1"):
        LLM(base, enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match=r"max_cpu_loras = 1, expected an int >= max_loras = 2"):
        LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match=r"lora_int_id = 0, expected an int >= 1"):
        LoRARequest("x", 0, "/p")
    llm = LLM(base, max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"LoRA is not enabled"):
        llm.generate([[5]], GREEDY, lora_request=LoRARequest("a", 1, str(dense[1][0])), use_tqdm=False)
    llm = LLM(base, enable_lora=True, max_lora_rank=16, max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match=r"lora_request has 1 entries for 2 prompts"):
        llm.generate([[5], [6]], GREEDY, lora_request=[None], use_tqdm=False)
    llm.add_lora(LoRARequest("a", 1, str(dense[1][0])))
    with pytest.raises(ValueError, match=r"lora_int_id = 1 is already 'a'"):
        llm.add_lora(LoRARequest("b", 1, str(dense[1][1])))
    assert llm.remove_lora(1) and not llm.remove_lora(1)


def test_a_slow_adapter_parse_holds_only_its_own_request(dense, monkeypatch):
    """The engine loop's add parses the adapter on a thread of its own while the request waits held:
    other requests run their steps meanwhile, and the held one then gets peft's tokens."""
    base, adapters, oracle = dense
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=16, max_num_seqs=4, max_model_len=64)
    gate = threading.Event()
    real = LM.load_peft_adapter

    def slow(*a, **k):
        gate.wait(30)
        return real(*a, **k)

    monkeypatch.setattr("qwen_ops.engine.lora.load_peft_adapter", slow)
    core = llm.core
    assert core.add("slow", PROMPTS[0], GREEDY, LoRARequest("a1", 1, str(adapters[0]))) is None
    assert core.add("fast", PROMPTS[1], GREEDY) is None
    done: dict[str, list[int]] = {"slow": [], "fast": []}
    for _ in range(40):
        for d in core.step_deltas():
            done[d.request_id] += [t for c in d.completions for t in c.token_ids]
        if len(done["fast"]) == 8:
            break
    assert len(done["fast"]) == 8 and done["slow"] == []      # the fast one finished while the parse waited
    gate.set()
    deadline = time.monotonic() + 30
    while len(done["slow"]) < 8 and time.monotonic() < deadline:
        for d in core.step_deltas():
            done[d.request_id] += [t for c in d.completions for t in c.token_ids]
    assert done["fast"] == oracle(None, PROMPTS[1], 8)
    assert done["slow"] == oracle(adapters[0], PROMPTS[0], 8)


def test_tensor_parallel_adapters_equal_peft(dense):
    """Two ranks: q, k, v, gate, up column-parallel (B's rows split), o and down row-parallel (A's
    columns split, the rank-R partial products all-reduced): every request's tokens are peft's."""
    llm = LLM(str(dense[0]), enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64,
              tensor_parallel_size=2)
    try:
        _check(llm, dense, [0, None, 1, 2, 3], prompts=PROMPTS[:5])
    finally:
        llm.shutdown()


def test_quantized_base_weights_keep_full_precision_deltas(dense, tmp_path):
    """An AWQ int4 checkpoint of the base (its products dequantize in the kernels) with adapters in
    fp32: every request's tokens are peft's on the dequantized base (the same weights in fp32)."""
    from test_quant import write_quantized

    base, adapters, _ = dense
    path, twin, _ = write_quantized(base, tmp_path / "awq", "awq", 4)
    llm = LLM(str(path), enable_lora=True, max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64)
    assert "int4" in set(forward_choices(llm.engine.model).values())
    _check(llm, (twin, adapters, PeftGreedy(twin)), [0, None, 1, 3], prompts=PROMPTS[:4])


def test_adapters_of_unfinished_requests_stay_parsed(dense):
    """``max_cpu_loras`` bounds host memory except for adapters that unfinished requests name: taking
    a slot in a step then never reads the disk (nor fails there)."""
    base, adapters, _ = dense
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16, max_num_seqs=2,
              max_model_len=64)
    manager = llm.engine.lora
    a, b, c = _requests(adapters)[:3]
    manager.prepare(a)
    manager.hold(a.lora_int_id)                     # as Scheduler.add_request does
    manager.prepare(b)
    assert llm.list_loras() == {1, 2}
    with pytest.raises(ValueError, match=r"lora_int_id = 1 serves 1 unfinished requests"):
        llm.remove_lora(1)
    manager.unhold(a.lora_int_id)                   # as finish / abort do
    manager.prepare(c)
    assert llm.list_loras() == {3}
