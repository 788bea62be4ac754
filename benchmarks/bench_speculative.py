"""Speculative decoding (n-gram prompt lookup) on and off, in one run, on the embedded model (issue 29).

Workloads (greedy, ``--new-tokens`` each, ignore_eos), from held-out stdlib functions that the
embedded model never trained on (``eval_default_model.heldout_paths``):
  grounded    the prompt holds a function's source, then its def line and docstring again: the
              completion repeats code that is in the prompt (an edit, a refactor, a quote)
  unrelated   only the def line and docstring: nothing to look up but the model's own output

Each workload's 8 prompts run one request at a time and all 8 at once, without speculation, with
n-gram, and with a draft model cut from the embedded model itself (``layer_skip_draft``: its first
``--draft-layers`` layers, untrained). The engines alternate (off, ngram, draft, off, ...) so that
machine drift hits all alike; tokens/s is generated tokens over the wall time of ``LLM.generate``,
median of ``--repeats``. Each row also gives the acceptance rate (accepted / drafted), the mean
tokens per verifying decode, and whether the tokens are identical to speculation off; the script
exits 1 when any differ (``check_identical``), so a speedup can never come from wrong tokens.

    OMP_NUM_THREADS=1 python benchmarks/bench_speculative.py [--repeats 5] [--k 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_ops import LLM, SamplingParams  # noqa: E402


def workload_prompts(n: int) -> dict[str, list[str]]:
    """``n`` grounded and ``n`` unrelated prompts from held-out functions (module docstring)."""
    from eval_default_model import function_prompts, heldout_paths

    grounded, unrelated = [], []
    for path in heldout_paths(None):
        text = path.read_text(encoding="utf-8", errors="replace")
        for fp in function_prompts(text, path.name):
            lines = text.splitlines()
            # The function's source: from its def to the next line at its indent or less.
            start = next(i for i, line in enumerate(lines) if fp.prompt.splitlines()[0] in line)
            end = start + 1
            while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > fp.indent):
                end += 1
            body = "\n".join(lines[start:end])
            if not 200 <= len(body) <= 1500:
                continue
            grounded.append(body + "\n\n\n" + fp.prompt)
            unrelated.append(fp.prompt)
            if len(grounded) == n:
                return {"grounded": grounded, "unrelated": unrelated}
    return {"grounded": grounded, "unrelated": unrelated}


def layer_skip_draft(model: Path, layers: int, out: Path) -> Path:
    """A draft model cut from ``model``: its first ``layers`` decoder layers, then its own final norm
    and (tied) LM head, with no training (LayerSkip-style self-speculation: the draft shares the
    target's vocabulary and embeddings, and costs about layers / num_hidden_layers of a step)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config["layer_types"] = config.get("layer_types", ["full_attention"] * layers)[:layers]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tensors = load_file(model / "model.safetensors")
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / name).exists():
            shutil.copy(model / name, out / name)
    return out


def check_identical(on: list[list[int]], off: list[list[int]]) -> list[int]:
    """Indices of the requests whose tokens differ between speculation on and off."""
    return [i for i, (a, b) in enumerate(zip(on, off)) if a != b] + list(range(min(len(on), len(off)),
                                                                               max(len(on), len(off))))


def _spec(llm: LLM) -> tuple[int, int, int, int]:
    s = llm.stats()
    return s["spec_num_drafts"], s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"], s["spec_num_emitted_tokens"]


def _draft_seconds(llm: LLM) -> float:
    draft = llm.engine.runner.draft
    return draft.seconds if draft is not None else 0.0


def _run(llm: LLM, prompts: list[str], sp: SamplingParams, batch: int) -> list[list[int]]:
    """The prompts in batches of ``batch`` (1: one request at a time)."""
    tokens = []
    for i in range(0, len(prompts), batch):
        tokens += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], sp, use_tqdm=False)]
    return tokens


def measure(llms: dict, prompts: list[str], batch: int, new_tokens: int, repeats: int) -> dict:
    """Every engine of ``llms`` ("off" and the speculative ones) over the same prompts, interleaved;
    tokens/s from the median wall time, and each speculative engine's acceptance over the run."""
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times = {name: [] for name in llms}
    tokens = {}
    before = {name: _spec(llm) for name, llm in llms.items()}
    draft_s = {name: _draft_seconds(llm) for name, llm in llms.items()}
    for _ in range(repeats):
        for name, llm in llms.items():
            t0 = time.perf_counter()
            tokens[name] = _run(llm, prompts, sp, batch)
            times[name].append(time.perf_counter() - t0)
    n_gen = sum(len(t) for t in tokens["off"])
    out = {"off": {"tok_s": n_gen / statistics.median(times["off"])}}
    for name, llm in llms.items():
        if name == "off":
            continue
        drafts, drafted, accepted, emitted = (a - b for a, b in zip(_spec(llm), before[name]))
        tps = n_gen / statistics.median(times[name])
        out[name] = {"tok_s": tps, "speedup": tps / out["off"]["tok_s"],
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "tokens_per_verify": emitted / drafts if drafts else 0.0,
                     "verifying_steps": drafts / repeats,
                     "draft_seconds": (_draft_seconds(llm) - draft_s[name]) / repeats,
                     "differ": check_identical(tokens[name], tokens["off"])}
    return out


