# Upstream: vllm-project/vllm examples/basic/offline_inference/classify.py @ 4159f5ba (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; the model comes from --model (a local sequence-classification checkpoint).
from argparse import Namespace

from qwen_ops import LLM, EngineArgs
from qwen_ops.utils.argparse_utils import FlexibleArgumentParser


def parse_args():
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(
        model="jason9693/Qwen2.5-1.5B-apeach",
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

    # runner="pooling" for classifiers.
    llm = LLM(**vars(args))

    # A list of ClassificationRequestOutput.
    outputs = llm.classify(prompts)

    print("\nGenerated Outputs:\n" + "-" * 60)
    for prompt, output in zip(prompts, outputs):
        probs = output.outputs.probs
        probs_trimmed = (str(probs[:16])[:-1] + ", ...]") if len(probs) > 16 else probs
        print(
            f"Prompt: {prompt!r} \n"
            f"Class Probabilities: {probs_trimmed} (size={len(probs)})"
        )
        print("-" * 60)


if __name__ == "__main__":
    args = parse_args()
    main(args)
