"""Prompt Cache's prompt markup language: schemas of modules, unions and parameters, prompts
that import them, a Python front end, and serving prompts from cached module KV.
"""
