"""The serving layer: the continuous-batching scheduler, the vLLM-shaped ``LLM`` and the
``qwen-ops`` command."""
