"""Checks on the embedded default model in ``qwen_ops/default_model/``.

The model is trained by ``scripts/train_default_model.py`` on permissively licensed Python (the
standard library and site-packages sources, ``DATA.md``) and ChatML examples built from it. These
tests load it with ``transformers`` (a test-only dependency) and check that the files are complete
and within the 40 MB budget, that the tokenizer is lossless, that the model has really learned
Python (low loss on Python it never saw, far lower than on the same tokens shuffled; a greedy
continuation that reads like Python) and that its chat template works. Parity with qwen_ops' own
loader is tested separately.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import sysconfig
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip(
    "transformers", reason="transformers (test-only dependency) is needed to load the HF checkpoint"
)

# find_spec locates the installed package without importing it (and its op registrations).
MODEL_DIR = Path(importlib.util.find_spec("qwen_ops").origin).resolve().parent / "default_model"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json",
                  "tokenizer_config.json", "DATA.md", "manifest.tsv", "train_log.txt", "loss_curve.png")
MAX_TOTAL_BYTES = 40_000_000           # issue 27's budget for the model's folder
EOT_TOKEN = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 40

# Written for this test, so not in the training text (the stdlib). Ordinary Python.
HELD_OUT_SNIPPET = '''\
class RequestQueue:
    """A first-in, first-out queue of pending requests with a size limit."""

    def __init__(self, max_size=16):
        if max_size <= 0:
            raise ValueError("max_size must be positive, got %r" % (max_size,))
        self.max_size = max_size
        self._items = []

    def __len__(self):
        return len(self._items)

    def push(self, item):
        """Append item; return False if the queue is full."""
        if len(self._items) >= self.max_size:
            return False
        self._items.append(item)
        return True

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty queue")
        return self._items.pop(0)

    def drain(self):
        items = list(self._items)
        self._items.clear()
        return items
'''

# Measured on the committed model: 2.10 on HELD_OUT_SNIPPET and 9.08 on its tokens shuffled;
# uniform guessing would be ln(8192) = 9.01 (the model before issue 27: 2.79 and 8.84, 4,096 tokens).
# The bounds leave room for float differences only.
MAX_SNIPPET_LOSS = 2.6
# Shuffling the same tokens must cost at least this much more loss: the model uses context,
# not just token frequencies.
MIN_SHUFFLE_GAP = 3.0
# Ways to close a cut-off function body so that it parses: an open docstring, an open block.
CLOSERS = ("", '    """\n', "    pass\n", "        pass\n", '        """\n')


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def model():
    model = transformers.Qwen3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval()


def test_files_present_and_small():
    present = {p.name: p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file()}
    missing = [name for name in REQUIRED_FILES if name not in present]
    assert not missing, f"{MODEL_DIR} lacks {missing}; it has {sorted(present)}"
    total = sum(present.values())
    assert total < MAX_TOTAL_BYTES, f"default model is {total} bytes, expected < {MAX_TOTAL_BYTES}"


def test_config_describes_qwen3_with_eos(tokenizer):
    config = json.loads((MODEL_DIR / "config.json").read_text())
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    assert config["model_type"] == "qwen3"
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    # transformers 5.x nests rope_theta in rope_parameters; 4.x keeps it at top level.
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta"))
    assert theta == 10000.0
    assert config["eos_token_id"] == eot_id
    assert config["bos_token_id"] == eot_id
    # A chat turn ends at <|im_end|>, a file at <|endoftext|>: generation stops at either.
    assert generation["eos_token_id"] == [tokenizer.token_to_id(IM_END), eot_id]


def test_chat_template_is_chatml():
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a function that adds two numbers."}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == f"{IM_START}user\nWrite a function that adds two numbers.{IM_END}\n{IM_START}assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)       # the markers are single special tokens
    assert tok.convert_tokens_to_ids(IM_END) in ids


def test_data_record_names_every_source_and_licence():
    data = (MODEL_DIR / "DATA.md").read_text()
    rows = (MODEL_DIR / "manifest.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["split", "source", "package_version", "licence", "chars", "sha256", "path"]
    assert {r.split("\t")[0] for r in rows[1:]} == {"train", "heldout"}
    for licence in {r.split("\t")[3] for r in rows[1:]}:
        assert licence in data, f"licence {licence!r} of manifest.tsv is not in DATA.md"


def test_tokenizer_round_trips_source_exactly(tokenizer):
    stdlib_file = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"
    texts = [
        HELD_OUT_SNIPPET,
        "x = 'caf\u00e9 \u2603 \U0001f600'\n\tif a:\r\n  \u00a0pass  \n\n",  # non-ASCII, tabs, CRLF
    ]
    if stdlib_file.exists():
        texts.append(stdlib_file.read_text(encoding="utf-8"))
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text
    # Python source compresses well below one token per byte: the BPE really merges.
    ids = tokenizer.encode(HELD_OUT_SNIPPET).ids
    assert len(ids) < 0.4 * len(HELD_OUT_SNIPPET), f"{len(ids)} tokens for {len(HELD_OUT_SNIPPET)} chars"


def test_tokenizer_keeps_special_token_literal_when_asked(tokenizer):
    # A literal "<|endoftext|>" in text encodes to the special id (as in Qwen's tokenizer), which
    # plain decode drops; decoding with skip_special_tokens=False restores the text exactly.
    text = Path(__file__).read_text(encoding="utf-8")  # contains the literal, see EOT_TOKEN
    ids = tokenizer.encode(text).ids
    assert tokenizer.token_to_id(EOT_TOKEN) in ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def _loss(model, ids: list[int]) -> float:
    batch = torch.tensor([ids])  # [1, seq]
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def test_model_predicts_unseen_python(model, tokenizer):
    ids = tokenizer.encode(HELD_OUT_SNIPPET).ids
    loss = _loss(model, ids)
    assert loss < MAX_SNIPPET_LOSS, f"held-out Python loss {loss:.3f} >= {MAX_SNIPPET_LOSS}"
    shuffled = list(ids)
    random.Random(0).shuffle(shuffled)
    shuffled_loss = _loss(model, shuffled)
    assert shuffled_loss - loss > MIN_SHUFFLE_GAP, (
        f"loss on shuffled tokens {shuffled_loss:.3f} is not well above ordered {loss:.3f}: "
        "the model does not use context"
    )


def test_greedy_continuation_looks_like_python(model, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    new_ids = out[0, len(prompt_ids):].tolist()
    text = tokenizer.decode(new_ids)
    assert len(new_ids) == NEW_TOKENS, f"generation stopped after {len(new_ids)} tokens: {text!r}"
    assert len(set(new_ids)) >= 10, f"degenerate repetition: {text!r}"
    # A function body: a line break, then lines indented inside the def.
    assert text.startswith("\n    "), f"no indented line after the def line: {text!r}"
    complete = text[: text.rindex("\n") + 1]  # drop the cut-off last line
    body_lines = [line for line in complete.split("\n")[1:] if line.strip()]
    assert len(body_lines) >= 2, f"fewer than 2 complete body lines: {text!r}"
    assert all(line.startswith("    ") for line in body_lines), f"body leaves the def: {text!r}"
    # Prompt plus the complete lines is valid Python once an open docstring or block is closed;
    # random tokens essentially never are.
    parses = []
    for closer in CLOSERS:
        try:
            ast.parse(PROMPT + complete + closer)
            parses.append(closer)
        except SyntaxError:
            pass
    assert parses, f"prompt + continuation does not parse with any of {CLOSERS}: {text!r}"
