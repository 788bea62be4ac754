"""The engine layer: explicit per-request slots over a paged KV cache (``QwenEngine``), the
model runner that turns scheduled chunks into one forward pass, block allocation and sampling."""

from qwen_ops.engine.block_manager import SwappedSlot
from qwen_ops.engine.engine import (QwenBatchDecodeResult, QwenBatchedRequest, QwenBatchPrefillResult, QwenEngine,
                                    QwenForwardResult)

__all__ = ["QwenEngine", "QwenBatchedRequest", "QwenForwardResult", "QwenBatchPrefillResult",
           "QwenBatchDecodeResult", "SwappedSlot"]
