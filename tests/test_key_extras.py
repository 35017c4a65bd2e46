"""A request's KV inputs besides its tokens are in its keys, in exactly the chunks they reach.

A salt or an adapter changes every key of the request; a multimodal item or
prompt embeddings change the chunk that first covers them and, through the
chain, every chunk after it, never one before. The encoding is written out
here a second time (struct and json), so a change to it cannot pass
unnoticed, and golden values pin it across processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.keys import (
    KeyExtras,
    MMItem,
    PromptEmbeds,
    extend_prefix_keys,
    prefix_keys,
    prefix_keys_for_layout,
)

TOKENS = list(range(1000, 1100))  # 100 tokens: 6 chunks of 16
SPAN = 16


def embeds(rows: int = 100, width: int = 8, seed: int = 0) -> PromptEmbeds:
    data = bytes((seed + 31 * i) % 251 for i in range(rows * width * 2))
    return PromptEmbeds(data, rows, "bfloat16")


def first_changed(a: list[bytes], b: list[bytes]) -> int:
    """Index of the first key that differs; every key after it must differ too."""
    assert len(a) == len(b)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True)), "the chain broke"
    return first


def keys(extras: KeyExtras | None, tokens: list[int] = TOKENS, span: int = SPAN) -> list[bytes]:
    return prefix_keys(tokens, span, 0, b"ns", extras=extras)


PLAIN = keys(None)


def test_no_extras_is_the_plain_chain() -> None:
    assert keys(KeyExtras()) == PLAIN
    assert keys(KeyExtras(salt="")) == PLAIN  # vLLM: an empty salt is no salt


@pytest.mark.parametrize(
    "extras",
    [KeyExtras(salt="tenant-a"), KeyExtras(adapter=b"\x01" * 16),
     KeyExtras(salt="tenant-a", adapter=b"\x01" * 16)],
    ids=["salt", "adapter", "both"],
)  # fmt: skip
def test_salt_and_adapter_change_every_chunk(extras: KeyExtras) -> None:
    assert first_changed(PLAIN, keys(extras)) == 0


def test_salts_adapters_and_their_pairs_never_share_keys() -> None:
    variants = [
        KeyExtras(salt="a"), KeyExtras(salt="b"), KeyExtras(salt="A"),
        KeyExtras(adapter=b"\x01" * 16), KeyExtras(adapter=b"\x02" * 16),
        KeyExtras(salt="a", adapter=b"\x01" * 16), KeyExtras(salt="b", adapter=b"\x01" * 16),
    ]  # fmt: skip
    every = PLAIN + [k for extras in variants for k in keys(extras)]
    assert len(set(every)) == len(every)


def test_an_image_changes_the_chunks_it_covers_and_after_never_before() -> None:
    image = MMItem("img-hash-1", offset=40, length=20)  # tokens [40, 60): chunks 2 and 3
    with_image = keys(KeyExtras(mm=(image,)))
    assert first_changed(PLAIN, with_image) == 2
    # The same image elsewhere, another image, or a different length: other keys.
    moved = keys(KeyExtras(mm=(MMItem("img-hash-1", 41, 20),)))
    other = keys(KeyExtras(mm=(MMItem("img-hash-2", 40, 20),)))
    longer = keys(KeyExtras(mm=(MMItem("img-hash-1", 40, 21),)))
    assert first_changed(with_image, moved) == 2
    assert first_changed(with_image, other) == 2
    assert first_changed(with_image, longer) == 2
    # An item inside the trailing partial chunk changes no key at all (no key covers it).
    assert keys(KeyExtras(mm=(MMItem("img", 97, 3),))) == PLAIN
    # Items may come in any order.
    two = (MMItem("a", 70, 5), MMItem("b", 20, 5))
    assert keys(KeyExtras(mm=two)) == keys(KeyExtras(mm=two[::-1]))
    assert first_changed(PLAIN, keys(KeyExtras(mm=two))) == 1


def test_embeddings_change_the_chunk_holding_a_changed_row_and_after() -> None:
    base = embeds()
    with_embeds = keys(KeyExtras(embeds=base))
    assert first_changed(PLAIN, with_embeds) == 0  # every chunk holds embedded rows
    data = bytearray(base.data)
    row = len(data) // base.rows
    data[70 * row] ^= 1  # one byte of row 70: chunk 4 ([64, 80))
    changed = keys(KeyExtras(embeds=PromptEmbeds(bytes(data), base.rows, base.dtype)))
    assert first_changed(with_embeds, changed) == 4
    as_fp16 = keys(KeyExtras(embeds=PromptEmbeds(base.data, base.rows, "float16")))
    assert first_changed(with_embeds, as_fp16) == 0
    mask = bytearray(b"\x01" * base.rows)
    mask[33] = 0  # a mixed prompt: row 33 becomes an embedding
    mixed = keys(KeyExtras(embeds=PromptEmbeds(base.data, base.rows, base.dtype, bytes(mask))))
    assert first_changed(with_embeds, mixed) == 0  # a mask is not "no mask"
    mask2 = bytearray(mask)
    mask2[50] = 0
    mixed2 = PromptEmbeds(base.data, base.rows, base.dtype, bytes(mask2))
    assert first_changed(mixed, keys(KeyExtras(embeds=mixed2))) == 3


def test_chunks_past_the_embedded_prompt_carry_no_digest() -> None:
    """Embeddings cover the prompt; a chunk partly past it hashes the rows there are."""
    short = embeds(rows=40)
    extras = KeyExtras(embeds=short)
    assert extras.chunk_tag(48, 64) == b""  # generated tokens hash as tokens
    assert extras.chunk_tag(32, 48) != b""
    data = bytearray(short.data)
    data[-1] ^= 1  # row 39, in chunk 2 ([32, 48))
    changed = keys(KeyExtras(embeds=PromptEmbeds(bytes(data), 40, short.dtype)))
    assert first_changed(keys(extras), changed) == 2


def test_every_group_and_span_gets_the_extras() -> None:
    extras = KeyExtras(salt="t", mm=(MMItem("img", 40, 20),))
    per_group = prefix_keys_for_layout(TOKENS, (16, 32), b"ns", extras=extras)
    assert per_group[0] == prefix_keys(TOKENS, 16, 0, b"ns", extras=extras)
    assert per_group[1] == prefix_keys(TOKENS, 32, 1, b"ns", extras=extras)
    plain = prefix_keys_for_layout(TOKENS, (16, 32), b"ns")
    assert all(a != b for a, b in zip(per_group[1], plain[1], strict=True))


extras_st = st.builds(
    KeyExtras,
    salt=st.none() | st.text(max_size=5),
    adapter=st.none() | st.binary(min_size=1, max_size=16),
    mm=st.lists(
        st.builds(MMItem, st.text(min_size=1, max_size=4), st.integers(0, 90), st.integers(1, 30)),
        max_size=3,
    ).map(tuple),
    embeds=st.none()
    | st.integers(1, 100).map(lambda rows: embeds(rows=rows, width=2))
    | st.integers(1, 100).map(
        lambda rows: PromptEmbeds(bytes(rows), rows, "float32", bytes(i % 2 for i in range(rows)))
    ),
)


@settings(max_examples=60, deadline=None)
@given(extras=extras_st, span=st.integers(1, 20), data=st.data())
def test_extend_continues_the_chain_with_extras(
    extras: KeyExtras, span: int, data: st.DataObject
) -> None:
    full = prefix_keys(TOKENS, span, 1, b"x", extras=extras)
    done = data.draw(st.integers(0, len(full)))
    more = extend_prefix_keys(full[:done], TOKENS, span, 1, b"x", extras=extras)
    assert full[:done] + more == full
    assert full == reference_keys(TOKENS, span, 1, b"x", extras)


def reference_keys(
    tokens: list[int], span: int, group: int, namespace: bytes, extras: KeyExtras
) -> list[bytes]:
    """The documented encoding, written again without the library's helpers."""

    def canonical(document: object) -> bytes:
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    header = b"kvoffload/prefix-key/v1\x00" + struct.pack("<IQ", group, span) + namespace
    previous = hashlib.blake2b(header, digest_size=16).digest()
    if extras.salt is not None or extras.adapter is not None:
        adapter = None if extras.adapter is None else extras.adapter.hex()
        tag = b"kvoffload/request-extras/v1\x00" + canonical(
            {"adapter": adapter, "salt": extras.salt}
        )
        previous = hashlib.blake2b(previous + tag, digest_size=16).digest()
    out = []
    for start in range(0, len(tokens) - span + 1, span):
        stop = start + span
        message = previous + struct.pack(f"<{span}q", *tokens[start:stop])
        mm = [[i.identifier, i.offset - start, i.length] for i in
              sorted(extras.mm, key=lambda i: i.offset)
              if i.offset < stop and start < i.offset + i.length]  # fmt: skip
        digest = None
        e = extras.embeds
        if e is not None and start < e.rows:
            row = len(e.data) // e.rows
            end = min(stop, e.rows)
            h = hashlib.blake2b(e.dtype.encode() + struct.pack("<QQ", row, end - start))
            h.update(e.data[start * row : end * row])
            if e.is_token is not None:
                h.update(e.is_token[start:end])
            digest = h.hexdigest()[:32]
        if mm or digest is not None:
            message += b"kvoffload/chunk-extras/v1\x00" + canonical({"embeds": digest, "mm": mm})
        previous = hashlib.blake2b(message, digest_size=16).digest()
        out.append(previous)
    return out


