# Upstream: vllm-project/vllm examples/pooling/score/jinaai_rerank_client.py @ e5fd201a (Apache-2.0).
# Changed: the URL's host and port come from $VLLM_SERVER (default upstream's 127.0.0.1:8000); the model
# name is kept (the test serves the local cross-encoder under it).
"""The re-rank API (/rerank), Jina's and Cohere's shape."""

import json
import os

import requests

url = f"http://{os.environ.get('VLLM_SERVER', '127.0.0.1:8000')}/rerank"

headers = {"accept": "application/json", "Content-Type": "application/json"}

data = {
    "model": "BAAI/bge-reranker-base",
    "query": "What is the capital of France?",
    "documents": [
        "The capital of Brazil is Brasilia.",
        "The capital of France is Paris.",
        "Horses and cows are both animals",
    ],
}


def main():
    response = requests.post(url, headers=headers, json=data)

    if response.status_code == 200:
        print("Request successful!")
        print(json.dumps(response.json(), indent=2))
    else:
        print(f"Request failed with status code: {response.status_code}")
        print(response.text)


if __name__ == "__main__":
    main()
