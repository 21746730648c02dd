"""Adapters to other libraries, each an optional extra. Imported as `rag_kvcache.integrations`
only."""

if (
    __name__ != "rag_kvcache.integrations"
):  # the folder is reached through the link rag_kvcache/integrations
    raise ImportError(f"import this package as rag_kvcache.integrations, not {__name__}")
