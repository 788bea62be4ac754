"""Helpers for the model/loader tests: tiny random HF checkpoints and a greedy loop over the ops.

``save_tiny_checkpoint`` builds a transformers Qwen2/Qwen3 model (transformers is test-only),
gives every weight random values (norm weights and biases too, so a swapped or dropped one
shows), and saves it with ``save_pretrained``. ``greedy_generate`` drives a
:class:`~qwen_ops.models.dense.QwenForCausalLM` the way an engine would: paged caches with a small
block size and a shuffled block table, one (optionally chunked) prefill, then one-token decode
steps for the whole batch at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional, Sequence

import torch

from qwen_ops.ops.metadata import AttentionMetadata


def save_tiny_checkpoint(path: Path, model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                         max_shard_size: Optional[str] = None, **config_kwargs) -> Path:
    """Save a random ``model_type`` ('qwen2' | 'qwen3') checkpoint with ``config_kwargs`` to ``path``."""
    import transformers

    config_cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[model_type]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config_kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            else:
                # Larger than the default 0.02 so that logits are peaked: greedy argmax then has
                # clear margins and a 1e-6 difference cannot flip a token.
                p.normal_(0.0, 0.15)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(dtype).save_pretrained(path, **kwargs)
    return Path(path)


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers reference model of a checkpoint (eager attention, eval mode)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def new_kv_caches(config, num_blocks: int, block_size: int, dtype: torch.dtype) -> list:
    """Per-layer (key_cache, value_cache), poisoned with NaN so a missed write shows."""
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
            for _ in range(config.num_hidden_layers)]


def shuffled_block_table(num_slots: int, blocks_per_slot: int, seed: int = 0) -> torch.Tensor:
    """int32 [num_slots, blocks_per_slot] with the physical blocks dealt out in random order."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_slots * blocks_per_slot + 1, generator=g)[:num_slots * blocks_per_slot]
    return perm.view(num_slots, blocks_per_slot).to(torch.int32)


def step_metadata(chunks: Sequence[tuple[int, int, int]], block_table: torch.Tensor) -> tuple:
    """Inputs of one forward from ``chunks`` = [(slot, start_position, num_tokens)].

    Returns (positions int64 [T], AttentionMetadata, last-row index of each chunk int64 [S]).
    """
    positions, slot_ids, starts = [], [], [0]
    for slot, start, n in chunks:
        positions += range(start, start + n)
        slot_ids += [slot] * n
        starts.append(starts[-1] + n)
    i32 = dict(dtype=torch.int32)
    attn = AttentionMetadata(
        slot_ids=torch.tensor(slot_ids, **i32),
        seq_slots=torch.tensor([c[0] for c in chunks], **i32),
        block_table=block_table,
        query_start_loc=torch.tensor(starts, **i32),
        seq_lens=torch.tensor([start + n for _, start, n in chunks], **i32),
        max_query_len=max(n for _, _, n in chunks),
    )
    return torch.tensor(positions, dtype=torch.int64), attn, torch.tensor(starts[1:], dtype=torch.int64) - 1


@torch.no_grad()
def greedy_generate(model, prompts: Sequence[Sequence[int]], new_tokens: int, *, block_size: int = 4,
                    prefill_chunk: Optional[int] = None, seed: int = 0) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (all in one batch, one slot each) through the model's ops.

    The prefill runs in chunks of ``prefill_chunk`` tokens per sequence (all of it if None); every
    decode step is one forward with one token per sequence.
    """
    config = model.config
    max_len = max(len(p) for p in prompts) + new_tokens
    blocks_per_slot = -(-max_len // block_size)
    block_table = shuffled_block_table(len(prompts), blocks_per_slot, seed)
    dtype = model.lm_head.weight.dtype
    kv_caches = new_kv_caches(config, len(prompts) * blocks_per_slot + 1, block_size, dtype)

    done = [0] * len(prompts)
    last_logits: list[Optional[torch.Tensor]] = [None] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        chunks, ids = [], []
        for slot, p in enumerate(prompts):
            n = min(len(p) - done[slot], prefill_chunk or len(p))
            if n > 0:
                chunks.append((slot, done[slot], n))
                ids += p[done[slot]:done[slot] + n]
        positions, attn, last = step_metadata(chunks, block_table)
        logits = model(torch.tensor(ids, dtype=torch.int64), positions, attn, kv_caches, last)
        for row, (slot, start, n) in enumerate(chunks):
            done[slot] = start + n
            last_logits[slot] = logits[row]
    outputs = [[int(l.argmax())] for l in last_logits]
    for _ in range(new_tokens - 1):
        chunks = [(slot, len(p) + len(outputs[slot]) - 1, 1) for slot, p in enumerate(prompts)]
        positions, attn, last = step_metadata(chunks, block_table)
        ids = torch.tensor([out[-1] for out in outputs], dtype=torch.int64)
        logits = model(ids, positions, attn, kv_caches, last)
        for slot, row in enumerate(logits.argmax(-1).tolist()):
            outputs[slot].append(row)
    return outputs


@torch.no_grad()
def hf_greedy(hf_model, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """transformers ``generate(do_sample=False)``, never stopping early at an EOS id."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=None,
                           eos_token_id=None, pad_token_id=0)
    # generate() fills a None field from the model's own generation_config (its EOS ids): clear that
    # one for the call, or it would stop at an EOS after all.
    saved, hf_model.generation_config.eos_token_id = hf_model.generation_config.eos_token_id, None
    try:
        out = hf_model.generate(torch.tensor([list(prompt)]), generation_config=gen,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64))
    finally:
        hf_model.generation_config.eos_token_id = saved
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == new_tokens, f"transformers stopped after {len(tokens)} of {new_tokens} tokens"
    return tokens


@contextlib.contextmanager
def registered_kernels(lib):
    """The CPU kernels of ``lib`` (a ``kernels.cpu.library`` build of a test's own: portable loops, a
    forced product path) registered for the block's lifetime; on leaving, the dispatcher's earlier
    kernels come back. The package's own registration is made first, so that it is what comes back."""
    from qwen_ops.ops import registry

    registry.cpu_fast_ops()
    handle = lib.qwen_register_cpu_kernels()
    try:
        yield
    finally:
        lib.qwen_unregister_cpu_kernels(handle)


def fresh_library(tmp_path, monkeypatch, **settings: str):
    """The package's CPU library loaded again from a copy of its build (no compile), so that its
    once-per-process choices (``cpu.PRODUCT_SETTINGS``) are made afresh under ``settings``, e.g.
    ``QWEN_OPS_BF16_PRODUCTS="widening"`` (amx | dot | widening; a path the CPU lacks falls back to
    widening: check ``qwen_bf16_products()``) or ``QWEN_OPS_INT8_PRODUCTS="vnni"``; the settings not
    given are unset (the CPU's own choice). Its C functions have the package's ctypes signatures."""
    import ctypes
    import shutil

    from qwen_ops.ops.kernels import cpu

    for name in cpu.PRODUCT_SETTINGS:
        if name in settings:
            monkeypatch.setenv(name, settings[name])
        else:
            monkeypatch.delenv(name, raising=False)
    copy_path = tmp_path / f"qwen_cpu_{'_'.join(settings.values()) or 'default'}.so"
    shutil.copy(cpu.library()._name, copy_path)
    lib = ctypes.CDLL(str(copy_path))
    for name, (argtypes, restype) in cpu._SIGNATURES.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
    return lib