def explain_draft(llms: dict, config: dict, rows: list[dict]) -> dict:
    """The draft model's speedup from its parts, grounded prompts, one request: plain decoding
    emits 1 token per target step; a speculative step costs the draft's passes (measured inside
    the engine: ``DraftRunner.seconds`` over its verifying steps, in target steps) plus a verify
    pass (``verify_over_decode`` target steps, from n-gram's row of the same shape: its proposer
    costs nearly nothing, so its speedup is tokens per verify over that), and emits
    ``tokens_per_verify`` tokens."""
    row = next(r for r in rows if r["workload"] == "grounded" and r["requests"] == 1)
    ng, dm = row["ngram"], row["draft_model"]
    t_step = 1.0 / row["off"]["tok_s"]                                 # seconds per plain step
    draft_per_verify = dm["draft_seconds"] / dm["verifying_steps"] / t_step if dm["verifying_steps"] else 0.0
    verify_over_decode = ng["tokens_per_verify"] / ng["speedup"] if ng["speedup"] else float("nan")
    predicted = dm["tokens_per_verify"] / (verify_over_decode + draft_per_verify)
    text = (f"\ndraft model explained (grounded, 1 request, k = {config['num_speculative_tokens']}): its passes "
            f"cost {draft_per_verify:.2f} target steps per verifying step, the verify pass {verify_over_decode:.2f} "
            f"(n-gram's row); {dm['tokens_per_verify']:.2f} tokens per verify: expected "
            f"{dm['tokens_per_verify']:.2f} / ({verify_over_decode:.2f} + {draft_per_verify:.2f}) = {predicted:.2f}x, "
            f"measured {dm['speedup']:.2f}x")
    return {"draft_over_target_per_verify": draft_per_verify, "verify_over_decode": verify_over_decode,
            "predicted": predicted, "measured": dm["speedup"], "text": text}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=None)
    parser.add_argument("--draft-layers", type=int, default=2,
                        help="layers of the layer-skip draft model cut from the embedded model (0: no draft model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from qwen_ops.models.defaults import default_model_path

    ngram = {"method": "ngram", "num_speculative_tokens": args.k}
    if args.lookup_max is not None:
        ngram["prompt_lookup_max"] = args.lookup_max
    capped = dict(ngram, disable_by_batch_size=4)
    llms = {"off": LLM(), "ngram": LLM(speculative_config=ngram), "ngram, capped": LLM(speculative_config=capped)}
    configs = {"ngram": ngram, "ngram, capped": capped}
    if args.draft_layers:
        import tempfile

        tmp = tempfile.mkdtemp(prefix="qwen_ops_draft_")
        draft = layer_skip_draft(Path(default_model_path()), args.draft_layers, Path(tmp))
        configs["draft_model"] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
        llms["draft_model"] = LLM(speculative_config=configs["draft_model"])
    prompts = workload_prompts(args.prompts)
    print(f"embedded model; {args.prompts} prompts per workload, {args.new_tokens} new tokens each, greedy; "
          f"medians of {args.repeats}, engines interleaved")
    for name, cfg in configs.items():
        print(f"  {name}: {json.dumps(cfg)}" + (f" (its first {args.draft_layers} of 6 layers, untrained)"
                                                if name == "draft_model" else ""))
    print("\n| workload | requests at once | method | tok/s | on / off | acceptance | tokens per verify "
          "| identical |\n|---|---|---|---|---|---|---|---|")
    rows, failed = [], False
    for workload in ("grounded", "unrelated"):
        for batch in (1, 8):
            ps = prompts[workload]
            measure(llms, ps[:batch], batch, 4, 1)                     # warm every engine on these shapes
            r = measure(llms, ps, batch, args.new_tokens, args.repeats)
            print(f"| {workload} | {batch} | off | {r['off']['tok_s']:.0f} | 1.00x | | | |")
            for name in configs:
                m = r[name]
                failed |= bool(m["differ"])
                print(f"| {workload} | {batch} | {name} | {m['tok_s']:.0f} | {m['speedup']:.2f}x "
                      f"| {m['acceptance_rate']:.0%} | {m['tokens_per_verify']:.2f} "
                      f"| {'yes' if not m['differ'] else 'NO: ' + str(m['differ'])} |", flush=True)
            rows.append({"workload": workload, "requests": batch, **r})
    explain = None
    if args.draft_layers:
        explain = explain_draft(llms, configs["draft_model"], rows)
        print(explain["text"])
    if args.json:
        args.json.write_text(json.dumps({"configs": configs, "new_tokens": args.new_tokens, "rows": rows,
                                         "draft_model_explained": explain}, indent=1))
    if failed:
        print("FAIL: speculation changed greedy tokens", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
