# Upstream: vllm-project/vllm docs/getting_started/quickstart.md @ 00bd1493 (Apache-2.0), the
# "OpenAI Chat Completions API with vLLM" Python snippet. Changed: the API base comes from
# $OPENAI_API_BASE (default the doc's); the model name is kept (served under it).
import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")

client = OpenAI(
    api_key=openai_api_key,
    base_url=openai_api_base,
)

chat_response = client.chat.completions.create(
    model="Qwen/Qwen2.5-1.5B-Instruct",
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a joke."},
    ],
)
print("Chat response:", chat_response)
