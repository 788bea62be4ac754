"""Loader memory benchmark: peak host memory of loading a ~1 GB synthetic Qwen3 checkpoint.

Target (issue 4): loading peaks at less than 1.3x the checkpoint's size in host memory. Issue 19
adds a mixture-of-experts case: a qwen3_moe checkpoint with one tensor per expert, which the
loader stacks into each layer's ``experts.gate_up_proj`` / ``down_proj`` tensor by tensor.

A synthetic checkpoint (random weights, no transformers needed) is streamed to disk tensor by
tensor, so writing it never holds it in memory. Each load runs in a fresh subprocess, which
reports ``ru_maxrss`` after importing torch and qwen_ops (the baseline) and after
``load_model``; the difference is the loader's peak, compared with the bytes of the loaded
weights (what the model must hold in the target dtype; equal to the file size when the
dtypes match, twice it for a bf16 file loaded as fp32, which no loader can beat). Pages of a file mapping count as
resident while mapped, so this catches a loader that keeps whole files mapped.

Memory is read from /proc/self/status (Linux): VmHWM, not ``ru_maxrss``, because
``ru_maxrss`` survives ``exec`` and would report the parent's size for a small child.

Run:    OMP_NUM_THREADS=1 python benchmarks/bench_loader.py [--size-mb 1024] [--keep DIR]
Tests:  OMP_NUM_THREADS=1 python -m pytest benchmarks/bench_loader.py -q  (about 40 s, 3 GB of /tmp)
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TARGET_RATIO = 1.3
_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}

# One child process per measurement; prints a JSON line.
_CHILD = r"""
import json, sys, time

def status_kib(key):  # VmRSS: resident now; VmHWM: peak resident since exec
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

