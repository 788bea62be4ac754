# Upstream: vllm-project/vllm examples/offline_inference/basic_with_model_default_sampling.py @ 5c2a670f
# (Apache-2.0). Changed: `vllm` -> `qwen_ops`; "Qwen/Qwen2.5-0.5B-Instruct" -> $MODEL.
import os

from qwen_ops import LLM

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]

# generation_config="auto": the sampling defaults come from the model's generation_config.json.
llm = LLM(model=os.environ["MODEL"], generation_config="auto")

# The model's default sampling parameters, then one changed.
sampling_params = llm.get_default_sampling_params()
sampling_params.temperature = 0.5

outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
