"""CacheGroup and KVLayout validate themselves; every violation is a ConfigError."""

from __future__ import annotations

import pytest

from kvoffload import CacheGroup, ConfigError, KVLayout


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
        ({"kind": "linear"}, "kind must be one of full, sliding, mla, mamba"),
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
        ({"kind": "full", "sliding_window": 64}, "only for kind 'sliding'"),
    ],
)
def test_a_bad_group_is_rejected(overrides: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        group(**overrides)


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
