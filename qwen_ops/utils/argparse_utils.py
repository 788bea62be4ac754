"""vLLM's ``vllm.utils.argparse_utils`` (a re-export): the parser its examples build with
``EngineArgs.add_cli_args``."""

from qwen_ops.serving.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