GOLDEN = "e6bf04a132c57fb10a57c67e62decbcf"  # keys(GOLDEN_EXTRAS)[-1], computed once


def golden_extras() -> KeyExtras:
    return KeyExtras(salt="s", adapter=b"\x05" * 16, mm=(MMItem("img", 40, 20),),
                     embeds=embeds(rows=30, width=2))  # fmt: skip


def test_golden_value_in_this_and_another_process() -> None:
    assert keys(golden_extras())[-1].hex() == GOLDEN
    code = (
        "import sys; sys.path.insert(0, 'tests');"
        "from test_key_extras import keys, golden_extras;"
        "print(keys(golden_extras())[-1].hex())"
    )
    root = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONHASHSEED="999", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == GOLDEN


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: KeyExtras(salt=3), "salt must be a str"),  # type: ignore[arg-type]
        (lambda: KeyExtras(adapter=b""), "adapter must be non-empty bytes"),
        (lambda: KeyExtras(mm=("img",)), "MMItem records"),  # type: ignore[arg-type]
        (lambda: KeyExtras(embeds=b"x"), "must be PromptEmbeds"),  # type: ignore[arg-type]
        (lambda: MMItem("", 0, 1), "identifier must be a non-empty str"),
        (lambda: MMItem("a", -1, 1), "offset must be a non-negative int"),
        (lambda: MMItem("a", 0, 0), "length must be a positive int"),
        (lambda: PromptEmbeds(b"abc", 2, "bf16"), "2 rows of equal size"),
        (lambda: PromptEmbeds(b"ab", 2, "bf16", b"\x01"), "one byte per row"),
    ],
)
def test_bad_extras_name_the_field(build: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build()  # type: ignore[operator]
    with pytest.raises(ConfigError, match="extras must be KeyExtras"):
        prefix_keys(TOKENS, 16, extras="salt")  # type: ignore[arg-type]
