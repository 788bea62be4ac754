# Upstream: vllm-project/vllm examples/offline_inference/basic/reward.py @ 8744bb09 (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; the model comes from --model (a local one-label Qwen3 sequence
# classifier, the shape of Skywork-Reward-V2-Qwen3, instead of internlm2's remote-code reward model).
from argparse import Namespace

from qwen_ops import LLM, EngineArgs
from qwen_ops.utils.argparse_utils import FlexibleArgumentParser


def parse_args():
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(
        model="internlm/internlm2-1_8b-reward",
        runner="pooling",
        enforce_eager=True,
        max_model_len=1024,
        trust_remote_code=True,
    )
    return parser.parse_args()


def main(args: Namespace):
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]

    # runner="pooling" for reward models.
    llm = LLM(**vars(args))

    # A list of PoolingRequestOutput.
    outputs = llm.reward(prompts)

    print("\nGenerated Outputs:\n" + "-" * 60)
    for prompt, output in zip(prompts, outputs):
        rewards = output.outputs.data
        rewards_trimmed = (
            (str(rewards[:16])[:-1] + ", ...]") if len(rewards) > 16 else rewards
        )
        print(f"Prompt: {prompt!r} \nReward: {rewards_trimmed} (size={len(rewards)})")
        print("-" * 60)


if __name__ == "__main__":
    args = parse_args()
    main(args)
