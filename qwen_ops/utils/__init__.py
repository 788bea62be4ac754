"""vLLM's ``vllm.utils`` package, for the names its examples import: ``FlexibleArgumentParser`` (here and,
as in newer vLLM, in ``argparse_utils``)."""

from qwen_ops.serving.engine_args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
