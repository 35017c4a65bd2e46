"""docs/configuration.md stays true: its key table is the generated one (its examples run as
doctests)."""

from __future__ import annotations

from pathlib import Path

from kvoffload.config import render_key_table
from kvoffload.config.keys import KEYS_BY_NAME

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_key_table_is_generated_from_the_key_table() -> None:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index("<!-- key-table:start -->\n") + len("<!-- key-table:start -->\n")
    end = text.index("<!-- key-table:end -->")
    assert text[start:end].strip() == render_key_table(), (
        "docs/configuration.md's key table is stale: paste the output of "
        "`python -c 'from kvoffload.config import render_key_table; print(render_key_table())'`"
    )


def test_the_readmes_common_keys_are_keys_with_their_defaults() -> None:
    """The README's short table (the keys most users set) names real keys, with the
    defaults the key table gives them."""
    text = (PAGE.parents[1] / "README.md").read_text(encoding="utf-8")
    rows = text.split("<!-- common-keys:start -->")[1].split("<!-- common-keys:end -->")[0]
    shown = {}
    for row in rows.strip().splitlines()[2:]:
        name, default = (cell.strip() for cell in row.strip("|").split("|")[:2])
        shown[name.strip("`")] = default
    assert shown and all(name in KEYS_BY_NAME for name in shown), shown
    assert shown == {name: KEYS_BY_NAME[name].default_text() for name in shown}
