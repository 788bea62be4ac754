"""``python -m qwen_ops.serving.cli``: the ``qwen-ops`` command line (its parser and ``main`` live in
the top-level, torch-free ``qwen_ops_cli``; the commands in ``qwen_ops.serving.commands``)."""

from __future__ import annotations

import sys

from qwen_ops_cli import build_parser, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
