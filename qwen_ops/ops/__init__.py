"""The ops layer: ``torch.ops.qwen.*`` (schemas from ``torch_library/``), their argument
validation, the per-call backend choice and the kernels (reference, cpu, triton, cuda, fake).

Importing it registers the ops. Nothing here imports the layers above (models, engine, serving).
"""

from qwen_ops.ops.registry import causal_conv1d, fused_moe, gated_delta_rule, kv_write, slot_attention

__all__ = ["kv_write", "slot_attention", "causal_conv1d", "gated_delta_rule", "fused_moe"]
