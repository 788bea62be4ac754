# Upstream: vllm-project/vllm examples/offline_inference/basic/basic.py @ d5c95556 (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; the hub id "facebook/opt-125m" -> $MODEL.
import os

from qwen_ops import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    llm = LLM(model=os.environ["MODEL"])
    # A list of RequestOutput: prompt, generated text and more.
    outputs = llm.generate(prompts, sampling_params)
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
