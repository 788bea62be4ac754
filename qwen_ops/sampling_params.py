"""vLLM's ``vllm.sampling_params``: the same names, from qwen_ops (a re-export; the classes live in
``engine/`` and ``serving/``)."""

from qwen_ops.engine.sampling import RequestOutputKind, SamplingParams
from qwen_ops.engine.structured import GuidedDecodingParams, StructuredOutputsParams
from qwen_ops.serving.beam_search import BeamSearchParams

__all__ = ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "GuidedDecodingParams",
           "BeamSearchParams"]
