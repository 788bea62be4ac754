# Upstream: vllm-project/vllm examples/offline_inference/simple_profiling.py @ 26d25d4a (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; "facebook/opt-125m" -> $MODEL.
import os
import time

from qwen_ops import LLM, SamplingParams

# The torch profiler's output folder (also settable in the environment).
os.environ["VLLM_TORCH_PROFILER_DIR"] = "./vllm_profile"

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

if __name__ == "__main__":

    llm = LLM(model=os.environ["MODEL"], tensor_parallel_size=1)

    llm.start_profile()

    outputs = llm.generate(prompts, sampling_params)

    llm.stop_profile()

    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

    # Time for a background process's profiler to write its trace.
    time.sleep(10)
