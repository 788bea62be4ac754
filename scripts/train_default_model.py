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

Issue 27 mode (``--data DIR``, the folder ``scripts/build_training_data.py`` writes): the
training text is that folder's ``train.jsonl`` (the whole stdlib and permissively licensed
packages), files taken in a seeded order up to ``--max-train-chars``, plus its ChatML examples
(``chat_train.jsonl``) up to ``--chat-fraction`` of those characters; held-out loss is on
``heldout.jsonl``. The tokenizer gets ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (ids
0, 1, 2) and is trained on the first ``--tokenizer-chars`` of the training text; the model
folder gets a ``chat_template`` and eos ``[<|im_end|>, <|endoftext|>]``, and ``DATA.md`` and
``manifest.tsv`` from the data folder. Checkpoints (model, optimizer, generators, step, elapsed
time) go to ``--run-dir`` every ``--checkpoint-every`` steps, the last two kept; ``--resume``
continues from the latest one and gives the same weights as an uninterrupted run. The run's
log (``train_log.txt``: step, loss, lr, tokens seen, minutes) and ``loss_curve.png`` are written
to the run folder and copied beside the model. The model must fit ``--max-mb`` on disk
(``--save-dtype bfloat16`` halves it); the check runs before the first step.

The embedded model since issue 27 (6,622,848 parameters; Python 3.11.7, torch 2.13.0 CPU,
transformers 5.24.0; 126.7 min of training on a 2-core Intel Xeon VM, other work sharing it at
times; final held-out loss 2.80 on 64 windows of 512 tokens; its log and plot are beside it):
    python scripts/build_training_data.py
    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=2 python scripts/train_default_model.py \
        --data build/training_data --out qwen_ops/default_model --run-dir build/train_run \
        --steps 4800 --checkpoint-every 400 --log-every 50 --max-minutes 140 \
        --max-train-chars 75000000 --vocab-size 8192 --hidden-size 256 --num-layers 6 --num-heads 8 \
        --num-kv-heads 2 --head-dim 32 --intermediate-size 768 --seq-len 512 --batch-size 8 \
        --threads 2 --lr 2e-3 --warmup-steps 200

Usage:
    OMP_NUM_THREADS=1 python scripts/train_default_model.py [--steps N] [--max-minutes M]
        [--out qwen_ops/default_model]
    OMP_NUM_THREADS=1 python scripts/train_default_model.py --data build/training_data \
        --out build/new_model --run-dir build/train_run [--resume] [--hidden-size 384 ...]
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
import shutil
import struct
import sys
import sysconfig
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "qwen_ops" / "default_model"
EOT_TOKEN = "<|endoftext|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")  # ChatML, as Qwen's; ids 1 and 2 with --data
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
    # Issue 27 (--data) mode only:
    max_train_chars: int = 60_000_000
    chat_fraction: float = 0.1
    tokenizer_chars: int = 20_000_000
    threads: int = 1  # intra-op threads: part of the settings, since it fixes the order of float sums


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