import torch
import qwen_ops.models.loader as loader
base = status_kib("VmRSS")
t0 = time.perf_counter()
model = loader.load_model(sys.argv[1], sys.argv[2], "cpu")
seconds = time.perf_counter() - t0
peak = status_kib("VmHWM")
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"base_kib": base, "peak_kib": peak, "param_bytes": nbytes, "seconds": seconds}))
"""


# qwen3_moe case: experts per layer, top-k, expert intermediate size
MOE_EXPERTS, MOE_TOP_K, MOE_INTER = 32, 4, 512


def synthetic_config(size_mb: int, dtype: torch.dtype, moe: bool = False) -> dict:
    """A Qwen3 (or, with ``moe``, Qwen3-MoE) config.json whose weights take about ``size_mb`` MB in ``dtype``."""
    hidden, inter, vocab, heads, kv_heads, head_dim = 1024, 3072, 32000, 16, 4, 64
    elem = torch.empty(0, dtype=dtype).element_size()
    mlp = (3 * hidden * MOE_INTER + hidden) * MOE_EXPERTS if moe else 3 * hidden * inter
    per_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + mlp
                 + 2 * hidden + 2 * head_dim) * elem
    fixed = (2 * vocab * hidden + hidden) * elem
    layers = max(1, round((size_mb * 2 ** 20 - fixed) / per_layer))
    config = {"model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "max_position_embeddings": 4096, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
              "dtype": str(dtype).removeprefix("torch.")}
    if moe:
        config.update(model_type="qwen3_moe", num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                      moe_intermediate_size=MOE_INTER, norm_topk_prob=True)
    return config


def _per_expert(shapes: dict) -> dict:
    """The model's stacked expert shapes as a Hugging Face checkpoint stores them: one tensor per expert."""
    out = {}
    for name, shape in shapes.items():
        prefix = name.rpartition(".")[0] + "."
        if name.endswith(".experts.gate_up_proj"):
            for e in range(shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = (shape[1] // 2, shape[2])
                out[f"{prefix}{e}.up_proj.weight"] = (shape[1] // 2, shape[2])
        elif name.endswith(".experts.down_proj"):
            for e in range(shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = shape[1:]
        else:
            out[name] = shape
    return out


def write_synthetic_checkpoint(path: Path, size_mb: int = 1024, dtype: torch.dtype = torch.float32,
                               shards: int = 1, moe: bool = False) -> int:
    """Write config.json and random safetensors weights (``shards`` files); returns the weight bytes."""
    from qwen_ops.models.config import QwenConfig
    from qwen_ops.models.dense import QwenForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config_dict = synthetic_config(size_mb, dtype, moe)
    (path / "config.json").write_text(json.dumps(config_dict, indent=2))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in QwenForCausalLM(QwenConfig.from_dict(config_dict)).named_parameters()}
    shapes = _per_expert(shapes)
    names = list(shapes)
    groups = [names[i::shards] for i in range(shards)]
    files = ["model.safetensors"] if shards == 1 else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                                                         for i in range(shards)]
    total = 0
    for file, group in zip(files, groups):
        total += _stream_safetensors(path / file, {n: shapes[n] for n in group}, dtype)
    if shards > 1:
        weight_map = {n: files[i] for i, group in enumerate(groups) for n in group}
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _stream_safetensors(file: Path, shapes: dict, dtype: torch.dtype) -> int:
    """The safetensors layout (u64 header size, JSON header, raw data) written one tensor at a time."""
    elem = torch.empty(0, dtype=dtype).element_size()
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = elem
        for d in shape:
            n *= d
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    g = torch.Generator().manual_seed(0)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for shape in shapes.values():
            data = (torch.randn(shape, generator=g) * 0.02).to(dtype)
            f.write(data.view(-1).view(torch.uint8).numpy().tobytes())
    return offset


def measure(path: Path, dtype: str) -> dict:
    """Load ``path`` as ``dtype`` in a fresh process; peak resident memory above the post-import one."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype], env=env, check=True,
                         capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r["peak_mib"] = (r["peak_kib"] - r["base_kib"]) / 1024
    r["param_mib"] = r["param_bytes"] / 2 ** 20
    r["ratio"] = r["peak_mib"] / r["param_mib"]
    return r


# (name, file dtype, shards, load dtype, mixture of experts stored per expert)
CASES = (("single-file fp32 -> fp32", torch.float32, 1, "float32", False),
         ("4 shards fp32 -> fp32", torch.float32, 4, "float32", False),
         ("single-file fp32 -> bf16", torch.float32, 1, "bfloat16", False),
         ("single-file bf16 -> fp32", torch.bfloat16, 1, "float32", False),
         ("MoE per-expert, 4 shards", torch.float32, 4, "float32", True))


def run(size_mb: int, root: Path) -> list[tuple[str, int, dict]]:
    results = []
    for name, file_dtype, shards, load_dtype, moe in CASES:
        ckpt = root / f"{str(file_dtype).removeprefix('torch.')}-{shards}{'-moe' if moe else ''}"
        if not (ckpt / "config.json").exists():
            file_mb = size_mb if file_dtype == torch.float32 else size_mb // 2
            write_synthetic_checkpoint(ckpt, file_mb, file_dtype, shards, moe)
        file_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        results.append((name, file_bytes, measure(ckpt, load_dtype)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--keep", type=Path, help="directory for the synthetic checkpoints (kept)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        print(f"{'case':26} {'file MiB':>8} {'params MiB':>10} {'peak MiB':>8} {'peak/file':>9} "
              f"{'peak/params':>11} {'load s':>6}")
        worst = 0.0
        for name, file_bytes, r in run(args.size_mb, root):
            worst = max(worst, r["ratio"])
            file_mib = file_bytes / 2 ** 20
            print(f"{name:26} {file_mib:8.0f} {r['param_mib']:10.0f} {r['peak_mib']:8.0f} "
                  f"{r['peak_mib'] / file_mib:9.3f} {r['ratio']:11.3f} {r['seconds']:6.2f}")
        print(f"worst peak/params = {worst:.3f} (target < {TARGET_RATIO})")
        sys.exit(0 if worst < TARGET_RATIO else 1)


def test_loader_peak_memory_below_target(tmp_path):
    """Every case peaks below TARGET_RATIO x the loaded weights (about 1 GB of them)."""
    import pytest

    if not Path("/proc/self/status").exists():
        pytest.skip("peak memory is read from /proc/self/status, which only Linux has")
    for name, _, r in run(1024, tmp_path):
        assert r["ratio"] < TARGET_RATIO, f"{name}: peak {r['peak_mib']:.0f} MiB for {r['param_mib']:.0f} MiB"


if __name__ == "__main__":
    main()
