"""GGUF files (llama.cpp's, Ollama's, LM Studio's format) as one more checkpoint format beside safetensors.

Read with ggml's own ``gguf`` package (``gguf.GGUFReader``: the header, the metadata and memory-mapped
tensor data; ``gguf.quants.dequantize`` for the block types), never parsed by hand. What a file holds
becomes what a Hugging Face checkpoint directory gives, once, here:

* the metadata -> a config.json-shaped dict (``config_dict``) that ``QwenConfig.from_dict`` reads as it
  reads any config.json (head_dim from ``key_length``, rope base and scaling, norm eps, tied embeddings
  when the file has no ``output.weight``, MoE sizes);
* ``tokenizer.ggml.*`` -> a ``tokenizers.Tokenizer`` built as transformers builds it from the same file
  (byte-level BPE: vocabulary, merges, control tokens as special tokens, the pre-tokenizer's split);
  ``tokenizer.chat_template`` -> the chat template;
* tensor names -> Hugging Face's (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).
  llama.cpp's converter permutes the rows of a llama model's q and k projections (its rotary pairs are
  adjacent, Hugging Face's are half a head apart); the permutation is undone here, on whole rows, so it
  applies to quantized blocks as well.

The loader (``models/loader.py``) reads tensors through ``open_weights``: a handle with safetensors'
``safe_open`` interface (``keys``, ``get_tensor``, ``get_slice``), so its checks, tensor-parallel slices
and online quantization work unchanged on a GGUF file; ``GGUFHandle.raw`` gives a tensor's quantized
blocks to ``quant.convert_layer`` where a product op serves the type exactly (``NATIVE``).

Block types (``gguf.GGMLQuantizationType``) and what each becomes (``w`` the weight, per block of
``block`` consecutive inputs of one output row):

========  ============================  =================================================
type      the file's formula            held as (QuantLinear; ``mins`` added per group)
========  ============================  =================================================
Q8_0      w = d * q,  q int8            int8 q, scales d, groups of 32
Q4_0      w = d * (q - 8)               int4 q, zeros 8, scales d, groups of 32
Q4_1      w = d * q + m                 int4 q, zeros 0, scales d, mins m, groups of 32
Q5_0      w = d * (q - 16), q 5 bits    int8 q - 16, scales d, groups of 32
Q5_1      w = d * q + m, q 5 bits       int8 q, scales d, mins m, groups of 32
Q4_K      w = d*sc * q - dmin*mn        int4 q, zeros 0, scales d*sc, mins -dmin*mn, groups of 32
Q5_K      as Q4_K, q 5 bits             int8 q, scales d*sc, mins -dmin*mn, groups of 32
Q6_K      w = d*sc * (q - 32), 6 bits   int8 q - 32, scales d*sc, groups of 16
========  ============================  =================================================

F32, F16 and BF16 tensors load as floats in the model dtype; every other type a ``gguf`` release
dequantizes (Q2_K, Q3_K, IQ*) is dequantized at load to the model dtype, and the load says which.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path, PosixPath
from typing import Any, Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
# general.architecture -> the model_type it loads as. llama is Qwen2's architecture without q/k/v biases.
ARCHITECTURE_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "llama", "qwen2moe": "qwen2_moe",
                      "qwen3moe": "qwen3_moe"}
# Block types that load at all (floats, and what gguf.quants dequantizes), and those a product serves as stored.
FLOAT_TYPES = ("F32", "F16", "BF16")
NATIVE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
DEQUANTIZED = ("Q8_1", "Q2_K", "Q3_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S",
               "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0")
SUPPORTED_TYPES = FLOAT_TYPES + NATIVE + DEQUANTIZED
# The QuantLinear layout each native type takes: (scheme, group size, has mins).
NATIVE_LAYOUT = {"Q8_0": ("int8", 32, False), "Q4_0": ("int4", 32, False), "Q4_1": ("int4", 32, True),
                 "Q5_0": ("int8", 32, False), "Q5_1": ("int8", 32, True), "Q4_K": ("int4", 32, True),
                 "Q5_K": ("int8", 32, True), "Q6_K": ("int8", 16, False)}

# GGUF tensor names -> Hugging Face's: per layer, and the three outside the layers.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Stacked experts [E, rows, cols]: served to the loader one expert at a time, under the per-expert names.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+?)\.(weight|bias)$")
# Metadata a file may carry that has no meaning here (llama.cpp's own bookkeeping).
_ROPE_SCALING = {"none": None, "linear": "linear", "yarn": "yarn"}

# The pre-tokenizer split of each ``tokenizer.ggml.pre`` that is not GPT-2's (as transformers' GGUF
# tokenizer reads them): Qwen2's and Llama 3's, each the model's own published regular expression.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "llama3": _LLAMA3_SPLIT,
                        "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT}
CONTROL, USER_DEFINED = 3, 4          # tokenizer.ggml.token_type values


class GGUFError(ValueError):
    """A GGUF file is unreadable or holds what qwen_ops cannot run; the message names the file."""


def is_gguf(path: Any) -> bool:
    """Whether ``path`` is a GGUF file: a file named ``*.gguf`` or starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class GGUFFile:
    """One GGUF file, read once: its metadata, and its tensors under Hugging Face names."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e})") from None
        if magic != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (its first bytes are {magic!r}, expected {MAGIC!r})")
        import gguf

        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:     # the reader raises ValueError, IndexError, struct errors on a damaged file
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from None
        self.fields = self.reader.fields
        self.architecture = self.meta("general.architecture")
        if self.architecture not in ARCHITECTURE_TYPES:
            raise GGUFError(f"{self.path}: general.architecture = {self.architecture!r} is not supported; supported: "
                            f"{', '.join(ARCHITECTURE_TYPES)}")
        self.tensors: dict[str, Any] = {}          # HF name -> gguf ReaderTensor
        self.experts: dict[str, tuple[Any, int]] = {}   # HF per-expert name -> (stacked tensor, expert)
        problems = []
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in SUPPORTED_TYPES:
                problems.append(f"tensor {t.name!r} has type {kind}")
                continue
            self._add(t)
        if problems:
            raise GGUFError(f"{self.path}: unsupported tensor types: {'; '.join(problems[:5])}"
                            f"{' ...' if len(problems) > 5 else ''}; supported: {', '.join(SUPPORTED_TYPES)}")
        self._check_sizes()
        self._llama_heads = ((self.meta_arch("attention.head_count"), self.meta_arch("attention.head_count_kv"))
                             if self.architecture == "llama" else None)
        self._cache: tuple[str, Optional[torch.Tensor]] = ("", None)   # the last stacked expert tensor dequantized

    # -- metadata ----------------------------------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise GGUFError(f"{self.path}: metadata {key!r} is unreadable ({e})") from None

    def meta_arch(self, key: str, default: Any = None) -> Any:
        return self.meta(f"{self.architecture}.{key}", default)

    def config_dict(self) -> dict:
        """The file's hyperparameters as a config.json would hold them (transformers' names)."""
        need = {}
        for key in ("block_count", "embedding_length", "attention.head_count"):
            value = self.meta_arch(key)
            if value is None:
                raise GGUFError(f"{self.path}: metadata {self.architecture}.{key} is missing")
            need[key] = int(value)
        heads = need["attention.head_count"]
        hidden = need["embedding_length"]
        embed = self.tensors.get("model.embed_tokens.weight")
        vocab = self.meta_arch("vocab_size") or (int(embed.shape[1]) if embed is not None else None)
        if vocab is None:
            tokens = self.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else None
        if vocab is None:
            raise GGUFError(f"{self.path}: cannot tell the vocabulary size (no {self.architecture}.vocab_size, "
                            "token_embd.weight or tokenizer.ggml.tokens)")
        head_dim = self.meta_arch("attention.key_length") or self.meta_arch("rope.dimension_count") or hidden // heads
        d: dict[str, Any] = {
            "model_type": ARCHITECTURE_TYPES[self.architecture],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "num_hidden_layers": need["block_count"],
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.meta_arch("attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "max_position_embeddings": int(self.meta_arch("context_length", 32768)),
            "rms_norm_eps": float(self.meta_arch("attention.layer_norm_rms_epsilon", 1e-6)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "hidden_act": "silu",
        }
        ffn = self.meta_arch("feed_forward_length")
        if ffn is not None:
            d["intermediate_size"] = int(ffn)
        rope = {"rope_type": "default", "rope_theta": float(self.meta_arch("rope.freq_base", 10000.0))}
        kind = self.meta_arch("rope.scaling.type", "none")
        if kind not in _ROPE_SCALING:
            raise GGUFError(f"{self.path}: {self.architecture}.rope.scaling.type = {kind!r}; supported: "
                            f"{', '.join(_ROPE_SCALING)}")
        if _ROPE_SCALING[kind] is not None:
            rope["rope_type"] = _ROPE_SCALING[kind]
            rope["factor"] = float(self.meta_arch("rope.scaling.factor", 1.0))
            original = self.meta_arch("rope.scaling.original_context_length")
            if original is not None:
                rope["original_max_position_embeddings"] = int(original)
        d["rope_parameters"] = rope
        d["rope_theta"] = rope["rope_theta"]
        if self.architecture == "llama":
            d["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self.tensors
        if self.architecture in ("qwen2moe", "qwen3moe"):
            experts = self.meta_arch("expert_count")
            if experts is None:
                raise GGUFError(f"{self.path}: metadata {self.architecture}.expert_count is missing")
            d["num_experts"] = int(experts)
            d["num_experts_per_tok"] = int(self.meta_arch("expert_used_count", 8))
            d["moe_intermediate_size"] = int(self.meta_arch("expert_feed_forward_length", ffn or 0))
            shared = self.meta_arch("expert_shared_feed_forward_length")
            if shared is not None:
                d["shared_expert_intermediate_size"] = int(shared)
            elif self.architecture == "qwen2moe":
                d["shared_expert_intermediate_size"] = 0
            d["norm_topk_prob"] = bool(self.meta_arch("expert_weights_norm", self.architecture == "qwen3moe"))
            d.setdefault("intermediate_size", d["moe_intermediate_size"])
        eos = self.meta("tokenizer.ggml.eos_token_id")
        if eos is not None:
            d["eos_token_id"] = int(eos)
        bos = self.meta("tokenizer.ggml.bos_token_id")
        if bos is not None:
            d["bos_token_id"] = int(bos)
        return d

    # -- tensors -----------------------------------------------------------------------------------
    def _add(self, t) -> None:
        if t.name in _GLOBAL_TENSORS:
            self.tensors[_GLOBAL_TENSORS[t.name]] = t
            return
        m = _LAYER_NAME.match(t.name)
        if m is not None and m.group(2) in _EXPERT_TENSORS:
            layer, proj = m.group(1), _EXPERT_TENSORS[m.group(2)]
            for e in range(int(t.shape[2]) if len(t.shape) == 3 else 0):
                self.experts[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = (t, e)
            return
        if m is not None and m.group(2) in _LAYER_TENSORS:
            self.tensors[f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"] = t
            return
        # Anything else keeps its GGUF name, so that the loader's check reports it as unexpected.
        self.tensors[t.name] = t

    def _check_sizes(self) -> None:
        """Each tensor's data against its shape and type (a file cut short, or a header that lies)."""
        import gguf

        for t in self.reader.tensors:
            if t.tensor_type.name not in SUPPORTED_TYPES:
                continue
            block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
            n = int(np.prod(t.shape))
            if n % block:
                raise GGUFError(f"{self.path}: tensor {t.name!r} ({t.tensor_type.name}) has {n} elements, not a "
                                f"multiple of its block of {block}")
            want = n // block * size
            if int(t.data.nbytes) != want:
                raise GGUFError(f"{self.path}: tensor {t.name!r} ({t.tensor_type.name}, shape "
                                f"{list(reversed([int(s) for s in t.shape]))}) holds {int(t.data.nbytes)} bytes, "
                                f"expected {want}")

    def names(self) -> list[str]:
        return list(self.tensors) + list(self.experts)

    def type_of(self, name: str) -> str:
        t = self.tensors.get(name)
        if t is None:
            t = self.experts[name][0]
        return t.tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """Hugging Face's (torch's) shape: GGUF lists dimensions innermost first."""
        if name in self.experts:
            t, _ = self.experts[name]
            return tuple(int(s) for s in reversed(t.shape[:2]))
        return tuple(int(s) for s in reversed(self.tensors[name].shape))

    def _row_order(self, name: str, rows: int) -> Optional[np.ndarray]:
        """The file row of each Hugging Face row of a llama q / k projection (llama.cpp's converter
        interleaves each head's two rotary halves), else None (rows in order)."""
        if self._llama_heads is None or not name.endswith((".self_attn.q_proj.weight", ".self_attn.k_proj.weight",
                                                          ".self_attn.q_proj.bias", ".self_attn.k_proj.bias")):
            return None
        heads = self._llama_heads[0] if ".q_proj." in name else self._llama_heads[1]
        half = rows // heads // 2
        # HF row (h, i, j) [head, half, pair index] is file row (h, j, i): the file holds pairs adjacent.
        return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        """A tensor's stored blocks, ``[rows, bytes a row]`` uint8 (rows in Hugging Face's order), and its type."""
        t = self.tensors[name]
        data = np.asarray(t.data)
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        data = data.reshape(rows, -1).view(np.uint8)
        order = self._row_order(name, rows)
        if order is not None:
            data = data[order]
        return data, t.tensor_type.name

    def read(self, name: str, rows: Optional[slice] = None) -> torch.Tensor:
        """A tensor (or ``rows`` of it) as fp32, dequantized where its type is quantized."""
        from gguf import quants

        if name in self.experts:
            t, e = self.experts[name]
            key = t.name
            if self._cache[0] != key:        # experts of one stacked tensor are read in turn: dequantize it once
                self._cache = ("", None)
                self._cache = (key, torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type),
                                                              dtype=np.float32, order="C")))
            full = self._cache[1][e]
            return full if rows is None else full[rows]
        t = self.tensors[name]
        shape = self.shape(name)
        data = np.asarray(t.data)
        if len(shape) > 1:
            data = data.reshape(shape[0], -1)
        order = self._row_order(name, shape[0]) if len(shape) else None
        if rows is not None:
            index = np.arange(shape[0])[rows]
            data = data[index if order is None else order[index]]
        elif order is not None:
            data = data[order]
        out = np.asarray(quants.dequantize(data, t.tensor_type), dtype=np.float32)
        if not out.flags.writeable or not out.flags.c_contiguous:      # a float tensor: a view of the mapped file
            out = np.array(out, dtype=np.float32, order="C")
        return torch.from_numpy(out).reshape(
            (len(range(shape[0])[rows]),) + shape[1:] if rows is not None else shape)

    def release(self) -> None:
        """Drop the stacked expert tensor kept dequantized while a load reads its experts in turn (the
        file, carried by a ``GGUFPath``, lives as long as the model's path)."""
        self._cache = ("", None)

    def summary(self, native: set[str]) -> str:
        """One line: how the file's tensors are held (``native``: the names held quantized)."""
        held = Counter(self.type_of(n) for n in native)
        floats = Counter(self.type_of(n) for n in self.tensors if n not in native and self.type_of(n) in FLOAT_TYPES)
        dequant = Counter(self.type_of(n) for n in self.names() if n not in native and self.type_of(n) not in FLOAT_TYPES)
        parts = []
        if held:
            parts.append("quantized as stored: " + ", ".join(f"{k} x{v}" for k, v in sorted(held.items())))
        if dequant:
            parts.append("dequantized at load: " + ", ".join(f"{k} x{v}" for k, v in sorted(dequant.items())))
        if floats:
            parts.append("float: " + ", ".join(f"{k} x{v}" for k, v in sorted(floats.items())))
        return f"{self.path.name} ({self.architecture}): " + "; ".join(parts)


