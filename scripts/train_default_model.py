"""Train the small embedded default model shipped in ``qwen_ops/default_model/``.

The model is a Qwen3-architecture causal LM in Hugging Face layout (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``generation_config.json``, plus a
``tokenizer_config.json`` so ``transformers.AutoTokenizer`` can load it too). It exists so
that ``qwen_ops`` runs out of the box with no download; it is not meant to be a good model,
only one whose greedy output visibly looks like its training text.

Training text: the top-level ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()['stdlib']``), sorted by name, so every machine has it offline.
Every ``HELD_OUT_EVERY``-th file (in sorted order) is held out for evaluation. The
result is reproducible for a given Python version (which fixes the text), torch version and
seed: one thread, seeded generators, deterministic algorithms. The ``--max-minutes`` safety
stop is the one thing that can cut a run short; it is logged when it fires.

Tokenizer: byte-level BPE (``tokenizers``), vocab 4096, ByteLevel pre-tokenizer and decoder
(lossless: any text round-trips), one special token ``<|endoftext|>`` (id 0) used as eos, bos
and pad. Files are joined with ``<|endoftext|>`` in the token stream.

Model (``transformers.Qwen3ForCausalLM``; transformers is a dev/test-only dependency, the
package never imports it at run time): hidden 256, 4 layers, 8 query / 2 KV heads, head_dim 32,
intermediate 768, tied embeddings, max_position_embeddings 2048, rope_theta 10000,
rms_norm_eps 1e-6. 4,065,792 parameters, trained in fp32 and saved in fp32 (16.3 MB).

Optimisation: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear warmup then
cosine decay to 10% of the peak lr, gradient clipping at 1.0, batches of 4 random 256-token
windows (257 tokens each, labels shifted inside transformers) from the training stream, one CPU
thread (the machine is shared).

Tuning (throughput is 2.4-3k tokens/s whatever the batch): a first full run with batch
16, lr 2e-3, 600 steps (20.1 min) reached train 3.62 / held-out 3.95 and a greedy
``def fibonacci(n):`` that continued with a string list (`` "a", "a", ...``). Short 0.4 M-token
probes then gave held-out loss 5.85 (batch 16, lr 2e-3), 5.79 (16, 3e-3), 5.31 (8, 2e-3),
5.42 (8, 3e-3) and 4.94 (4, 1.4e-3): at this budget more, smaller steps win, hence batch 4.

Recorded run (``python scripts/train_default_model.py``, defaults, Python 3.11.7,
torch 2.13.0 CPU, transformers 5.24.0, 1 thread on a shared 2-core VM):
    2400 steps (2.46 M tokens, ~2 passes) in 13.2 min of training (0.33 s/step), 13.3 min total.
    Final train loss 3.55 (mean of the last 25 steps); on 64 windows of 256 tokens: train 3.56,
    held-out 3.88 (uniform guessing: ln 4096 = 8.32). Files: model.safetensors 16,268,088 B,
    tokenizer.json 263,095 B, 16.53 MB in all. Under load from other jobs, run 1's pace
    (0.5 s per 4 sequences) would make the same steps take about 20 min. Greedy continuation
    of ``def fibonacci(n):`` (40 tokens):

        def fibonacci(n):
            \"\"\"
            Return a list of the same file.

            If the module is a module, module, the module, the
            module, module, the module, module.  The module is a

Usage:
    OMP_NUM_THREADS=1 python scripts/train_default_model.py [--steps N] [--max-minutes M]
        [--out qwen_ops/default_model]
"""

from __future__ import annotations

import os

# One thread everywhere, set before torch/tokenizers are imported (the machine is shared, and
# one thread also makes float reductions run in a fixed order).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "qwen_ops" / "default_model"
EOT_TOKEN = "<|endoftext|>"
HELD_OUT_EVERY = 20  # file i (sorted) is held out when i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
SAMPLE_PROMPT = "def fibonacci(n):"


@dataclass(frozen=True)
class TrainSettings:
    """Everything that determines the trained weights (besides the stdlib text itself)."""

    seed: int = 1234
    vocab_size: int = 4096
    max_chars: int = 8_000_000  # cap on the total text read; the 3.11 stdlib is 4.7 M chars
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    seq_len: int = 256
    batch_size: int = 4  # small batches won at a fixed token budget, see "Tuning" above
    steps: int = 2400  # ~0.5 s/step on one thread (shared VM) -> ~20 min
    warmup_steps: int = 100
    peak_lr: float = 1.4e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 64  # held-out 256-token windows scored at the end


