"""GGUF files (models/gguf.py) against outside oracles: ggml's own ``gguf.quants.dequantize`` for every
block type held as stored, a float64 product for the quantized layers, and transformers loading the same
file (its own GGUF reader, dequantized) for whole models: tiny qwen2, qwen3 and llama files written here
with ggml's ``gguf.GGUFWriter`` in F32, Q8_0 and Q4_1 (llama's q / k rows permuted as llama.cpp's
converter writes them)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="ggml's gguf package reads and writes the files")
transformers = pytest.importorskip("transformers", reason="transformers' GGUF loader is the oracle")

from gguf import GGMLQuantizationType as T  # noqa: E402

from qwen_ops import LLM, SamplingParams  # noqa: E402
from qwen_ops.models import quant as Q  # noqa: E402
from qwen_ops.models.gguf import NATIVE, GGUFError, dequantize_unpacked, unpack_blocks  # noqa: E402
from qwen_ops.models.loader import CheckpointError  # noqa: E402

HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
ARCHS = ("qwen2", "qwen3", "llama")
FILE_TYPES = (T.F32, T.Q8_0, T.Q4_1)
PROMPTS = [[5, 17, 200, 33, 9], [1, 2, 3, 250, 100, 7, 8, 44, 12]]
NEW_TOKENS = 12


# ----------------------------------------------------------------------------------------------
# Blocks: each native type's unpacking against gguf.quants.dequantize
# ----------------------------------------------------------------------------------------------

def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random stored blocks of ``kind`` ``[rows, bytes]``: quantized from random weights where the gguf package
    quantizes the type, else random bytes with sane fp16 scale fields (the K-quants only dequantize)."""
    qtype = T[kind]
    if kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        return gguf.quants.quantize(rng.normal(0, 0.5, (rows, cols)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = lambda shape: rng.uniform(0.001, 0.05, shape).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind in ("Q4_K", "Q5_K"):         # d, dmin first
        raw[..., 0:4] = scale((rows, cols // block, 2)).reshape(rows, cols // block, 4)
    else:                                # Q6_K: d last
        raw[..., 208:210] = scale((rows, cols // block, 1)).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", NATIVE)
def test_unpacked_blocks_are_the_files_weights(kind):
    rng = np.random.default_rng(sum(map(ord, kind)))
    rows, cols = 6, 512
    raw = random_blocks(kind, rows, cols, rng)
    want = gguf.quants.dequantize(raw, T[kind]).astype(np.float64)
    got = dequantize_unpacked(unpack_blocks(raw, kind, rows, cols), kind).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("kind", NATIVE)
def test_quantized_product_equals_the_dequantized_weights(kind):
    """QuantLinear on the stored blocks (int8 / int4 products, mins added per group) against x @ W^T in float64,
    W from gguf's dequantize; the output poisoned first."""
    rng = np.random.default_rng(7 + sum(map(ord, kind)))
    n, k = 96, 512
    raw = random_blocks(kind, n, k, rng)
    w = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype(np.float64))
    quant = Q.QuantConfig("gguf", types={"w.weight": kind})
    layer = Q.QuantLinear.like(torch.nn.Linear(k, n, bias=False, device="meta"), quant, torch.float32, "w.weight")
    for key, value in Q.convert_gguf("w.weight", raw, kind, n, k).items():
        layer._buffers[key] = value
    layer.process_weights_after_loading()
    for rows in (1, 5):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        out = torch.full((rows, n), float("nan"))
        out.copy_(layer(x))
        want = x.double() @ w.T
        scale = (x.double().abs() @ w.abs().T).max()
        assert (out.double() - want).abs().max() <= 1e-5 * scale, kind


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q6_K"])
def test_quantized_embedding_rows_are_the_files(kind):
    rng = np.random.default_rng(3)
    vocab, dim = 40, 256
    raw = random_blocks(kind, vocab, dim, rng)
    quant = Q.QuantConfig("gguf", types={"e.weight": kind})
    table = Q.QuantEmbedding.like(torch.nn.Embedding(vocab, dim, device="meta"), quant, torch.float32, "e.weight")
    for key, value in Q.convert_gguf("e.weight", raw, kind, vocab, dim).items():
        table._buffers[key] = value
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]))[ids]
    torch.testing.assert_close(table(ids), want, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# Tiny files written here, against transformers loading the same file
# ----------------------------------------------------------------------------------------------

def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k permutation (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shape_metadata(w, cfg, head_dim) -> None:
    """The hyperparameters every file here carries, under llama.cpp's keys (key / value length: ``head_dim``, if
    given)."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)


def _toy_vocabulary(w, vocab_size: int) -> None:
    """A byte-level vocabulary of single characters, no merges: enough for a tokenizer to build."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(0x100 + i) for i in range(vocab_size)])
    w.add_token_types([1] * vocab_size)
    w.add_token_merges([])


def write_gguf(model, path, arch: str, qtype, *, drop: str = "", add_bogus_type=None, architecture=None) -> None:
    """``model`` (transformers) as a GGUF file of llama.cpp's names; 2-D weights in ``qtype`` blocks."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), architecture or arch)
    _shape_metadata(w, cfg, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    _toy_vocabulary(w, cfg.vocab_size)
    w.add_tokenizer_pre("qwen2")
    w.add_eos_token_id(cfg.vocab_size - 1)
    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            parts = name.split(".")
            inner = ".".join(parts[3:-1])
            g = f"blk.{parts[2]}.{HF_TO_GGUF[inner]}.{parts[-1]}"
            if arch == "llama" and inner in ("self_attn.q_proj", "self_attn.k_proj"):
                t = _permute(t, cfg.num_attention_heads if "q_proj" in inner else cfg.num_key_value_heads)
        if g == drop:
            continue
        if t.ndim == 2 and qtype != T.F32:
            w.add_tensor(g, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(g, np.ascontiguousarray(t))
    if add_bogus_type is not None:
        w.add_tensor("blk.0.extra.weight", np.zeros((4, 32), dtype=np.int32), raw_dtype=add_bogus_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_model(arch: str):
    torch.manual_seed({"qwen2": 0, "qwen3": 1, "llama": 2}[arch])
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=arch != "qwen2")
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "qwen3":       # transformers' qwen3 GGUF mapping reads no key_length: head_dim 128 (MACHINE_NOTES)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=128))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ARCHS:
        model = tiny_model(arch)
        for qtype in FILE_TYPES:
            path = root / f"{arch}-{qtype.name}.gguf"
            write_gguf(model, path, arch, qtype)
            out[arch, qtype.name] = path
    return out


def transformers_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("qtype", [t.name for t in FILE_TYPES])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_file_matches_transformers(files, arch, qtype):
    """Greedy tokens and every prompt token's log-probability against transformers on the same file, with
    the quantized blocks run as stored (the default)."""
    path = files[arch, qtype]
    hf = transformers_model(path)
    llm = LLM(str(path), kv_cache_bytes=1 << 24)
    if qtype != "F32":
        assert llm.engine.model.gguf_summary.split(": ", 1)[1].startswith(f"quantized as stored: {qtype} x")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()
            logp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
        assert list(out.outputs[0].token_ids) == ref
        for j in range(1, len(prompt)):
            got = out.prompt_logprobs[j][prompt[j]].logprob
            assert math.isclose(got, float(logp[j - 1, prompt[j]]), abs_tol=2e-4), (j, got)


def test_dequantize_and_online_int8_load_the_same_file(files):
    path = files["llama", "Q4_1"]
    hf = transformers_model(path)
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(str(path), quantization="dequantize", kv_cache_bytes=1 << 24)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                      ignore_eos=True), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ref
    assert Q.describe(llm.engine.model) == {}
    assert "dequantized at load: Q4_1 x" in llm.engine.model.gguf_summary
    assert "quantized as stored" not in llm.engine.model.gguf_summary
    int8 = LLM(str(path), quantization="int8", kv_cache_bytes=1 << 24)
    assert set(Q.describe(int8.engine.model).values()) == {"int8"}


def test_quantized_file_is_held_quantized(files):
    """A Q4_1 file's projections on the int4 product with mins, Q8_0's on int8; nothing dequantized."""
    for qtype, kernel in (("Q4_1", "int4"), ("Q8_0", "int8")):
        llm = LLM(str(files["qwen3", qtype]), kv_cache_bytes=1 << 24)
        model = llm.engine.model
        kinds = Q.describe(model)
        assert set(kinds.values()) == {kernel} and len(kinds) >= 2 * 4
        assert isinstance(model.model.embed_tokens, Q.QuantEmbedding)
        assert "dequantized" not in model.gguf_summary


# ----------------------------------------------------------------------------------------------
# Bad files: a clear error at load naming the file and what is wrong
# ----------------------------------------------------------------------------------------------

def test_bad_files_are_clear_errors(files, tmp_path):
    good = files["qwen2", "Q8_0"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises((GGUFError, CheckpointError), match="truncated.gguf"):
        LLM(str(truncated))
    magic = tmp_path / "magic.gguf"
    magic.write_bytes(b"GGUX" + good[4:])
    with pytest.raises(GGUFError, match=r"magic.gguf: not a GGUF file .*b'GGUX'"):
        LLM(str(magic))
    model = tiny_model("qwen2")
    arch = tmp_path / "arch.gguf"
    write_gguf(model, arch, "qwen2", T.F32, architecture="gpt2")
    with pytest.raises(GGUFError, match=r"arch.gguf: general.architecture = 'gpt2' is not supported; supported: qwen2"):
        LLM(str(arch))
    kind = tmp_path / "kind.gguf"
    write_gguf(model, kind, "qwen2", T.F32, add_bogus_type=T.I32)
    with pytest.raises(GGUFError, match=r"kind.gguf: unsupported tensor types: tensor 'blk.0.extra.weight' has type "
                                        r"I32; supported: F32, F16, BF16, Q8_0"):
        LLM(str(kind))
    missing = tmp_path / "missing.gguf"
    write_gguf(model, missing, "qwen2", T.Q8_0, drop="blk.1.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        LLM(str(missing))


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0])
def test_wrong_size_tensor_names_the_tensor(tmp_path, qtype):
    model = tiny_model("llama")
    with torch.no_grad():       # one projection narrower than the config says
        model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.randn(96, 64))
    path = tmp_path / "size.gguf"
    write_gguf(model, path, "llama", qtype)
    want = (r"tensor 'model.layers.1.mlp.up_proj.weight' .*has shape \[96, 64\], expected \[128, 64\]" if qtype == T.F32
            else r"size.gguf: tensor 'model.layers.1.mlp.up_proj.weight' \(Q8_0\) has 96 rows, expected 128")
    with pytest.raises(CheckpointError, match=want):
        LLM(str(path))


def test_online_int4_is_round_to_nearest_per_group():
    """quantization="int4": each weight within half a step of its group's grid (min + q s, q in 0..15; the
    oracle: the definition, in float64), and the int4 product equal to x @ that dequantized weight."""
    torch.manual_seed(0)
    w = torch.randn(64, 256, dtype=torch.float64)
    w[:3] = w[:3].abs() + 1.0                       # groups that do not straddle 0
    parts = Q.quantize_online(w.float(), "int4", 32)
    q = torch.stack([parts["qweight"] & 15, parts["qweight"] >> 4], -1).reshape(64, 256).double()
    s = parts["scales"].double().repeat_interleave(32, 1)
    lo = w.reshape(64, 8, 32).amin(-1).repeat_interleave(32, 1)
    hi = w.reshape(64, 8, 32).amax(-1).repeat_interleave(32, 1)
    assert (parts["zeros"] == 0).all()
    torch.testing.assert_close(parts["mins"].double().repeat_interleave(32, 1), lo, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, (hi - lo) / 15, rtol=1e-6, atol=0)
    deq = q * s + parts["mins"].double().repeat_interleave(32, 1)
    assert ((deq - w).abs() <= s / 2 + 1e-6).all()
    layer = Q.QuantLinear.like(torch.nn.Linear(256, 64, bias=False, device="meta"), Q.online_config("int4"),
                               torch.float32)
    for key, value in parts.items():
        layer._buffers[key] = value
    layer.process_weights_after_loading()
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x).double(), x.double() @ deq.T, rtol=1e-4, atol=1e-4)


def test_llama_safetensors_checkpoint_matches_transformers(tmp_path):
    """model_type llama (added for GGUF's llama files) loads from a Hugging Face directory as well."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False)[0, len(prompt):].tolist()
    out = LLM(str(tmp_path), kv_cache_bytes=1 << 24).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == ref


def write_moe_gguf(model, path, qtype) -> None:
    """A Qwen3-MoE model as llama.cpp's qwen3moe file: experts stacked (ffn_{gate,up,down}_exps), the router
    ffn_gate_inp. transformers' qwen3moe GGUF mapping reads no expert_feed_forward_length: the model keeps
    its default moe_intermediate_size (768)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    _shape_metadata(w, cfg, cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _toy_vocabulary(w, cfg.vocab_size)

    def put(name, t):
        if t.ndim >= 2 and qtype != T.F32:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(t), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(t))

    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            put({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], t)
            continue
        parts = name.split(".")
        layer = parts[2]
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            put(f"blk.{layer}.ffn_gate_exps.weight", t[:, :inter])
            put(f"blk.{layer}.ffn_up_exps.weight", t[:, inter:])
        elif name.endswith("experts.down_proj"):
            put(f"blk.{layer}.ffn_down_exps.weight", t)
        elif name.endswith("mlp.gate.weight"):
            put(f"blk.{layer}.ffn_gate_inp.weight", t)
        else:
            put(f"blk.{layer}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0])
def test_moe_file_matches_transformers(tmp_path, qtype):
    """A qwen3moe file (stacked experts, dequantized at load; attention held as stored) against transformers."""
    torch.manual_seed(3)
    cfg = transformers.Qwen3MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
                                      tie_word_embeddings=False, norm_topk_prob=True)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    path = tmp_path / "moe.gguf"
    write_moe_gguf(model, path, qtype)
    hf = transformers_model(path)
    llm = LLM(str(path), kv_cache_bytes=1 << 24)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == ref


@pytest.mark.parametrize("quantization,says", [(None, "quantized as stored: Q4_1 x"),
                                               ("dequantize", "dequantized at load: Q4_1 x")])
def test_serve_startup_line_says_how_the_tensors_are_held(files, quantization, says):
    from qwen_ops.serving.async_llm import AsyncLLM
    from qwen_ops.serving.openai.server import startup_line

    engine = AsyncLLM.from_pretrained(str(files["qwen3", "Q4_1"]), engine_process=quantization is None,
                                      quantization=quantization, kv_cache_bytes=1 << 24, max_model_len=128)
    try:
        line = startup_line(engine, ["tiny"], "127.0.0.1", 8000)
    finally:
        engine.shutdown()
    assert "qwen3-Q4_1.gguf (qwen3): " in line and says in line, line


def test_tokenizer_argument_replaces_the_files_tokenizer_and_template(files, tmp_path):
    """tokenizer= (vLLM's): another source's tokenizer and chat template, the file's weights."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(ord("a") + i): i for i in range(26)} | {"[": 26, "]": 27, "<unk>": 28}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}))
    llm = LLM(str(files["qwen3", "Q8_0"]), tokenizer=str(folder), kv_cache_bytes=1 << 24)
    assert llm.get_tokenizer().encode("ab") == [0, 1]
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert list(out[0].prompt_token_ids) == [26, 7, 8, 27]          # "[hi]" by the template and vocabulary given
    with pytest.raises(ValueError, match=r"tokenizer = '.*nothing': .* has no tokenizer.json"):
        LLM(str(files["qwen3", "Q8_0"]), tokenizer=str(tmp_path / "nothing"))


def test_qwen2moe_file_matches_the_model_written():
    """A qwen2moe file (stacked experts, a sigmoid-gated shared expert: ffn_*_shexp, ffn_gate_inp_shexp) against
    the transformers model whose weights were written (transformers' own GGUF loader cannot read a file this
    small: it reads no expert_feed_forward_length and takes the shared expert's gate as [1, 1, H])."""
    torch.manual_seed(4)
    cfg = transformers.Qwen2MoeConfig(vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/moe2.gguf"
        w = gguf.GGUFWriter(path, "qwen2moe")
        _shape_metadata(w, cfg, None)
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        shared = {"mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                  "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
                  "mlp.gate": "ffn_gate_inp"}
        outer = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
        for name, t in model.state_dict().items():
            t = t.float().numpy()
            parts = name.split(".")
            if name in outer:
                w.add_tensor(outer[name], np.ascontiguousarray(t))
            elif name.endswith("experts.gate_up_proj"):
                inter = t.shape[1] // 2
                w.add_tensor(f"blk.{parts[2]}.ffn_gate_exps.weight", np.ascontiguousarray(t[:, :inter]))
                w.add_tensor(f"blk.{parts[2]}.ffn_up_exps.weight", np.ascontiguousarray(t[:, inter:]))
            elif name.endswith("experts.down_proj"):
                w.add_tensor(f"blk.{parts[2]}.ffn_down_exps.weight", np.ascontiguousarray(t))
            else:
                inner = ".".join(parts[3:-1])
                w.add_tensor(f"blk.{parts[2]}.{shared.get(inner) or HF_TO_GGUF[inner]}.{parts[-1]}",
                             np.ascontiguousarray(t))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        llm = LLM(path, kv_cache_bytes=1 << 24)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == ref
