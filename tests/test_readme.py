"""README.md stays true: its key table is the generated one (its examples run as doctests)."""

from __future__ import annotations

from pathlib import Path

from kvoffload.config import render_key_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_key_table_is_generated_from_the_key_table() -> None:
    text = README.read_text(encoding="utf-8")
    start = text.index("<!-- key-table:start -->\n") + len("<!-- key-table:start -->\n")
    end = text.index("<!-- key-table:end -->")
    assert text[start:end].strip() == render_key_table(), (
        "README's key table is stale: paste the output of "
        "`python -c 'from kvoffload.config import render_key_table; print(render_key_table())'`"
    )
