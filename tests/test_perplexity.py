"""Perplexity as llama.cpp's llama-perplexity (``qwen_ops/serving/perplexity.py``) and ``qwen-ops perplexity``.

Oracle: transformers' logits of each chunk of the same tiny random checkpoint, in a plain float64 loop
written here (its own chunking, BOS replacement and second-half positions, the standard error as the
sample standard deviation over sqrt(count)), never the code under test.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from qwen_ops import LLM
from qwen_ops.serving.cli import main
from qwen_ops.serving.perplexity import perplexity

from checkpoints import make_qwen3_checkpoint

transformers = pytest.importorskip("transformers", reason="transformers is the oracle")

VOCAB = 128
BOS_ID = 0
PPL_RTOL = 1e-4          # fp32 engine vs the float64 loop over fp32 transformers logits
FINAL = re.compile(r"^Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)$", re.MULTILINE)


def _save_word_tokenizer(path: Path, add_bos: bool) -> None:
    """``w<i>`` is token i (2 <= i < 128); with ``add_bos``, encode puts ``<s>`` (id 0) first, as a
    llama-style tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": BOS_ID, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = make_qwen3_checkpoint(tmp_path_factory.mktemp("perplexity") / "plain", vocab_size=VOCAB)
    _save_word_tokenizer(path, add_bos=False)
    return path


