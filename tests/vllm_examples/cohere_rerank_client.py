# Upstream: vllm-project/vllm examples/pooling/score/cohere_rerank_client.py @ e5fd201a (Apache-2.0).
# Changed: the server address comes from $VLLM_BASE_URL (default upstream's); the model name is kept.
# Needs `pip install cohere`.
"""The re-rank API through Cohere's own SDK, v1 (/v1/rerank) and v2 (/v2/rerank) clients."""

import os

import cohere
from cohere import Client, ClientV2

model = "BAAI/bge-reranker-base"

query = "What is the capital of France?"

documents = [
    "The capital of France is Paris",
    "Reranking is fun!",
    "vLLM is an open-source framework for fast AI serving",
]

base_url = os.environ.get("VLLM_BASE_URL", "http://localhost:8000")


def cohere_rerank(
    client: Client | ClientV2, model: str, query: str, documents: list[str]
) -> dict:
    return client.rerank(model=model, query=query, documents=documents)


def main():
    cohere_v1 = cohere.Client(base_url=base_url, api_key="sk-fake-key")
    rerank_v1_result = cohere_rerank(cohere_v1, model, query, documents)
    print("-" * 50)
    print("rerank_v1_result:\n", rerank_v1_result)
    print("-" * 50)

    cohere_v2 = cohere.ClientV2("sk-fake-key", base_url=base_url)
    rerank_v2_result = cohere_rerank(cohere_v2, model, query, documents)
    print("rerank_v2_result:\n", rerank_v2_result)
    print("-" * 50)


if __name__ == "__main__":
    main()
