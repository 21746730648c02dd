"""`python -m rag_kvcache.tools.diagnosis ...`: the same as `rag-kvcache diagnose ...`."""

import sys

from rag_kvcache.tools.cli.main import main

sys.exit(main(["diagnose", *sys.argv[1:]]))
