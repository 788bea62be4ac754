"""vLLM's ``vllm.utils`` package, for the one name its examples import: ``argparse_utils.FlexibleArgumentParser``."""
