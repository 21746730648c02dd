"""Alembic migrations of the KV store catalog (applied by Catalog on open)."""