@pytest.fixture(scope="module")
def ckpt_bos(ckpt, tmp_path_factory) -> Path:
    path = shutil.copytree(ckpt, tmp_path_factory.mktemp("perplexity") / "bos")
    _save_word_tokenizer(path, add_bos=True)
    return path


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_perplexity(model, ids: list[int], n_ctx: int, bos: Optional[int] = None,
                  max_chunks: Optional[int] = None) -> tuple[float, float, int]:
    """(PPL, its standard error, tokens scored): chunks of n_ctx, each scoring positions
    n_ctx//2 + 1 .. n_ctx - 1 from transformers' float64 log-softmax, token by token."""
    nlls = []
    num_chunks = len(ids) // n_ctx if max_chunks is None else min(len(ids) // n_ctx, max_chunks)
    for c in range(num_chunks):
        chunk = ids[c * n_ctx:(c + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        with torch.no_grad():
            logits = model(torch.tensor([chunk])).logits[0].double()
        for pos in range(n_ctx // 2 + 1, n_ctx):
            row = logits[pos - 1]
            nlls.append(-(row[chunk[pos]] - torch.logsumexp(row, dim=0)).item())
    mean = math.fsum(nlls) / len(nlls)
    ppl = math.exp(mean)
    return ppl, ppl * statistics.stdev(nlls) / math.sqrt(len(nlls)), len(nlls)


# (n_ctx, LLM keyword arguments): an even chunk in one step; an odd one (first = 16) whose prefill is
# split over steps of 40 tokens, scored chunk pieces beside other chunks' pieces.
CASES = [(64, {}), (33, {"max_num_batched_tokens": 40, "block_size": 4})]


@pytest.mark.parametrize("n_ctx, llm_kwargs", CASES)
def test_perplexity_matches_transformers_chunked_loop(ckpt, hf, n_ctx, llm_kwargs):
    """5 chunks and a tail that fills none (dropped), 2 chunks a generate call: the same PPL, error and count."""
    ids = random_ids(5 * n_ctx + 17, seed=n_ctx)
    want_ppl, want_err, want_count = hf_perplexity(hf, ids, n_ctx)
    seen = []
    got = perplexity(LLM(ckpt, **llm_kwargs), ids, n_ctx, batch_size=2, on_chunk=lambda i, p: seen.append((i, p)))
    assert got.bos_token_id is None                      # the word tokenizer adds no BOS
    assert (got.num_chunks, got.num_tokens, got.n_ctx) == (5, want_count, n_ctx)
    assert want_count == 5 * (n_ctx - n_ctx // 2 - 1)
    assert got.ppl == pytest.approx(want_ppl, rel=PPL_RTOL)
    assert got.ppl_error == pytest.approx(want_err, rel=PPL_RTOL)
    assert got.nll == pytest.approx(math.log(want_ppl), rel=PPL_RTOL)
    assert [i for i, _ in seen] == list(range(5)) and [p for _, p in seen] == list(got.running_ppl)
    assert got.running_ppl[-1] == got.ppl
    assert got.running_ppl[0] == pytest.approx(hf_perplexity(hf, ids, n_ctx, max_chunks=1)[0], rel=PPL_RTOL)


def test_bos_replaces_each_chunks_first_token_as_llama_cpp(ckpt_bos, hf):
    """A tokenizer that adds BOS: every chunk's first token becomes BOS (llama.cpp's add_bos), found
    from the tokenizer; max_chunks stops early."""
    n_ctx = 32
    ids = [BOS_ID] + random_ids(6 * n_ctx, seed=7)        # as the text tokenizes: BOS first
    want_ppl, want_err, want_count = hf_perplexity(hf, ids, n_ctx, bos=BOS_ID, max_chunks=4)
    plain_ppl = hf_perplexity(hf, ids, n_ctx, max_chunks=4)[0]
    assert abs(plain_ppl / want_ppl - 1) > 100 * PPL_RTOL       # the replacement is visible in the score
    got = perplexity(LLM(ckpt_bos), ids, n_ctx, batch_size=3, max_chunks=4)
    assert got.bos_token_id == BOS_ID
    assert (got.num_chunks, got.num_tokens) == (4, want_count)
    assert got.ppl == pytest.approx(want_ppl, rel=PPL_RTOL)
    assert got.ppl_error == pytest.approx(want_err, rel=PPL_RTOL)
    # bos_token_id=None turns the replacement off: the plain chunks' value.
    assert perplexity(LLM(ckpt_bos), ids, n_ctx, max_chunks=4, bos_token_id=None).ppl == \
        pytest.approx(plain_ppl, rel=PPL_RTOL)


def test_command_prints_the_functions_final_estimate(ckpt_bos, tmp_path, capsys):
    """qwen-ops perplexity on a text file: the running values, then the same final estimate (and JSON)
    as the function on the text's tokens (BOS first: this tokenizer adds one)."""
    n_ctx = 32
    words = random_ids(5 * n_ctx + 3, seed=11)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in words))
    out_json = tmp_path / "ppl.json"
    assert main(["perplexity", str(ckpt_bos), "--file", str(text), "--ctx-size", str(n_ctx), "--max-chunks", "3",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    want = perplexity(LLM(ckpt_bos), [BOS_ID] + words, n_ctx, max_chunks=3)
    assert FINAL.search(out).groups() == (f"{want.ppl:.4f}", f"{want.ppl_error:.5f}"), out
    assert re.search(r"^\[1\][0-9.]+,\[2\][0-9.]+,\[3\]([0-9.]+),$", out, re.MULTILINE).group(1) == f"{want.ppl:.4f}"
    record = json.loads(out_json.read_text())
    assert record["ppl"] == pytest.approx(want.ppl, rel=1e-12)
    assert (record["num_chunks"], record["num_tokens"], record["n_ctx"]) == (3, want.num_tokens, n_ctx)
    assert (record["num_text_tokens"], record["bos_token_id"], record["text"]) == \
        (len(words) + 1, BOS_ID, f"--file {text}")


def test_text_shorter_than_a_chunk_is_a_clear_error(ckpt, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    short = tmp_path / "short.txt"
    short.write_text(" ".join(f"w{i}" for i in random_ids(20, seed=3)))
    assert main(["perplexity", str(ckpt), "--file", str(short), "--ctx-size", "64"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        f"error: --file {short} tokenizes to 20 tokens, but --ctx-size 64 needs at least 64 (one chunk)")
    assert "Final estimate" not in captured.out
    llm = LLM(ckpt)
    with pytest.raises(ValueError, match=r"^token_ids has 20 tokens, but n_ctx = 64 needs at least 64 \(one chunk\)$"):
        perplexity(llm, random_ids(20, seed=3), 64)
    with pytest.raises(ValueError, match=r"n_ctx = 512, but max_model_len = 512: .*expected n_ctx <= 511"):
        perplexity(llm, random_ids(600, seed=3), 512)


@pytest.mark.parametrize("argv, expected", [
    (["--file", "/nonexistent/text.txt"], "error: --file /nonexistent/text.txt: no such file"),
    (["--text", "pydoc", "--ctx-size", "2"], "error: --ctx-size = 2, expected >= 3"),
    (["--text", "pydoc", "--max-chunks", "0"], "error: --max-chunks = 0, expected >= 1"),
])
def test_bad_arguments_are_one_line_before_the_model_loads(argv, expected, capsys, monkeypatch):
    import qwen_ops.serving.llm

    monkeypatch.delenv("QWEN_OPS_DEBUG", raising=False)
    monkeypatch.setattr(qwen_ops.serving.llm.LLM, "__init__", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["perplexity", *argv]) == 2
    assert capsys.readouterr().err.strip().startswith(expected)


def test_perplexity_help_does_not_import_torch():
    probe = ("import sys, qwen_ops_cli\ntry:\n    qwen_ops_cli.main(['perplexity', '--help'])\nexcept SystemExit:\n"
             "    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), out.stdout + out.stderr
    assert "usage: qwen-ops perplexity" in out.stdout and "--ctx-size" in out.stdout
