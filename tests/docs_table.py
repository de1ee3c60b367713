"""The rows of docs/recipes.md's ``memopt:`` table, for the tests that hold it to the schema."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def documented_keys(section: str) -> dict[str, str]:
    """``memopt.<section>.*`` rows of the ``memopt:`` table: key -> its default cell."""
    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    table = text[text.index("## The `memopt:` section"):]
    table = table[:table.index("\n## ", 1)]
    rows = {}
    for line in table.splitlines():
        m = re.match(rf"^\|\s*`{section}\.([a-z_.]+)`\s*\|\s*([^|]*?)\s*\|", line)
        if m:
            assert m.group(1) not in rows, f"{section}.{m.group(1)} documented twice"
            rows[m.group(1)] = m.group(2)
    return rows
