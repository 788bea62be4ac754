"""vLLM's ``vllm.outputs`` (a re-export)."""

from qwen_ops.serving.outputs import CompletionOutput, RequestOutput
from qwen_ops.serving.pooling import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                      EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, ScoringOutput,
                                      ScoringRequestOutput)

__all__ = ["CompletionOutput", "RequestOutput", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput",
           "ScoringRequestOutput"]
