"""vLLM's ``python -m vllm.entrypoints.openai.api_server --model M [flags]``: ``qwen-ops serve``
with the same flags (``build_app`` and ``run_server`` are the server's own)."""

import sys

from qwen_ops.serving.openai import build_app, run_server
from qwen_ops_cli import main

__all__ = ["build_app", "run_server", "main"]

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
