"""The server's limits that its command's options show, kept apart from the web stack: the CLI
reads them while building its parser, and every command must run without the serve extra."""

from __future__ import annotations

DEFAULT_MAX_BODY_BYTES = 8 << 20  # a 128K-token prompt is ~0.5 MB of text
