"""Benchmarks (`rag-kvcache bench ...`): each writes JSON and a PNG plot, measuring ratios side
by side in one run.
"""
