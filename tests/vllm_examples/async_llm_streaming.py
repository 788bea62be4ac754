# Upstream: vllm-project/vllm examples/offline_inference/async_llm_streaming.py @ ec3decc0 (Apache-2.0).
# Changed: `vllm` -> `qwen_ops`; "meta-llama/Llama-3.2-1B-Instruct" -> $MODEL; max_tokens 100 -> 32.
"""Streaming with AsyncLLM: DELTA outputs, each iteration carrying only the new text."""

import asyncio
import os

from qwen_ops import SamplingParams
from qwen_ops.engine.arg_utils import AsyncEngineArgs
from qwen_ops.sampling_params import RequestOutputKind
from qwen_ops.v1.engine.async_llm import AsyncLLM


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> None:
    """Print a request's new text as it arrives, until its finished flag."""
    print(f"\n🚀 Prompt: {prompt!r}")
    print("💬 Response: ", end="", flush=True)

    sampling_params = SamplingParams(
        max_tokens=32,
        temperature=0.8,
        top_p=0.95,
        seed=42,  # reproducible
        output_kind=RequestOutputKind.DELTA,  # only the new tokens each iteration
    )

    try:
        async for output in engine.generate(
            request_id=request_id, prompt=prompt, sampling_params=sampling_params
        ):
            for completion in output.outputs:
                new_text = completion.text
                if new_text:
                    print(new_text, end="", flush=True)

            if output.finished:
                print("\n✅ Generation complete!")
                break

    except Exception as e:
        print(f"\n❌ Error during streaming: {e}")
        raise


async def main():
    print("🔧 Initializing AsyncLLM...")

    engine_args = AsyncEngineArgs(
        model=os.environ["MODEL"],
        enforce_eager=True,
    )
    engine = AsyncLLM.from_engine_args(engine_args)

    try:
        prompts = [
            "The future of artificial intelligence is",
            "In a galaxy far, far away",
            "The key to happiness is",
        ]

        print(f"🎯 Running {len(prompts)} streaming examples...")

        for i, prompt in enumerate(prompts, 1):
            print(f"\n{'=' * 60}")
            print(f"Example {i}/{len(prompts)}")
            print(f"{'=' * 60}")

            request_id = f"stream-example-{i}"
            await stream_response(engine, prompt, request_id)

            if i < len(prompts):
                await asyncio.sleep(0.5)

        print("\n🎉 All streaming examples completed!")

    finally:
        print("🔧 Shutting down engine...")
        engine.shutdown()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("\n🛑 Interrupted by user")
