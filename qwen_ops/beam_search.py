"""vLLM's ``vllm.beam_search`` (a re-export)."""

from qwen_ops.serving.beam_search import BeamSearchOutput, BeamSearchSequence

__all__ = ["BeamSearchOutput", "BeamSearchSequence"]
