# Upstream: vllm-project/vllm docs/getting_started/quickstart.md @ 00bd1493 (Apache-2.0), the
# "OpenAI Completions API with vLLM" Python snippet. Changed: the API base comes from $OPENAI_API_BASE
# (default the doc's); the model name "Qwen/Qwen2.5-1.5B-Instruct" is kept: the test serves the local
# checkpoint under it, as `vllm serve Qwen/Qwen2.5-1.5B-Instruct` would.
import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")
client = OpenAI(
    api_key=openai_api_key,
    base_url=openai_api_base,
)
completion = client.completions.create(
    model="Qwen/Qwen2.5-1.5B-Instruct",
    prompt="San Francisco is a",
)
print("Completion result:", completion)
