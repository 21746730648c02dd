"""Catalog schema revisions, oldest first."""
