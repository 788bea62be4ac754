# Upstream: vllm-project/vllm examples/basic/online_serving/openai_completion_client.py @ 498013cd (Apache-2.0).
# Changed: the API base comes from $OPENAI_API_BASE (default upstream's).
import argparse
import os

from openai import OpenAI

# The OpenAI client pointed at the server.
openai_api_key = "EMPTY"
openai_api_base = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")


def parse_args():
    parser = argparse.ArgumentParser(description="Client for vLLM API server")
    parser.add_argument(
        "--stream", action="store_true", help="Enable streaming response"
    )
    return parser.parse_args()


def main(args):
    client = OpenAI(
        api_key=openai_api_key,
        base_url=openai_api_base,
        timeout=60.0,
        max_retries=3,
    )

    models = client.models.list()
    model = models.data[0].id

    completion = client.completions.create(
        model=model,
        prompt="A robot may not injure a human being",
        echo=False,
        n=2,
        stream=args.stream,
        logprobs=3,
    )

    print("-" * 50)
    print("Completion results:")
    if args.stream:
        for c in completion:
            print(c)
    else:
        print(completion)
    print("-" * 50)


if __name__ == "__main__":
    args = parse_args()
    main(args)
