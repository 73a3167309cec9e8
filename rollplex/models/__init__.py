"""Qwen2.5-VL model side: presets, tokenizer, positions, forward passes, attention."""
