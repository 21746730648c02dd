"""Retrieval: sentence embeddings, the FAISS vector index, and the corpus of documents whose
chunks retrieval returns as cache IDs.
"""
