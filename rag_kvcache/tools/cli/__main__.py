"""`python -m rag_kvcache.tools.cli ...`"""

import sys

from rag_kvcache.tools.cli.main import main

sys.exit(main())
