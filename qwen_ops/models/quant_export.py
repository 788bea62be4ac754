"""Write a full-precision checkpoint's decoder projections in the AWQ or GPTQ layout (round to
nearest, per group of ``group_size`` input features), for benchmarks and for users without a
calibrated checkpoint at hand. A calibrated AWQ / GPTQ checkpoint is more accurate: this is the
plain round-to-nearest baseline those methods improve on, in their file layouts.

    python -m qwen_ops.models.quant_export SRC DST --format gptq|awq [--bits 4|8] [--group-size 128]
        [--lm-head]     (gptq: the LM head too, ``lm_head: true``; a tied one is written from the embedding)

Each tensor is read, quantized and packed on its own (host memory: the output plus one tensor).
The layouts are those ``models/quant.py`` reads (its docstring): GPTQ's v1 ``qzeros`` store z - 1.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from qwen_ops.models.quant import AWQ_ORDER, LINEAR_NAMES


def _rtn(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Round to nearest per group along K: q, z ``[N, K]`` / ``[N, G]`` (unsigned), s fp16 ``[N, G]``."""
    n, k = w.shape
    top = (1 << bits) - 1
    wg = w.float().view(n, k // group, group)
    if symmetric:
        s = (wg.abs().amax(-1) / (top // 2)).clamp(min=1e-8).half()
        z = torch.full(s.shape, (top + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / top).clamp(min=1e-8).half()
        z = torch.clamp(torch.round(-lo / s.float()), 1, top).to(torch.int64)   # >= 1: GPTQ v1 stores z - 1
    q = torch.clamp(torch.round(wg / s.float()[..., None]) + z[..., None], 0, top).to(torch.int64)
    return q.view(n, k), z, s


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``32 / bits`` unsigned values a word along ``dim`` (lowest bits first) -> int32."""
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per):
        word |= v[..., i] << (bits * i)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.movedim(-1, dim).contiguous()


def quantized_tensors(prefix: str, w: torch.Tensor, fmt: str, bits: int, group: int) -> dict[str, torch.Tensor]:
    """The file tensors of one projection ``w [N, K]`` in ``fmt`` (``awq`` or ``gptq``)."""
    k = w.shape[1]
    if fmt == "awq":
        q, z, s = _rtn(w, 4, group, symmetric=False)
        order = list(AWQ_ORDER)

        def pack(m: torch.Tensor) -> torch.Tensor:     # word j, nibble i <- column 8 j + AWQ_ORDER[i]
            r, n = m.shape
            return _pack(m.reshape(r, n // 8, 8)[:, :, order].reshape(r, n), 4, 1)
        return {prefix + ".qweight": pack(q.T), prefix + ".qzeros": pack(z.T), prefix + ".scales": s.T.contiguous()}
    q, z, s = _rtn(w, bits, group, symmetric=bits == 8)
    return {prefix + ".qweight": _pack(q.T, bits, 0), prefix + ".qzeros": _pack((z.T - 1) & ((1 << bits) - 1), bits, 1),
            prefix + ".scales": s.T.contiguous(), prefix + ".g_idx": torch.arange(k, dtype=torch.int32) // group}


def export(src: Path, dst: Path, fmt: str, bits: int = 4, group_size: int = 128, lm_head: bool = False) -> Path:
    """Write ``dst``: ``src``'s checkpoint with its decoder projections in ``fmt``, the rest as stored.
    ``lm_head`` (gptq only, as GPTQModel's ``lm_head=True``): the LM head in the format too; a tied
    head is quantized from the embedding, which stays in full precision for the lookup."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qwen_ops.models.loader import weight_files

    if fmt not in ("awq", "gptq") or bits not in ((4,) if fmt == "awq" else (4, 8)):
        raise ValueError(f"format = {fmt!r} with bits = {bits}: expected awq with 4 bits or gptq with 4 or 8")
    if lm_head and fmt != "gptq":
        raise ValueError(f"lm_head = True with format = {fmt!r}: only gptq stores a quantized LM head")
    src, dst = Path(src), Path(dst)
    files = weight_files(src)
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    head_source = ("model.embed_tokens.weight" if "model.embed_tokens.weight" in files
                   else "model.language_model.embed_tokens.weight") if text.get("tie_word_embeddings") else "lm_head.weight"
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                t = f.get_tensor(name)
                if (len(parts) >= 3 and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES and "layers" in parts
                        and ".experts." not in name and t.dim() == 2 and t.shape[1] % group_size == 0):
                    out.update(quantized_tensors(name.removesuffix(".weight"), t, fmt, bits, group_size))
                elif name == "lm_head.weight" and lm_head:
                    pass                       # written quantized below
                else:
                    out[name] = t.clone()
                if lm_head and name == head_source:
                    if t.shape[1] % group_size:
                        raise ValueError(f"lm_head: hidden size {t.shape[1]} is not a multiple of group_size = "
                                         f"{group_size}")
                    out.update(quantized_tensors("lm_head", t, fmt, bits, group_size))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"))
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
        if fmt == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": bits == 8,
         "checkpoint_format": "gptq", "lm_head": lm_head})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)
    return dst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--format", choices=("awq", "gptq"), required=True)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--lm-head", action="store_true", help="gptq: quantize the LM head too (lm_head: true)")
    args = parser.parse_args(argv)
    print(export(args.src, args.dst, args.format, args.bits, args.group_size, args.lm_head))


if __name__ == "__main__":
    main()
