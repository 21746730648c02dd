"""Reports as strict JSON: a measurement without a value (a KL where nothing was teacher
forced, a share of no items) is written `null`, not the bare `NaN` Python writes by default,
which JSON forbids and jq, JavaScript and most other readers refuse. Reading a report back
turns those nulls into NaN again where a number is expected (`eval.journal.item_result`)."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, infinities) replaced by None, in
    dicts, lists and tuples at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps` of `finite(value)`, refusing any non-finite number left (`allow_nan`)."""
    return json.dumps(finite(value), allow_nan=False, **options)
