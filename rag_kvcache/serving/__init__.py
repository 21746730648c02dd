"""Serving many requests: prefill and decode loops, the prefix tree of linked prefixes, the
batch's KV rows, and two-phase (cascade) attention with its Triton kernel.
"""
