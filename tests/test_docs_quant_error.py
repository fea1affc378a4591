"""docs/quant_error.md's CI-size table is what ``python scripts/quant_error.py --small`` prints,
regenerated here (about 3 s on 2 cores)."""

from __future__ import annotations

import re
from pathlib import Path

from scripts.quant_error import error_table, markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "quant_error.md"


def test_ci_size_table_matches_the_script() -> None:
    section = DOC.read_text(encoding="utf-8").split("## CI size (rows = 2^14, n = 1024)", 1)[1]
    documented = re.search(r"^\| rounding \|.*?(?=\n\n)", section, re.M | re.S)
    assert documented, "docs/quant_error.md has no table under '## CI size'"
    assert documented.group(0) == markdown(error_table(rows=2**14, n=1024, seed=0))
