"""Quantized checkpoints' loading, in one place: which of a model's layers a checkpoint holds quantized,
the file tensors each reads, and their conversion into the layers' buffers.

The loader (``models/loader.py``) calls it twice: ``prepare`` before it lists the model's parameters
(quantized layers are swapped in on the meta device, and the file tensors they read are named, so the
loader's checks skip them), and ``fill`` after the full-precision tensors are copied. Each format's own
rules (which tensors a layer has, how they convert) are ``models/quant.py``'s functions, asked only
from here; tensors are read through the format layer (``models/formats.py``), so a GGUF file's blocks
and a safetensors file's AWQ / GPTQ / fp8 tensors take the same path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from qwen_ops.models import quant as Q
from qwen_ops.models.config import QwenConfig
from qwen_ops.models.formats import CheckpointError, MappedFiles, checkpoint_name

logger = logging.getLogger(__name__)
_QUANT_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_scale_inv")


@dataclass
class QuantPlan:
    """The quantized layers of one load: ``{checkpoint prefix: module name}`` of the QuantLinear layers and
    of the QuantMoeExperts, and ``tensors``, every file tensor they read."""
    quant: "Q.QuantConfig"
    quantized: dict[str, str] = field(default_factory=dict)
    experts: dict[str, str] = field(default_factory=dict)
    tensors: set[str] = field(default_factory=set)


def prepare(path: Path, model: nn.Module, quant: Optional["Q.QuantConfig"], files: dict[str, Path],
            config: QwenConfig, dtype: torch.dtype) -> Optional[QuantPlan]:
    """Swap the layers ``quant`` holds quantized into ``model`` (meta device) and name the file tensors they
    read; None when nothing is quantized."""
    if quant is None:
        return None
    quantized, experts = _quantize_modules(path, model, quant, files, config, dtype)
    return QuantPlan(quant, quantized, experts, _quantized_tensors(quant, quantized, experts, model, files))


def fill(plan: Optional[QuantPlan], files: dict[str, Path], model: nn.Module, config: QwenConfig,
         dtype: torch.dtype, device: torch.device) -> None:
    """After the full-precision tensors: the quantized layers' buffers from their file tensors, a GGUF
    file's tied head on its quantized token table, online int8's LM head."""
    if plan is None:
        return
    quant = plan.quant
    if plan.quantized:
        _copy_quantized(files, plan.quantized, model, quant, device)
    if plan.experts:
        _copy_quantized_experts(files, plan.experts, model, quant, device)
    if isinstance(model.model.embed_tokens, Q.QuantEmbedding) and config.tie_word_embeddings and model.lm_head is not None:
        model.model.embed_tokens.tied_head(model.lm_head)
    if quant.online and quant.method == "int8":
        _quantize_lm_head(model, quant, dtype, device)
    if quant.activations == "int8" and device.type == "cpu":
        from qwen_ops.ops import host

        if host.why_unavailable() is None and not host.int8_dot_products():
            logger.warning("quantization with int8 activations (%s): this CPU (or build) has no AVX512-VNNI, so "
                           "the products run a portable loop, correct but tens of times slower than the "
                           "weight-only kernels; load without the _a8 / w8a8 choice there", quant.kernel)


def _quantize_lm_head(model: nn.Module, quant: "Q.QuantConfig", dtype: torch.dtype, device: torch.device) -> None:
    """Online int8 quantizes the LM head as well (llama.cpp's Q8_0 does): at Qwen3-0.6B's size its
    151,936 x 1,024 weight is a third of the bytes a decode step reads. The embedding (the same
    tensor when tied) stays in the model dtype for the lookup."""
    head = model.lm_head
    layer = Q.QuantLinear.like(head, quant, dtype)
    for key, value in Q.quantize_online(head.weight.detach(), "int8").items():
        layer._buffers[key] = value.to(device)
    model.lm_head = layer


def _quantize_modules(path: Path, model: nn.Module, quant: "Q.QuantConfig", files: dict[str, Path],
                      config: QwenConfig, dtype: torch.dtype) -> tuple[dict[str, str], dict[str, str]]:
    """Replace the decoder layers' projections (``quant.LINEAR_NAMES``) that the checkpoint stores
    quantized (online: all of them) by meta-device QuantLinear layers, and the routed experts stored
    quantized by QuantMoeExperts; returns ``{checkpoint prefix: module name}`` of each. A quantized
    tensor the model cannot take (an LM head) is an error naming it."""
    from qwen_ops.models.moe import MoeExperts

    quantized: dict[str, str] = {}
    experts: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        parent_name, _, attr = name.rpartition(".")
        if isinstance(module, MoeExperts) and ".layers." in f".{name}":
            prefix = checkpoint_name(name + ".gate_up_proj", config).removesuffix(".gate_up_proj")
            if Q.experts_quantized_in_files(quant, prefix, files):
                try:
                    layer = Q.QuantMoeExperts.like(module, quant)
                except ValueError as e:
                    raise CheckpointError(f"{path}: experts {prefix!r}: {e}") from None
                setattr(model.get_submodule(parent_name), attr, layer)
                experts[prefix] = name
            continue
        if not (isinstance(module, nn.Linear) and leaf in Q.LINEAR_NAMES and ".layers." in f".{name}"):
            continue
        prefix = checkpoint_name(name + ".weight", config).removesuffix(".weight")
        if not Q.is_quantized_in_files(quant, prefix, files):
            continue
        try:
            layer = Q.QuantLinear.like(module, quant, dtype, prefix + ".weight")
        except ValueError as e:
            raise CheckpointError(f"{path}: layer {prefix!r}: {e}") from None
        setattr(model.get_submodule(parent_name), attr, layer)
        quantized[prefix] = name
    if quant.method == "gguf":
        _quantize_gguf_embeddings(path, model, quant, config, dtype, quantized)
    if quant.lm_head:           # gptq lm_head: true (untied from the embedding, which stays in full precision)
        if not Q.is_quantized_in_files(quant, "lm_head", files):
            raise CheckpointError(f"{path}: quantization_config.lm_head = true, but the checkpoint has no "
                                  f"quantized LM head (expected {', '.join(Q.checkpoint_tensors(quant, 'lm_head'))})")
        try:
            model.lm_head = Q.QuantLinear.like(model.lm_head, quant, dtype)
        except ValueError as e:
            raise CheckpointError(f"{path}: layer 'lm_head': {e}") from None
        quantized["lm_head"] = "lm_head"
    if not quant.online:
        taken = _quantized_tensors(quant, quantized, experts, model, files)
        stray = sorted(n for n in files if n.endswith(_QUANT_SUFFIXES) and n not in taken)
        if stray:
            raise CheckpointError(f"{path}: quantized tensors of layers that qwen_ops does not quantize "
                                  f"({quant.method}): {', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''} "
                                  "(an LM head is read quantized only with quantization_config.lm_head true)")
    if not quantized and not experts and quant.method != "gguf":
        raise CheckpointError(f"{path}: quantization {quant.method!r} but no layer of the checkpoint is stored "
                              f"quantized (expected tensors such as {Q.checkpoint_tensors(quant, 'model.layers.0.self_attn.q_proj')})")
    return quantized, experts


def _quantize_gguf_embeddings(path: Path, model: nn.Module, quant: "Q.QuantConfig", config: QwenConfig,
                              dtype: torch.dtype, quantized: dict[str, str]) -> None:
    """A GGUF file's token table (and its own output table, if untied) held as stored where a product
    serves the type: the embedding a ``QuantEmbedding``, the LM head a ``QuantLinear``; a tied head shares
    the table's buffers (``QuantEmbedding.tied_head``, after loading), as llama.cpp holds it once."""
    embed_name = "model.embed_tokens.weight"
    try:
        if embed_name in quant.types and isinstance(model.model.embed_tokens, nn.Embedding):
            model.model.embed_tokens = Q.QuantEmbedding.like(model.model.embed_tokens, quant, dtype, embed_name)
            quantized["model.embed_tokens"] = "model.embed_tokens"
            if config.tie_word_embeddings and model.lm_head is not None:
                model.lm_head = Q.QuantLinear.like(model.lm_head, quant, dtype, embed_name)
        if "lm_head.weight" in quant.types and not config.tie_word_embeddings and model.lm_head is not None:
            model.lm_head = Q.QuantLinear.like(model.lm_head, quant, dtype, "lm_head.weight")
            quantized["lm_head"] = "lm_head"
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _quantized_tensors(quant: "Q.QuantConfig", quantized: dict[str, str], experts: dict[str, str], model: nn.Module,
                       files: dict[str, Path]) -> set[str]:
    """The file tensors that the quantized layers and experts read."""
    taken = {t for prefix in quantized for t in Q.checkpoint_tensors(quant, prefix)}
    for prefix, name in experts.items():
        taken.update(Q.expert_tensors(quant, prefix, model.get_submodule(name).num_experts, files))
    return taken


def _copy_quantized_experts(files: dict[str, Path], experts: dict[str, str], model: nn.Module,
                            quant: "Q.QuantConfig", device: torch.device) -> None:
    """Fill each QuantMoeExperts' stacked buffers one expert projection at a time (converted as
    QuantLinear's, ``quant.convert_layer``): no layer's full-precision or stacked file tensors are
    ever held whole."""
    with MappedFiles(files) as mapped:
        for prefix, module_name in experts.items():
            layer = model.get_submodule(module_name)
            for key, buf in list(layer._buffers.items()):
                if buf is not None:
                    layer._buffers[key] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
            stacked = quant.online and prefix + ".gate_up_proj" in files
            for e in range(layer.num_experts):
                for proj, (buffer, rows, n, k) in layer.projections().items():
                    groups = getattr(layer, buffer + "_scales").shape[2]
                    if stacked:           # transformers' stacked layout, quantized one expert's rows at a time
                        source = prefix + (".down_proj" if buffer == "w2" else ".gate_up_proj")
                        tensors = {f"{prefix}.{e}.{proj}.weight": mapped.row(source, e)[rows]}
                    else:
                        names = Q.checkpoint_tensors(quant, f"{prefix}.{e}.{proj}")
                        source = names[0]
                        tensors = {t: mapped.tensor(t) for t in names}
                    try:
                        converted = Q.convert_layer(quant, f"{prefix}.{e}.{proj}", tensors, n, k, groups)
                    except ValueError as err:
                        raise CheckpointError(f"{files[source]}: {err}") from None
                    if "perm" in converted:
                        raise CheckpointError(f"{files[source]}: expert {prefix}.{e}.{proj} has act-order "
                                              "groups (quantization_config.desc_act true with a g_idx that is not "
                                              "k // group_size): not supported for mixture-of-experts layers")
                    getattr(layer, buffer)[e, rows] = converted["qweight"].to(device)
                    getattr(layer, buffer + "_scales")[e, rows] = converted["scales"].to(device)
                    if "zeros" in converted:
                        getattr(layer, buffer + "_zeros")[e, rows] = converted["zeros"].to(device)
                    del tensors, converted
                    mapped.release()


def _copy_quantized(files: dict[str, Path], quantized: dict[str, str], model: nn.Module, quant: "Q.QuantConfig",
                    device: torch.device) -> None:
    """Read each quantized layer's tensors (mapped, a window of bytes at a time as in
    :func:`_copy_tensors`) and convert them into its QuantLinear's buffers on ``device``."""
    with MappedFiles(files) as mapped:
        for prefix, module_name in quantized.items():
            layer = model.get_submodule(module_name)
            read = mapped.raw if quant.method == "gguf" else mapped.tensor
            tensors = {name: read(name) for name in Q.checkpoint_tensors(quant, prefix)}
            try:
                buffers = Q.convert_layer(quant, prefix, tensors, layer.out_features, layer.in_features,
                                          layer.scales.shape[1])
            except ValueError as e:
                raise CheckpointError(f"{files[next(iter(tensors))]}: {e}") from None
            del tensors
            for key, value in buffers.items():
                layer._buffers[key] = value.to(device=device, copy=True)   # never a view of the mapped file
            mapped.release()
