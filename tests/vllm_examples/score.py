# Upstream: vllm-project/vllm examples/basic/offline_inference/score.py @ a0ce3642 (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; the model comes from --model (a local cross-encoder checkpoint).
from argparse import Namespace

from qwen_ops import LLM, EngineArgs
from qwen_ops.utils.argparse_utils import FlexibleArgumentParser


def parse_args():
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(
        model="BAAI/bge-reranker-v2-m3",
        runner="pooling",
        enforce_eager=True,
    )
    return parser.parse_args()


def main(args: Namespace):
    query = "What is the capital of France?"
    documents = [
        "The capital of Brazil is Brasilia.",
        "The capital of France is Paris.",
    ]

    # runner="pooling" for cross-encoders too.
    llm = LLM(**vars(args))

    # A list of ScoringRequestOutput.
    outputs = llm.score(query, documents)

    print("\nGenerated Outputs:\n" + "-" * 60)
    for document, output in zip(documents, outputs):
        score = output.outputs.score
        print(f"Pair: {[query, document]!r} \nScore: {score}")
        print("-" * 60)


if __name__ == "__main__":
    args = parse_args()
    main(args)
