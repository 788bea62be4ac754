"""Evaluate a small Python-code model (the embedded default model or another) on held-out files.

Two measures, each for every ``--model`` given, printed side by side in one table:

1. Loss on held-out Python files, in nats per token and nats per character. Each file is scored
   whole: its tokens, preceded by the model's eos/bos token, are cut into consecutive windows of
   ``--window`` predictions, each window seeing only its own tokens. Per character is
   ``total nats / total characters`` of the text scored, so it compares models whose tokenizers
   differ.
2. Greedy completions of held-out functions. Functions with a docstring and a body are taken
   from the same files with ``ast``; the prompt is the ``def`` line(s) plus the docstring (ending
   at its closing quotes); ``qwen_ops.LLM`` generates ``--new-tokens`` greedily. Scores:
   - parse fraction: ``ast.parse`` of prompt + completion, the completion cut at the function's
     end (the first non-blank line at or left of the ``def``'s indentation); a completion that
     never reaches the end is cut after its last complete line, and one with no complete code
     line left counts as not parsing. The text is dedented by the ``def``'s indentation first,
     so methods parse on their own. Also reported: the fraction that reach the function's end.
   - repetition: distinct 4-grams / all 4-grams of the completion's token ids (1.0: no 4-gram
     repeated; low: a loop), averaged over completions.

Usage:
    OMP_NUM_THREADS=1 python benchmarks/eval_default_model.py [--model PATH]... [--heldout-list FILE]
        [--functions 64] [--new-tokens 64] [--window 512]

``--heldout-list`` is a text file of paths, one a line (absolute, or relative to the stdlib
directory; ``#`` starts a comment), e.g. the ``heldout.txt`` that ``scripts/build_training_data.py``
writes. Without it the default list is the stdlib files that today's embedded model held out
(every 20th top-level file), so neither that model nor a new one has trained on them.
Figures live in ``benchmarks/README.md`` ("Embedded model evaluation (issue 27)").
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import ast
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Today's embedded model held out every 20th top-level stdlib file (scripts/train_default_model.py,
# HELD_OUT_EVERY = 20); on Python 3.11 these are the eight below.
DEFAULT_HELDOUT = ("antigravity.py", "configparser.py", "genericpath.py", "mailbox.py",
                   "plistlib.py", "shlex.py", "symtable.py", "uuid.py")
NGRAM = 4


@dataclass(frozen=True)
class FunctionPrompt:
    """One held-out function: ``prompt`` is its def line(s) plus docstring, ``indent`` its column."""

    name: str
    prompt: str
    indent: int


# ------------------------------------------------------------------------------------------
# Metrics (plain functions, tested in tests/test_eval_default_model.py)
# ------------------------------------------------------------------------------------------

def distinct_ngram_ratio(tokens: list, n: int = NGRAM) -> float:
    """Distinct n-grams / all n-grams of ``tokens``; 1.0 when there are fewer than n tokens."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def cut_at_function_end(completion: str, indent: int) -> tuple[str, bool]:
    """Cut ``completion`` (text right after the docstring's closing quotes) at the function's end.

    The end is the first non-blank line, after the first (the rest of the docstring's line),
    whose indentation is ``<= indent``. Returns ``(kept text, reached_end)``; when the end is not
    reached, the trailing partial line (the generation stopped mid-line) is dropped.
    """
    lines = completion.split("\n")
    for i, line in enumerate(lines[1:], start=1):
        stripped = line.lstrip(" \t")
        if stripped and len(line) - len(stripped) <= indent:
            return "\n".join(lines[:i]), True
    if len(lines) > 1:
        return "\n".join(lines[:-1]), False
    return completion, False


def completion_parses(prompt: str, completion: str, indent: int) -> bool:
    """Whether prompt + completion (cut at the function's end, dedented by ``indent``) parses.

    The kept completion must hold at least one code line: a docstring alone is a valid body,
    but a completion whose only line was cut off has written nothing that parses.
    """
    kept, _ = cut_at_function_end(completion, indent)
    if not any(line.strip() and not line.strip().startswith("#") for line in kept.split("\n")[1:]):
        return False
    lines = (prompt + kept).split("\n")
    # Dedent by exactly the def's column; a line with less indentation would be a cut error.
    source = "\n".join(line[indent:] if line[:indent].strip() == "" else line for line in lines)
    try:
        ast.parse(source + "\n")
    except (SyntaxError, ValueError):
        return False
    return True


def function_prompts(text: str, source_name: str) -> list[FunctionPrompt]:
    """Functions in ``text`` with a docstring and at least one statement after it, in file order."""
    tree = ast.parse(text)
    lines = text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if len(node.body) < 2 or ast.get_docstring(node, clean=False) is None:
            continue
        doc = node.body[0]
        # def line(s) start at node.lineno (decorators excluded); the docstring ends at
        # doc.end_lineno / doc.end_col_offset (just after its closing quotes).
        head = lines[node.lineno - 1:doc.end_lineno]
        if doc.lineno == node.lineno:  # one-line `def f(): "doc"`: skip, the cut rule assumes a block
            continue
        # ast's column offsets count UTF-8 bytes, not characters.
        head[-1] = head[-1].encode("utf-8")[:doc.end_col_offset].decode("utf-8")
        prompt = "\n".join(head)
        out.append(FunctionPrompt(f"{source_name}:{node.name}", prompt, node.col_offset))
    out.sort(key=lambda f: f.name)
    return out


