# Upstream: vllm-project/vllm examples/offline_inference/torchrun_example.py @ 690631bb (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; "facebook/opt-125m" -> $MODEL. Run with
# `torchrun --nproc-per-node=2 torchrun_example.py` (2 = tensor_parallel_size).
"""Tensor-parallel inference launched by torchrun: each rank runs this script with one worker."""

import os

from qwen_ops import LLM, SamplingParams

# The same prompts on every rank.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]

# The same sampling parameters on every rank.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

# external_launcher: torchrun started the ranks; this LLM creates no worker of its own.
llm = LLM(
    model=os.environ["MODEL"],
    tensor_parallel_size=2,
    distributed_executor_backend="external_launcher",
)

outputs = llm.generate(prompts, sampling_params)

# Every rank gets the same outputs.
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, "
          f"Generated text: {generated_text!r}")
