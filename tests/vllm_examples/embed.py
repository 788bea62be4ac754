# Upstream: vllm-project/vllm examples/offline_inference/basic/embed.py @ 3e990f4c (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; the model comes from --model; upstream's ROCm-only branch (an attention
# backend chosen through vllm.platforms / vllm.config) is left out: it never runs on a CPU.
from argparse import Namespace

from qwen_ops import LLM, EngineArgs
from qwen_ops.utils.argparse_utils import FlexibleArgumentParser


def parse_args():
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(
        model="intfloat/e5-small",
        runner="pooling",
        enforce_eager=True,
    )
    return parser.parse_args()


def main(args: Namespace):
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]

    # runner="pooling" makes an embedding model.
    llm = LLM(**vars(args))

    # A list of EmbeddingRequestOutput.
    outputs = llm.embed(prompts)

    print("\nGenerated Outputs:\n" + "-" * 60)
    for prompt, output in zip(prompts, outputs):
        embeds = output.outputs.embedding
        embeds_trimmed = (
            (str(embeds[:16])[:-1] + ", ...]") if len(embeds) > 16 else embeds
        )
        print(f"Prompt: {prompt!r} \nEmbeddings: {embeds_trimmed} (size={len(embeds)})")
        print("-" * 60)


if __name__ == "__main__":
    args = parse_args()
    main(args)