# ------------------------------------------------------------------------------------------
# Held-out files and models
# ------------------------------------------------------------------------------------------

def heldout_paths(list_file: Path | None) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if list_file is None:
        names = list(DEFAULT_HELDOUT)
    else:
        names = [line.split("#", 1)[0].strip() for line in list_file.read_text().splitlines()]
        names = [n for n in names if n]
    paths = [Path(n) if Path(n).is_absolute() else stdlib / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"held-out files not found: {missing}")
    return paths


@torch.no_grad()
def file_loss(model, token_ids: list[int], start_id: int, window: int) -> float:
    """Total nats of predicting every token of ``token_ids`` (after ``start_id``), window by window."""
    ids = torch.tensor([start_id] + token_ids, dtype=torch.long)
    total = 0.0
    for begin in range(0, len(token_ids), window):
        chunk = ids[begin:begin + window + 1][None, :]  # [1, <= window + 1]
        logits = model(input_ids=chunk[:, :-1]).logits.float()  # [1, T, vocab]
        total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
    return total


def evaluate_loss(model_path: Path, texts: list[str], window: int) -> dict:
    from transformers import AutoModelForCausalLM  # dev/benchmark-only dependency

    from qwen_ops.models.tokenizer import QwenTokenizer

    tokenizer = QwenTokenizer.from_file(model_path / "tokenizer.json")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    start_id = model.config.bos_token_id if model.config.bos_token_id is not None else model.config.eos_token_id
    window = min(window, model.config.max_position_embeddings - 1)
    nats = tokens = chars = 0
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        nats += file_loss(model, ids, start_id, window)
        tokens += len(ids)
        chars += len(text)
    params = sum(p.numel() for p in model.parameters())
    return {"nats_per_token": nats / tokens, "nats_per_char": nats / chars, "tokens": tokens,
            "chars": chars, "params": params}


def evaluate_completions(model_path: Path, prompts: list[FunctionPrompt], new_tokens: int) -> dict:
    from qwen_ops import LLM, SamplingParams

    llm = LLM(str(model_path))
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    outs = llm.generate([p.prompt for p in prompts], params, use_tqdm=False)
    parsed, ended, ratios, samples = 0, 0, [], []
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ok = completion_parses(prompt.prompt, completion.text, prompt.indent)
        parsed += ok
        ended += cut_at_function_end(completion.text, prompt.indent)[1]
        ratios.append(distinct_ngram_ratio(list(completion.token_ids)))
        samples.append((prompt.name, ok, completion.text))
    llm.shutdown()
    return {"parse_fraction": parsed / len(prompts), "end_fraction": ended / len(prompts),
            "distinct_4gram": sum(ratios) / len(ratios),
            "samples": samples}


def main(argv: list[str] | None = None) -> None:
    from qwen_ops import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append",
                        help="model folder (repeat to compare); default: the embedded model")
    parser.add_argument("--heldout-list", type=Path, default=None)
    parser.add_argument("--functions", type=int, default=64, help="held-out functions to complete")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=512, help="predictions per loss window")
    parser.add_argument("--show", type=int, default=2, help="completions to print per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    models = args.model or [Path(default_model_path())]
    paths = heldout_paths(args.heldout_list)
    texts = [p.read_text(encoding="utf-8") for p in paths]
    prompts = [f for p, t in zip(paths, texts) for f in function_prompts(t, p.name)]
    # A fixed, spread-out pick: every k-th function in name order (no randomness to seed).
    step = max(1, len(prompts) // args.functions) if args.functions else 1
    prompts = prompts[::step][:args.functions]
    print(f"held-out: {len(paths)} files, {sum(map(len, texts)):,} characters; "
          f"{len(prompts)} functions, {args.new_tokens} greedy tokens each", flush=True)

    rows = []
    for path in models:
        t0 = time.perf_counter()
        loss = evaluate_loss(path, texts, args.window)
        comp = evaluate_completions(path, prompts, args.new_tokens)
        rows.append((path, loss, comp, time.perf_counter() - t0))
        for name, ok, text in comp["samples"][:args.show]:
            print(f"--- {path.name} {name} ({'parses' if ok else 'does not parse'}):{text}", flush=True)

    print("\n| model | params | held-out tokens | nats/token | nats/char | parse fraction "
          f"| reach the end | distinct {NGRAM}-grams | eval s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path, loss, comp, seconds in rows:
        print(f"| {path} | {loss['params'] / 1e6:.2f} M | {loss['tokens']:,} | {loss['nats_per_token']:.3f} "
              f"| {loss['nats_per_char']:.3f} | {comp['parse_fraction']:.3f} "
              f"({round(comp['parse_fraction'] * len(prompts))}/{len(prompts)}) "
              f"| {comp['end_fraction']:.3f} | {comp['distinct_4gram']:.3f} | {seconds:.0f} |")
    if len(rows) > 1:
        base = rows[0][1]["nats_per_char"]
        for path, loss, _, _ in rows[1:]:
            print(f"{path}: nats/char {loss['nats_per_char'] / base:.1%} of {rows[0][0]}'s")


if __name__ == "__main__":
    main()
