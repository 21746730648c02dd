"""Linking: encode chunks alone, choose the tokens a strategy recomputes, and link cached
chunks into one context with one forward pass.
"""
