"""vLLM's demo server, ``python -m vllm.entrypoints.api_server [--host H] [--port P] [engine flags]``:
``POST /generate`` and ``GET /health`` (the app is ``qwen_ops.serving.openai.demo_api``)."""

import sys

from qwen_ops.serving.openai.demo_api import build_demo_app, main

__all__ = ["build_demo_app", "main"]

if __name__ == "__main__":
    sys.exit(main())