def stdlib_files(max_chars: int) -> list[tuple[str, str]]:
    """Return ``(name, text)`` of the stdlib's top-level .py files, sorted, capped in total size."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > max_chars:
            break
        files.append((path.name, text))
        total += len(text)
    if not files:
        raise RuntimeError(f"no .py files found under stdlib path {stdlib}")
    return files


def split_files(files: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """Split into (train texts, held-out texts) by position in the sorted file list."""
    train = [t for i, (_, t) in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [t for i, (_, t) in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; the ByteLevel decoder undoes the pre-tokenizer's byte-to-char mapping."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TOKEN],  # gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer: Tokenizer, texts: list[str], eot_id: int) -> torch.Tensor:
    """Concatenate the encoded texts, each followed by ``eot_id``: int64 ``[num_tokens]``."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text).ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(s: TrainSettings, eot_id: int):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate_size,
        tie_word_embeddings=True,
        max_position_embeddings=s.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
        rms_norm_eps=s.rms_norm_eps,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False
    )
    return model


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``peak_lr`` to ``min_lr_ratio*peak``."""
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return s.peak_lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine)


def sample_batch(stream: torch.Tensor, s: TrainSettings, gen: torch.Generator) -> torch.Tensor:
    """Random windows of ``seq_len + 1`` tokens: int64 ``[batch_size, seq_len + 1]``."""
    starts = torch.randint(0, stream.numel() - s.seq_len - 1, (s.batch_size,), generator=gen)
    offsets = torch.arange(s.seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]]


@torch.no_grad()
def mean_loss(model, stream: torch.Tensor, s: TrainSettings, max_windows: int) -> float:
    """Mean next-token loss over consecutive non-overlapping windows from the stream start."""
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // s.seq_len)
    if n == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window")
    total = 0.0
    for chunk in range(0, n, s.batch_size):
        rows = range(chunk, min(n, chunk + s.batch_size))
        windows = torch.stack([stream[r * s.seq_len : (r + 1) * s.seq_len + 1] for r in rows])
        # windows: [rows, seq_len + 1]; labels == inputs, transformers shifts them by one,
        # so each row scores seq_len next-token predictions.
        total += model(input_ids=windows, labels=windows).loss.item() * len(rows)
    model.train()
    return total / n


def optimizer_for(model, s: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.peak_lr,
        betas=(0.9, 0.95),
    )


def greedy_sample(model, tokenizer: Tokenizer, prompt: str, new_tokens: int) -> str:
    model.eval()
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    model.train()
    return tokenizer.decode(out[0].tolist())


def save(model, tokenizer: Tokenizer, out_dir: Path, eot_id: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)  # config, safetensors, generation
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": EOT_TOKEN,
        "model_max_length": model.config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    config = json.loads((out_dir / "config.json").read_text())
    for key in ("model_type", "eos_token_id", "bos_token_id"):
        if key not in config:
            raise RuntimeError(f"saved config.json lacks {key!r}: {sorted(config)}")
    if config["eos_token_id"] != eot_id:
        raise RuntimeError(f"config.json eos_token_id = {config['eos_token_id']}, expected {eot_id}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TrainSettings.steps)
    parser.add_argument("--max-minutes", type=float, default=25.0,
                        help="safety stop on training wall time (breaks reproducibility if hit)")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=TrainSettings.batch_size)
    parser.add_argument("--lr", type=float, default=TrainSettings.peak_lr, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=TrainSettings.warmup_steps)
    parser.add_argument("--seed", type=int, default=TrainSettings.seed)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    s = TrainSettings(steps=args.steps, seed=args.seed, batch_size=args.batch_size,
                      peak_lr=args.lr, warmup_steps=args.warmup_steps)
    print(s, flush=True)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    t_start = time.perf_counter()

    files = stdlib_files(s.max_chars)
    train_texts, held_texts = split_files(files)
    tokenizer = train_tokenizer(train_texts, s.vocab_size)
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    train_stream = token_stream(tokenizer, train_texts, eot_id)
    held_stream = token_stream(tokenizer, held_texts, eot_id)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}; {len(files)} stdlib files "
          f"({len(train_texts)} train, {len(held_texts)} held out); tokens: "
          f"{train_stream.numel():,} train, {held_stream.numel():,} held out; "
          f"data+tokenizer {time.perf_counter() - t_start:.1f} s", flush=True)

    model = build_model(s, eot_id)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,} (tied embeddings counted once)", flush=True)
    opt = optimizer_for(model, s)

    t_train = time.perf_counter()
    recent: list[float] = []
    steps_done = 0
    for step in range(s.steps):
        elapsed_min = (time.perf_counter() - t_train) / 60
        if elapsed_min > args.max_minutes:
            print(f"SAFETY STOP at step {step}: {elapsed_min:.1f} min > --max-minutes "
                  f"{args.max_minutes}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        batch = sample_batch(train_stream, s, gen)  # [B, T+1]
        # labels == inputs: transformers shifts them by one inside the loss, so the
        # seq_len + 1 tokens give seq_len next-token targets per row.
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        steps_done = step + 1
        recent = (recent + [loss.item()])[-25:]
        if steps_done % args.log_every == 0 or steps_done == s.steps:
            t = time.perf_counter() - t_train
            print(f"step {steps_done:5d}/{s.steps}  loss {loss.item():.3f}  "
                  f"avg25 {sum(recent) / len(recent):.3f}  lr {lr_at(step, s):.2e}  "
                  f"{t / 60:.1f} min  {t / steps_done:.2f} s/step", flush=True)
    train_minutes = (time.perf_counter() - t_train) / 60

    train_eval = mean_loss(model, train_stream, s, s.eval_windows)
    held_eval = mean_loss(model, held_stream, s, s.eval_windows)
    sample = greedy_sample(model, tokenizer, SAMPLE_PROMPT, 40)
    save(model, tokenizer, args.out, eot_id)
    sizes = {p.name: p.stat().st_size for p in sorted(args.out.iterdir())}

    print("\n=== summary ===")
    print(f"steps {steps_done}, training {train_minutes:.1f} min, total "
          f"{(time.perf_counter() - t_start) / 60:.1f} min")
    print(f"train loss (mean of last {len(recent)} steps) {sum(recent) / len(recent):.3f}; "
          f"eval on {s.eval_windows} windows: train {train_eval:.3f}, held-out {held_eval:.3f} "
          f"(uniform would be ln {s.vocab_size} = {math.log(s.vocab_size):.2f})")
    print(f"files: {sizes}, total {sum(sizes.values()) / 1e6:.2f} MB")
    print(f"greedy continuation of {SAMPLE_PROMPT!r}:\n{sample}")


if __name__ == "__main__":
    main()