class GGUFPath(PosixPath):
    """The loader's ``files`` value for a GGUF file's tensors: the file's path, carrying the file read once."""

    gguf: GGUFFile


def weight_path(file: GGUFFile) -> GGUFPath:
    p = GGUFPath(file.path)
    p.gguf = file
    return p


class _Slice:
    """``safe_open(...).get_slice(name)``'s interface over one tensor of a GGUF file."""

    def __init__(self, file: GGUFFile, name: str) -> None:
        self.file, self.name = file, name

    def get_shape(self) -> list[int]:
        return list(self.file.shape(self.name))

    def get_dtype(self) -> str:
        return "F32"            # every tensor reads as fp32 (dequantized where stored in blocks)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, tuple):
            first, rest = index[0], index[1:]
        else:
            first, rest = index, ()
        if isinstance(first, int):
            return self.file.read(self.name)[(first, *rest)]
        t = self.file.read(self.name, first if first != slice(None) else None)
        return t[(slice(None), *rest)] if rest else t


class GGUFHandle:
    """``safe_open``'s interface (``keys``, ``get_tensor``, ``get_slice``; a context manager) over a
    GGUF file's tensors under Hugging Face names, every one as fp32; ``raw`` for the stored blocks."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file

    def __enter__(self) -> "GGUFHandle":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return self.file.names()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.file.read(name)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.file, name)

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        return self.file.raw(name)


# ----------------------------------------------------------------------------------------------
# The tokenizer and the chat template
# ----------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies are spelled in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(file: GGUFFile):
    """A ``tokenizers.Tokenizer`` from the file's ``tokenizer.ggml.*``, as transformers builds one from it:
    byte-level BPE (``gpt2``) with the file's merges; control tokens special, user-defined tokens added;
    the pre-tokenizer's split by ``tokenizer.ggml.pre``; BOS prepended when ``add_bos_token``. None when
    the file has no vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = file.meta("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise GGUFError(f"{file.path}: tokenizer.ggml.model = {kind!r}; supported: 'gpt2' (byte-level BPE, as every "
                        "Qwen and SmolLM file has)")
    tokens = list(file.meta("tokenizer.ggml.tokens"))
    types = list(file.meta("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in (file.meta("tokenizer.ggml.merges") or [])]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        spelled = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(file.meta("tokenizer.ggml.pre"))
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and set(t) <= alphabet]
    if control:
        tk.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
            if k == USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens(user)
    bos = file.meta("tokenizer.ggml.bos_token_id")
    if file.meta("tokenizer.ggml.add_bos_token", False) and bos is not None:
        name = tokens[int(bos)]
        tk.post_processor = processors.TemplateProcessing(single=f"{name}:0 $A:0", pair=f"{name}:0 $A:0 $B:1",
                                                          special_tokens=[(name, int(bos))])
    return tk


def chat_template(file: GGUFFile) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """The file's ``tokenizer.chat_template``, BOS and EOS token texts."""
    values = file.meta("tokenizer.ggml.tokens") or []      # read once: a vocabulary of strings

    def token(key: str) -> Optional[str]:
        i = file.meta(key)
        return values[int(i)] if i is not None and 0 <= int(i) < len(values) else None

    template = file.meta("tokenizer.chat_template")
    return (template if isinstance(template, str) else None, token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"))


# ----------------------------------------------------------------------------------------------
# Blocks -> the products' layouts (NATIVE_LAYOUT); each checked against gguf.quants.dequantize in tests
# ----------------------------------------------------------------------------------------------

def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """``[.., 16]`` bytes -> ``[.., 32]`` values: element j is byte j's low nibble, j + 16 its high one."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (llama.cpp's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    d = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(d)
    d[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    d[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return d.astype(np.float32), m.astype(np.float32)


def unpack_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> dict[str, np.ndarray]:
    """A native type's blocks ``[n, bytes]`` -> ``q`` (integers as the product holds them: int8 values, or
    int4 values 0..15 as uint8) ``[n, k]``, ``scales`` fp32 ``[n, G]``, and ``zeros`` (int4) / ``mins``
    fp32 where the type has them; ``w = (q - zeros) * scales + mins`` per group (NATIVE_LAYOUT)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    nb = k // block
    b = np.ascontiguousarray(raw).reshape(n, nb, size)
    out: dict[str, np.ndarray] = {}
    if kind == "Q8_0":
        out["q"] = b[..., 2:].view(np.int8).reshape(n, k)
        out["scales"] = _f16(b[..., :2]).reshape(n, nb)
    elif kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        out["q"] = _low_high(b[..., head:]).reshape(n, k)
        out["scales"] = _f16(b[..., :2]).reshape(n, nb)
        if kind == "Q4_0":
            out["zeros"] = np.full((n, nb), 8, np.uint8)
        else:
            out["zeros"] = np.zeros((n, nb), np.uint8)
            out["mins"] = _f16(b[..., 2:4]).reshape(n, nb)
    elif kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4
        qh = np.ascontiguousarray(b[..., head:head + 4]).view(np.uint32)          # [n, nb, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)      # [n, nb, 32]
        q = _low_high(b[..., head + 4:]) | (high << 4)
        out["scales"] = _f16(b[..., :2]).reshape(n, nb)
        if kind == "Q5_0":
            out["q"] = (q.astype(np.int16) - 16).astype(np.int8).reshape(n, k)
        else:
            out["q"] = q.astype(np.int8).reshape(n, k)
            out["mins"] = _f16(b[..., 2:4]).reshape(n, nb)
    elif kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])                         # [n, nb, 1]
        sc, mn = _k_scales(b[..., 4:16])                                         # [n, nb, 8]
        if kind == "Q4_K":
            qs = b[..., 16:144].reshape(n, nb, 4, 32)       # 4 pairs of sub-blocks: low nibbles, then high
            q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, nb, 256)
            out["q"] = q.reshape(n, k)
            out["zeros"] = np.zeros((n, nb * 8), np.uint8)
        else:
            qh = b[..., 16:48]                                                   # [n, nb, 32]
            qs = b[..., 48:176].reshape(n, nb, 4, 32)
            low = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, nb, 8, 32)    # sub-block j = 2 * pair + half
            high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1   # [n, nb, 8, 32]: bit j
            out["q"] = (low | (high << 4)).astype(np.int8).reshape(n, k)
        out["scales"] = (d * sc).reshape(n, nb * 8)
        out["mins"] = (-(dmin * mn)).reshape(n, nb * 8)
    elif kind == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)   # [n, nb, 16]
        d = _f16(b[..., 208:210])
        q = np.empty((n, nb, 256), np.int16)
        for half in range(2):                 # two halves of 128 elements, each from 64 ql bytes and 32 qh bytes
            l = ql[..., 64 * half:64 * half + 64]
            h = qh[..., 32 * half:32 * half + 32]
            base = 128 * half
            q[..., base + 0:base + 32] = (l[..., 0:32] & 15) | (((h >> 0) & 3) << 4)
            q[..., base + 32:base + 64] = (l[..., 32:64] & 15) | (((h >> 2) & 3) << 4)
            q[..., base + 64:base + 96] = (l[..., 0:32] >> 4) | (((h >> 4) & 3) << 4)
            q[..., base + 96:base + 128] = (l[..., 32:64] >> 4) | (((h >> 6) & 3) << 4)
        out["q"] = (q - 32).astype(np.int8).reshape(n, k)
        out["scales"] = (d * sc).reshape(n, nb * 16)
    else:
        raise ValueError(f"type {kind} is not held natively; native types: {', '.join(NATIVE)}")
    return out


