"""The Qwen3-VL model as the engine runs it: a text tower over a paged KV cache plus the vision tower.

Layers mirror transformers' module names so checkpoints load by name.
"""
