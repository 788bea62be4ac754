"""Plain module calls against direct calls of the parts' chosen forwards (issue 43 item 2).

    OMP_NUM_THREADS=1 python benchmarks/bench_plain_calls.py [--checkpoint DIR] [--dtype float32] [--json FILE]

Since issue 43 a ``QwenDecoderLayer`` calls its norms, attention and MLP as modules, so their hooks
run. Before, it called each part's chosen forward (``_forward_method``) directly. This measures what
the plain calls cost: the one-request decode step of ``QwenEngine`` with today's layer forward and
with the old one patched back in, alternating in one process (12 blocks of steps, the order swapped
every block); it reports the medians and the median of the per-block ratios (plain / direct).
Default checkpoint: the embedded model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qwen_ops import QwenEngine
from qwen_ops.models import dense
from qwen_ops.models.defaults import default_model_path
from qwen_ops.models.loader import load_checkpoint

PLAIN = dense.QwenDecoderLayer.forward


def direct(self, h, residual, cos, sin, positions32, attn, kv_cache):
    """The layer forward before issue 43: the parts' chosen forwards, not their ``__call__``."""
    calls = self.__dict__.get("_direct_calls")
    if calls is None:
        calls = self._direct_calls = tuple(m.__dict__.get("forward", m) for m in (
            self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp))
    norm_in, attention, norm_post, mlp = calls
    if residual is None:
        x, residual = norm_in(h), h
    else:
        x, residual = norm_in(h, residual)
    x, residual = norm_post(attention(x, cos, sin, positions32, attn, kv_cache), residual)
    return mlp(x), residual


def measure(path: str, dtype: str, blocks: int = 12) -> dict:
    ckpt = load_checkpoint(path, dtype=dtype)
    engine = QwenEngine(ckpt.model, ckpt.config, max_slots=2, max_seq_len=512, block_size=16)
    steps = 48 if ckpt.config.num_hidden_layers > 10 else 200
    times = {"plain": [], "direct": []}
    tokens = {}
    for block in range(blocks):
        order = (("plain", PLAIN), ("direct", direct))
        for name, forward in order if block % 2 == 0 else order[::-1]:
            dense.QwenDecoderLayer.forward = forward
            slot = engine.allocate_slot(name)
            tok = engine.prefill(list(range(1, 33)), slot_id=slot).next_token
            seen = [tok]
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = engine.decode_step(tok, slot_id=slot).next_token
                seen.append(tok)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
            engine.free_slot(slot)
            tokens.setdefault(name, seen)
    dense.QwenDecoderLayer.forward = PLAIN
    if tokens["plain"] != tokens["direct"]:
        raise AssertionError("plain and direct calls gave different greedy tokens")
    ratios = [p / d for p, d in zip(times["plain"], times["direct"])]
    return {"checkpoint": str(path), "dtype": dtype, "layers": ckpt.config.num_hidden_layers, "steps_per_block": steps,
            "plain_ms": statistics.median(times["plain"]), "direct_ms": statistics.median(times["direct"]),
            "plain_over_direct": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(default_model_path()))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    row = measure(args.checkpoint, args.dtype)
    print(f"{row['checkpoint']} {row['dtype']}: plain {row['plain_ms']:.3f} ms, direct {row['direct_ms']:.3f} ms, "
          f"plain / direct (median of blocks) {row['plain_over_direct']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
