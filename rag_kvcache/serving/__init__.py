"""Serving many requests: prefill and decode loops, the prefix tree of linked prefixes, the
batch's KV rows, two-phase (cascade) attention with its Triton kernel, the batch decoder
(`add_request` / `step` / `abort`) and the engine loop, the one thread that drives it.
"""