def train_tokenizer(texts: list[str], vocab_size: int, special_tokens: tuple[str, ...] = (EOT_TOKEN,)
                    ) -> Tokenizer:
    """Byte-level BPE; the ByteLevel decoder undoes the pre-tokenizer's byte-to-char mapping."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),  # EOT_TOKEN gets id 0
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


def train_step(model, opt: torch.optim.Optimizer, batch: torch.Tensor, step: int, s: TrainSettings) -> float:
    """One AdamW step at ``step``'s learning rate on ``batch`` [B, T+1]; returns its loss. labels ==
    inputs: transformers shifts them by one inside the loss, so the seq_len + 1 tokens give seq_len
    next-token targets per row."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, s)
    loss = model(input_ids=batch, labels=batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    opt.step()
    return loss.item()


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


def save(model, tokenizer: Tokenizer, out_dir: Path, eot_id: int, chat_template: str | None = None,
         save_dtype: torch.dtype = torch.float32) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if save_dtype != torch.float32:
        import copy
        model = copy.deepcopy(model).to(save_dtype)
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
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
        tokenizer_config["additional_special_tokens"] = list(CHAT_TOKENS)
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
    # Issue 27 mode: data folder, model shape, checkpoints.
    parser.add_argument("--data", type=Path, default=None,
                        help="folder written by scripts/build_training_data.py (enables the modes below)")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / "build" / "train_run")
    parser.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop (after checkpointing) at this step, as an interruption would")
    parser.add_argument("--max-train-chars", type=int, default=TrainSettings.max_train_chars)
    parser.add_argument("--chat-fraction", type=float, default=TrainSettings.chat_fraction)
    parser.add_argument("--tokenizer-chars", type=int, default=TrainSettings.tokenizer_chars)
    parser.add_argument("--vocab-size", type=int, default=TrainSettings.vocab_size)
    parser.add_argument("--hidden-size", type=int, default=TrainSettings.hidden_size)
    parser.add_argument("--num-layers", type=int, default=TrainSettings.num_layers)
    parser.add_argument("--num-heads", type=int, default=TrainSettings.num_heads)
    parser.add_argument("--num-kv-heads", type=int, default=TrainSettings.num_kv_heads)
    parser.add_argument("--head-dim", type=int, default=TrainSettings.head_dim)
    parser.add_argument("--intermediate-size", type=int, default=TrainSettings.intermediate_size)
    parser.add_argument("--seq-len", type=int, default=TrainSettings.seq_len)
    parser.add_argument("--threads", type=int, default=TrainSettings.threads,
                        help="intra-op threads (--data mode; 2 is ~1.75x faster on the 2-core machine, "
                             "but only with nothing else running)")
    parser.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-mb", type=float, default=40.0, help="size budget of the model folder")
    args = parser.parse_args(argv)
    if args.data is not None:
        s = TrainSettings(steps=args.steps, seed=args.seed, batch_size=args.batch_size, peak_lr=args.lr,
                          warmup_steps=args.warmup_steps, vocab_size=args.vocab_size,
                          hidden_size=args.hidden_size, num_layers=args.num_layers,
                          num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                          intermediate_size=args.intermediate_size, seq_len=args.seq_len,
                          max_train_chars=args.max_train_chars, chat_fraction=args.chat_fraction,
                          tokenizer_chars=args.tokenizer_chars, threads=args.threads)
        train_from_data(s, args)
        return
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
        batch = sample_batch(train_stream, s, gen)  # [B, T+1]
        loss = train_step(model, opt, batch, step, s)
        steps_done = step + 1
        recent = (recent + [loss])[-25:]
        if steps_done % args.log_every == 0 or steps_done == s.steps:
            t = time.perf_counter() - t_train
            print(f"step {steps_done:5d}/{s.steps}  loss {loss:.3f}  "
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


# ------------------------------------------------------------------------------------------
# Issue 27 mode: data from scripts/build_training_data.py, checkpoints, log and plot
# ------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def data_texts(data_dir: Path, s: TrainSettings) -> tuple[list[str], list[str], dict]:
    """(train texts, held-out texts, counts): files in a seeded order up to ``max_train_chars``,
    then ChatML examples (seeded order) up to ``chat_fraction`` of those characters, shuffled in."""
    rng = random.Random(s.seed)
    files = read_jsonl(data_dir / "train.jsonl")
    rng.shuffle(files)
    code, total = [], 0
    for f in files:
        if total + len(f["text"]) > s.max_train_chars:
            continue  # a big file may not fit where a smaller later one does
        code.append(f["text"])
        total += len(f["text"])
    chat, chat_total = [], 0
    chat_path = data_dir / "chat_train.jsonl"
    if s.chat_fraction > 0 and chat_path.exists():
        examples = read_jsonl(chat_path)
        rng.shuffle(examples)
        for e in examples:
            if chat_total + len(e["text"]) > s.chat_fraction * total:
                break
            chat.append(e["text"])
            chat_total += len(e["text"])
    texts = code + chat
    rng.shuffle(texts)
    held = [f["text"] for f in read_jsonl(data_dir / "heldout.jsonl")]
    counts = {"code_files": len(code), "code_chars": total, "chat_examples": len(chat),
              "chat_chars": chat_total, "heldout_files": len(held)}
    return texts, held, counts


def encode_stream(tokenizer: Tokenizer, texts: list[str], eot_id: int) -> torch.Tensor:
    """Like ``token_stream`` but in batches; ChatML markers in the text encode as their special ids."""
    ids: list[int] = []
    for begin in range(0, len(texts), 256):
        for enc in tokenizer.encode_batch(texts[begin:begin + 256]):
            ids.extend(enc.ids)
            ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int32)


