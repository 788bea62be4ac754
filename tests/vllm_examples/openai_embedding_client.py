# Upstream: vllm-project/vllm examples/pooling/embed/openai_embedding_client.py @ c6088cb1 (Apache-2.0).
# Changed: the API base comes from $OPENAI_API_BASE (default upstream's).
import os

from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")


def main():
    client = OpenAI(
        api_key=openai_api_key,
        base_url=openai_api_base,
    )

    models = client.models.list()
    model = models.data[0].id

    responses = client.embeddings.create(
        # ruff: noqa: E501
        input=[
            "Hello my name is",
            "The best thing about vLLM is that it supports many different models",
        ],
        model=model,
    )

    for data in responses.data:
        print(data.embedding)  # one float per hidden unit


if __name__ == "__main__":
    main()
