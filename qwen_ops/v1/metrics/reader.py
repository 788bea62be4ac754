"""vLLM's ``vllm.v1.metrics.reader`` (a re-export of ``serving/metrics_reader.py``): the metric shapes
``LLM.get_metrics()`` returns."""

from qwen_ops.serving.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Metric", "Counter", "Gauge", "Histogram", "Vector"]