def model_megabytes(n_params: int, save_dtype: str, vocab_size: int) -> float:
    """Bytes of model.safetensors (tied embeddings stored once) plus ~60 B per vocab entry of tokenizer.json."""
    return (n_params * (2 if save_dtype == "bfloat16" else 4) + 60 * vocab_size) / 1e6


def write_png(path: Path, width: int, height: int, pixels: bytearray) -> None:
    """An 8-bit RGB PNG from ``pixels`` (row-major, 3 bytes each); no dependency beyond zlib."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + bytes(pixels[y * width * 3:(y + 1) * width * 3]) for y in range(height))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def plot_loss(path: Path, steps: list[int], losses: list[float], held: list[tuple[int, float]]) -> str:
    """Loss against step as a PNG: matplotlib if installed, else a bare plot (black: train loss,
    red dots: held-out loss; axes from 0 to the last step and from 0 to the largest loss)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        width, height, margin = 640, 400, 20
        pixels = bytearray(b"\xff" * width * height * 3)
        top = max(losses + [v for _, v in held]) * 1.05
        def put(x: float, y: float, rgb: tuple[int, int, int], r: int = 0) -> None:
            px = margin + int(x / max(1, steps[-1]) * (width - 2 * margin))
            py = height - margin - int(y / top * (height - 2 * margin))
            for dx in range(-r, r + 1):
                for dy in range(-r, r + 1):
                    if 0 <= px + dx < width and 0 <= py + dy < height:
                        i = ((py + dy) * width + px + dx) * 3
                        pixels[i:i + 3] = bytes(rgb)
        for i in range(width - 2 * margin):  # axes
            put(i / (width - 2 * margin) * steps[-1], 0, (128, 128, 128))
        for i in range(height - 2 * margin):
            put(0, i / (height - 2 * margin) * top, (128, 128, 128))
        for step, loss in zip(steps, losses):
            put(step, loss, (0, 0, 0), 1)
        for step, loss in held:
            put(step, loss, (220, 0, 0), 3)
        write_png(path, width, height, pixels)
        return "drawn without matplotlib (not installed): black train loss, red held-out, y from 0"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label="train (mean of last 25 steps)")
    if held:
        ax.plot(*zip(*held), "o", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    fig.savefig(path, dpi=100)
    return "matplotlib"


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(run_dir.glob("checkpoint_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, model, opt, gen: torch.Generator, state: dict) -> None:
    payload = {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
               "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
               "python_rng": random.getstate(), "state": state}
    tmp = run_dir / f"checkpoint_{step}.pt.tmp"
    torch.save(payload, tmp)
    tmp.rename(run_dir / f"checkpoint_{step}.pt")  # never a half-written latest checkpoint
    for old in sorted(run_dir.glob("checkpoint_*.pt"), key=lambda p: int(p.stem.split("_")[1]))[:-2]:
        old.unlink()


def train_from_data(s: TrainSettings, args) -> None:
    """The issue 27 run: data folder in, model folder out, resumable from ``args.run_dir``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from build_training_data import CHAT_TEMPLATE  # scripts/ (one template for builder and model)

    torch.set_num_threads(s.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(s.seed)
    torch.manual_seed(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    run_dir = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    settings_path = run_dir / "settings.json"
    settings_json = json.dumps(s.__dict__, indent=1, sort_keys=True)
    if args.resume:
        if not settings_path.exists() or settings_path.read_text() != settings_json:
            raise SystemExit(f"--resume: {settings_path} is missing or records other settings than {s}")
    else:
        for stale in [*run_dir.glob("checkpoint_*.pt"), run_dir / "train_log.txt", run_dir / "stream.pt"]:
            stale.unlink(missing_ok=True)
        settings_path.write_text(settings_json)
    t_start = time.perf_counter()
    log = open(run_dir / "train_log.txt", "a", encoding="utf-8")

    def note(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    # Data and tokenizer: built once per run and cached in the run dir (a resume reuses them).
    stream_path, tok_path = run_dir / "stream.pt", run_dir / "tokenizer.json"
    if args.resume and stream_path.exists() and tok_path.exists():
        tokenizer = Tokenizer.from_file(str(tok_path))
        cached = torch.load(stream_path)
        train_stream, held_stream, counts = cached["train"], cached["held"], cached["counts"]
    else:
        texts, held_texts, counts = data_texts(args.data, s)
        sample, n = [], 0
        for t in texts:  # the tokenizer learns from the first tokenizer_chars of the (shuffled) text
            if n >= s.tokenizer_chars:
                break
            sample.append(t)
            n += len(t)
        tokenizer = train_tokenizer(sample, s.vocab_size, (EOT_TOKEN, *CHAT_TOKENS))
        eot_id = tokenizer.token_to_id(EOT_TOKEN)
        train_stream = encode_stream(tokenizer, texts, eot_id)
        held_stream = encode_stream(tokenizer, held_texts, eot_id)
        counts["train_tokens"], counts["heldout_tokens"] = train_stream.numel(), held_stream.numel()
        tokenizer.save(str(tok_path))
        torch.save({"train": train_stream, "held": held_stream, "counts": counts}, stream_path)
        note(f"# settings {settings_json.replace(chr(10), '')}")
        note(f"# data {counts}; chars/token {counts['code_chars'] / max(1, counts['train_tokens']):.2f}; "
             f"data+tokenizer {time.perf_counter() - t_start:.0f} s")
    eot_id = tokenizer.token_to_id(EOT_TOKEN)
    if [tokenizer.token_to_id(t) for t in CHAT_TOKENS] != [1, 2]:
        raise RuntimeError(f"ChatML tokens got ids {[tokenizer.token_to_id(t) for t in CHAT_TOKENS]}, expected [1, 2]")
    train_stream, held_stream = train_stream.long(), held_stream.long()

    model = build_model(s, eot_id)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    megabytes = model_megabytes(n_params, args.save_dtype, s.vocab_size)
    if megabytes > args.max_mb:
        raise SystemExit(f"model of {n_params:,} parameters is ~{megabytes:.1f} MB in {args.save_dtype}, "
                         f"over --max-mb {args.max_mb}")
    opt = optimizer_for(model, s)
    step0, state = 0, {"elapsed_s": 0.0, "tokens_seen": 0, "recent": [], "held": []}
    ckpt = latest_checkpoint(run_dir) if args.resume else None
    if ckpt is not None:
        payload = torch.load(ckpt, weights_only=False)
        model.load_state_dict(payload["model"])
        opt.load_state_dict(payload["optimizer"])
        gen.set_state(payload["generator"])
        torch.set_rng_state(payload["torch_rng"])
        random.setstate(payload["python_rng"])
        step0, state = payload["step"], payload["state"]
        note(f"# resumed from {ckpt.name} at step {step0}")
    elif args.resume:
        note("# --resume: no checkpoint yet, starting at step 0")
    note(f"# parameters {n_params:,}; ~{megabytes:.1f} MB saved as {args.save_dtype}")
    if step0 == 0:
        note("step\tloss\tavg25\tlr\ttokens_seen\tminutes\theldout")

    t_seg = time.perf_counter()
    step = step0
    for step in range(step0, s.steps):
        minutes = (state["elapsed_s"] + time.perf_counter() - t_seg) / 60
        if minutes > args.max_minutes:
            note(f"# SAFETY STOP at step {step}: {minutes:.1f} min > --max-minutes {args.max_minutes}")
            break
        batch = sample_batch(train_stream, s, gen)  # [B, T+1]
        loss = train_step(model, opt, batch, step, s)
        state["tokens_seen"] += batch.numel() - s.batch_size
        state["recent"] = (state["recent"] + [loss])[-25:]
        done = step + 1
        held = ""
        if done % args.checkpoint_every == 0 or done == s.steps:
            held_loss = mean_loss(model, held_stream, s, s.eval_windows)
            state["held"].append((done, held_loss))
            held = f"{held_loss:.4f}"
        if done % args.log_every == 0 or held:
            elapsed = state["elapsed_s"] + time.perf_counter() - t_seg
            note(f"{done}\t{loss:.4f}\t{sum(state['recent']) / len(state['recent']):.4f}\t"
                 f"{lr_at(step, s):.3e}\t{state['tokens_seen']}\t{elapsed / 60:.2f}\t{held}")
        if done % args.checkpoint_every == 0 or done == s.steps:
            state["elapsed_s"] += time.perf_counter() - t_seg
            t_seg = time.perf_counter()
            save_checkpoint(run_dir, done, model, opt, gen, state)
        if args.stop_after is not None and done >= args.stop_after:
            note(f"# stopped after step {done} (--stop-after)")
            log.close()
            return

    # The curve from the log (it spans every segment of a resumed run).
    steps, losses = [], []
    for line in (run_dir / "train_log.txt").read_text().splitlines():
        cells = line.split("\t")
        if cells[0].isdigit():
            steps.append(int(cells[0]))
            losses.append(float(cells[2]))
    plot_note = plot_loss(run_dir / "loss_curve.png", steps, losses, state["held"]) if steps else "no steps"
    sample = greedy_sample(model, tokenizer, SAMPLE_PROMPT, 40)
    chat_prompt = "<|im_start|>user\nWrite a function that returns the sum of two numbers.<|im_end|>\n<|im_start|>assistant\n"
    chat_sample = greedy_sample(model, tokenizer, chat_prompt, 40)
    save(model, tokenizer, args.out, eot_id, CHAT_TEMPLATE, getattr(torch, args.save_dtype))
    gen_cfg = json.loads((args.out / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [tokenizer.token_to_id("<|im_end|>"), eot_id]
    (args.out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    for name in ("train_log.txt", "loss_curve.png"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, args.out / name)
    for name in ("DATA.md", "manifest.tsv"):
        if (args.data / name).exists():
            shutil.copy(args.data / name, args.out / name)
    weights = sum(p.stat().st_size for p in args.out.iterdir() if p.suffix in (".safetensors", ".json"))
    note(f"# done: {state['held'][-1:] and state['held'][-1]} held-out; {state['tokens_seen']:,} tokens; "
         f"{state['elapsed_s'] / 60:.1f} min training, {(time.perf_counter() - t_start) / 60:.1f} min this "
         f"segment; model files {weights / 1e6:.2f} MB (budget {args.max_mb}); plot: {plot_note}")
    if weights > args.max_mb * 1e6:
        raise SystemExit(f"model files are {weights / 1e6:.2f} MB, over --max-mb {args.max_mb}")
    note(f"# greedy {SAMPLE_PROMPT!r}: {sample!r}")
    note(f"# greedy chat: {chat_sample!r}")
    log.close()
    shutil.copy(run_dir / "train_log.txt", args.out / "train_log.txt")


if __name__ == "__main__":
    main()