def dequantize_unpacked(parts: dict[str, np.ndarray], kind: str) -> np.ndarray:
    """``w`` from ``unpack_blocks``' parts (for tests: this against ``gguf.quants.dequantize``)."""
    q = parts["q"].astype(np.float32)
    n, k = q.shape
    groups = parts["scales"].shape[1]
    g = k // groups
    qg = q.reshape(n, groups, g)
    if "zeros" in parts:
        qg = qg - parts["zeros"].astype(np.float32)[..., None]
    w = qg * parts["scales"][..., None]
    if "mins" in parts:
        w = w + parts["mins"][..., None]
    return w.reshape(n, k)


def open_path(path: str | Path) -> Path:
    """``path`` as the loader takes it: a GGUF file's as a ``GGUFPath`` carrying the file read once (the
    reader takes seconds over a vocabulary), anything else as it is."""
    if isinstance(path, GGUFPath) and getattr(path, "gguf", None) is not None:
        return path
    if is_gguf(path):
        return weight_path(GGUFFile(path))
    return Path(path)


def gguf_of(path: Any) -> Optional[GGUFFile]:
    """The GGUF file ``path`` names (read now unless the path carries it), or None when it is not one."""
    if path is None:
        return None
    carried = getattr(path, "gguf", None)
    if carried is not None:
        return carried
    return GGUFFile(path) if is_gguf(path) else None


def as_path(path: Any) -> Path:
    """``Path(path)``, keeping a ``GGUFPath`` that carries its file (``Path()`` of one makes a plain path)."""
    return path if getattr(path, "gguf", None) is not None else Path(path)
