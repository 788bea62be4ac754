# Upstream: vllm-project/vllm examples/offline_inference/gguf_inference.py @ b01368a0 (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; hf_hub_download(bartowski/Phi-3-medium-4k-instruct-GGUF) -> the local
# GGUF file $MODEL and tokenizer $TOKENIZER instead of "microsoft/Phi-3-medium-4k-instruct";
# max_tokens 128 -> 32.
import os

from qwen_ops import LLM, SamplingParams


def run_gguf_inference(model_path, tokenizer):
    prompts = [
        "How many helicopters can a human eat in one sitting?",
        "What's the future of AI?",
    ]
    prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
    sampling_params = SamplingParams(temperature=0, max_tokens=32)

    llm = LLM(model=model_path, tokenizer=tokenizer)

    outputs = llm.chat(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")


if __name__ == "__main__":
    model = os.environ["MODEL"]
    tokenizer = os.environ["TOKENIZER"]
    run_gguf_inference(model, tokenizer)
