# Upstream: vllm-project/vllm examples/online_serving/openai_chat_completion_with_reasoning_streaming.py
# @ d5c95556 (Apache-2.0). Changed: the API base comes from $OPENAI_API_BASE (default upstream's).
"""A reasoning model's streamed chat completion: reasoning_content deltas, then content deltas."""

import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")

messages = [{"role": "user", "content": "9.11 and 9.8, which is greater?"}]


def main():
    client = OpenAI(
        api_key=openai_api_key,
        base_url=openai_api_base,
    )

    models = client.models.list()
    model = models.data[0].id

    stream = client.chat.completions.create(model=model, messages=messages, stream=True)

    print("client: Start streaming chat completions...")
    printed_reasoning_content = False
    printed_content = False

    for chunk in stream:
        # Either field may be missing or empty in a chunk.
        reasoning_content = (
            getattr(chunk.choices[0].delta, "reasoning_content", None) or None
        )
        content = getattr(chunk.choices[0].delta, "content", None) or None

        if reasoning_content is not None:
            if not printed_reasoning_content:
                printed_reasoning_content = True
                print("reasoning_content:", end="", flush=True)
            print(reasoning_content, end="", flush=True)
        elif content is not None:
            if not printed_content:
                printed_content = True
                print("\ncontent:", end="", flush=True)
            print(content, end="", flush=True)


if __name__ == "__main__":
    main()
