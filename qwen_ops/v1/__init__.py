"""vLLM's ``vllm.v1`` package, for the names its examples import: ``v1.engine.async_llm`` (``AsyncLLM``)
and ``v1.metrics.reader`` (``Counter``, ``Gauge``, ``Histogram``, ``Vector``)."""
