"""CacheGroup and KVLayout validate themselves; every violation is a ConfigError."""

from __future__ import annotations

import pytest

from kvoffload import CacheGroup, ConfigError, KVLayout
from kvoffload.config.layout import GROUP_KINDS, Reuse


def group(**overrides: object) -> CacheGroup:
    fields: dict[str, object] = {
        "kind": "full",
        "tokens_per_block": 16,
        "layer_names": ("l0",),
        "page_bytes": 4096,
    }
    fields.update(overrides)
    return CacheGroup(**fields)  # type: ignore[arg-type]


def test_a_valid_group_derives_its_sizes() -> None:
    g = group(kind="sliding", layer_names=("a", "b"), sliding_window=64)
    assert g.num_layers == 2
    assert g.block_bytes == 2 * 4096
    assert g.chunk_bytes(3) == 3 * 2 * 4096


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"kind": "linear"}, "kind must be one of full, mla, compressed_mla, sliding"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"tokens_per_block": True}, "tokens_per_block"),
        ({"tokens_per_block": 16.0}, "tokens_per_block"),
        ({"page_bytes": -1}, "page_bytes"),
        ({"layer_names": ()}, "at least one layer"),
        ({"layer_names": "l0"}, "tuple of str"),
        ({"layer_names": ("l0", "")}, "non-empty str"),
        ({"layer_names": ("l0", "l0")}, "duplicate"),
        ({"kind": "sliding"}, "sliding_window"),
        ({"kind": "sliding", "sliding_window": 0}, "sliding_window"),
        ({"kind": "full", "sliding_window": 64}, "only for kind 'sliding' or 'sliding_mla'"),
        ({"kind": "sliding_mla"}, "sliding_window"),
        ({"kind": "chunked_local"}, "attention_chunk_size"),
        ({"kind": "chunked_local", "attention_chunk_size": 0}, "attention_chunk_size"),
        (
            {"kind": "sliding", "sliding_window": 64, "attention_chunk_size": 64},
            "attention_chunk_size is only for kind 'chunked_local'",
        ),
        ({"layer_page_bytes": (4096, 64)}, r"one page size per layer \(1\)"),
        ({"layer_page_bytes": 4096}, "one page size per layer"),
        ({"layer_names": ("a", "b"), "layer_page_bytes": (4096, 0)}, "layer_page_bytes"),
        (
            {"layer_names": ("a", "b"), "layer_page_bytes": (64, 128)},
            r"page_bytes must be the largest of layer_page_bytes \(128\), got 4096",
        ),
    ],
)
def test_a_bad_group_is_rejected(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        group(**overrides)


def test_every_kind_says_what_a_hit_needs() -> None:
    assert {kind: reuse.value for kind, reuse in GROUP_KINDS.items()} == {
        "full": "prefix",
        "mla": "prefix",
        "compressed_mla": "prefix",
        "sliding": "window",
        "sliding_mla": "window",
        "chunked_local": "window",
        "mamba": "state",
    }
    assert group(kind="chunked_local", attention_chunk_size=8192).reuse is Reuse.WINDOW
    assert group(kind="compressed_mla").reuse is Reuse.PREFIX


def test_layers_of_one_group_may_have_pages_of_their_own() -> None:
    """DeepSeek-V4 packs MLA pages of 37440 B, indexer pages of 8640 B and C128 pages of 1728 B."""
    pages = (37440, 8640, 37440, 1728)
    g = group(kind="compressed_mla", tokens_per_block=256, layer_names=("a", "b", "c", "d"),
              page_bytes=37440, layer_page_bytes=pages)  # fmt: skip
    assert g.layer_pages == pages
    assert g.block_bytes == sum(pages)
    assert g.chunk_bytes(2) == 2 * sum(pages)
    same = group(layer_names=("a", "b"), layer_page_bytes=[4096, 4096])
    assert same.layer_page_bytes is None  # one page size for all is the plain case
    assert same == group(layer_names=("a", "b"))
    assert same.layer_pages == (4096, 4096)


def test_layer_names_given_as_a_list_become_a_tuple() -> None:
    assert group(layer_names=["x", "y"]).layer_names == ("x", "y")


def test_a_layout_needs_groups_with_unique_layers() -> None:
    with pytest.raises(ConfigError, match="at least one CacheGroup"):
        KVLayout(groups=())
    with pytest.raises(ConfigError, match="must be a CacheGroup"):
        KVLayout(groups=("full",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'l0' is in group 0 and group 1"):
        KVLayout(groups=(group(), group(tokens_per_block=32)))


def test_layout_is_hashable_and_knows_its_groups() -> None:
    layout = KVLayout(
        groups=(group(layer_names=("a",)), group(layer_names=("b",), tokens_per_block=8))
    )
    assert layout.tokens_per_block == (16, 8)
    assert not layout.is_uniform
    assert layout.group_of("b") == 1
    assert layout.layer_names == ("a", "b")
    assert hash(layout) == hash(KVLayout(groups=layout.groups))
    with pytest.raises(ConfigError, match="in no group"):
        layout.group_of("c")
