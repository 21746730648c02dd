"""The model: loading (HF folder, GGUF, random shapes), the transformers adapter (the only
version-specific code: caches, our attention function, forward), attention on plain tensors
(blocks of query rows, grouped KV heads) and RoPE math.
"""
