"""The model: loading (HF folder, GGUF, random shapes), the transformers adapter (the only
version-specific code: caches, attention, forward) and RoPE math.
"""
