"""The models layer: configs, checkpoint loading, the shared layers and the dense and hybrid Qwen
models, whose forward is plain torch plus ``torch.ops.qwen.*`` for the KV cache and slot state."""
