# Upstream: vllm-project/vllm docs/serving/openai_compatible_server.md @ 04454610 (Apache-2.0), the first
# snippet, for `vllm serve NousResearch/Meta-Llama-3-8B-Instruct --dtype auto --api-key token-abc123`.
# Changed: the API base comes from $OPENAI_API_BASE (default the doc's); the model name is kept.
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1"),
    api_key="token-abc123",
)

completion = client.chat.completions.create(
    model="NousResearch/Meta-Llama-3-8B-Instruct",
    messages=[
        {"role": "user", "content": "Hello!"}
    ]
)

print(completion.choices[0].message)
