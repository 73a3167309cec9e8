"""rollplex: synchronous on-policy GRPO post-training of Qwen2.5-VL with prefix/suffix decomposition."""

__version__ = "0.1.0"
