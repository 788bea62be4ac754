# Upstream: vllm-project/vllm examples/online_serving/openai_responses_client.py @ 498013cd (Apache-2.0).
# Changed: the server address comes from $OPENAI_API_BASE (default upstream's). The model name
# "Qwen/Qwen3-8B" is kept: the test serves the local checkpoint under that name.
"""The Responses API: a reply, then a second turn that carries the first's reasoning items."""

import os

from openai import OpenAI

input_messages = [{"role": "user", "content": "What model are you?"}]


def main():
    base_url = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")
    client = OpenAI(base_url=base_url, api_key="empty", timeout=60.0, max_retries=3)
    model = "Qwen/Qwen3-8B"  # get_first_model(client)
    response = client.responses.create(
        model=model,
        input=input_messages,
    )

    for message in response.output:
        if message.type == "reasoning":
            # the reasoning item goes back in
            input_messages.append(message)

    response_2 = client.responses.create(
        model=model,
        input=input_messages,
    )
    print(response_2.output_text)


if __name__ == "__main__":
    main()
