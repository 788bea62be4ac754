# Upstream: vllm-project/vllm examples/offline_inference/reproducibility.py @ 10ceafe3 (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; "facebook/opt-125m" -> $MODEL.
"""Reproducible sampling: a fixed seed gives the same texts on every run."""

import os
import random

from qwen_ops import LLM, SamplingParams

# vLLM V1: no engine process, so that scheduling is deterministic.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

SEED = 42

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model=os.environ["MODEL"], seed=SEED)
    outputs = llm.generate(prompts, sampling_params)
    print("-" * 50)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}\nGenerated text: {generated_text!r}")
        print("-" * 50)

    # A random number drawn outside the engine: the same on every run, since the engine seeded
    # the global random state.
    print(random.randint(0, 100))


if __name__ == "__main__":
    main()
