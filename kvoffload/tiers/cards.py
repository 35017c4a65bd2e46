"""Key cards: each split-role engine leaves in the shared tier how it names chunks.

A prefill engine and a decode engine that name chunks differently (another block
size, tensor-parallel size, hash seed, model path) never find each other's chunks,
and nothing fails: every lookup simply misses. So each engine started as
``kv_producer`` or ``kv_consumer`` writes its :class:`~kvoffload.keys.identity.KeyIdentity`
(a card) into the tiers it shares, and reads the other role's cards; if there are
some and none names chunks as it does, it warns at start, naming what differs and
the setting to change. It warns rather than refuses: a shared tier may hold other
deployments' cards, and one that has stopped leaves its card (cards older than
:data:`CARD_MAX_AGE_S` are ignored).

* Disk: ``<disk_path>/handoff/cards/<role>-<digest>.json``, written to a temporary
  name and renamed, so a reader never sees half a card.
* Redis / Valkey: the hash ``kvoffload:cards``, one field per card
  (:meth:`~kvoffload.tiers.remote.RedisTier.put_card`).

Engines with the same identity share one card, rewritten at each start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvoffload.errors import TierError
from kvoffload.keys.identity import KeyIdentity
from kvoffload.tiers.handoff import HANDOFF_DIR

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig

__all__ = ["CARD_MAX_AGE_S", "exchange_cards", "key_mismatch"]

logger = logging.getLogger("kvoffload")

#: Cards older than this are another deployment's past, not a peer.
CARD_MAX_AGE_S = 86_400.0
_OTHER_ROLE = {"kv_producer": "kv_consumer", "kv_consumer": "kv_producer"}


@runtime_checkable
class CardHolder(Protocol):
    """A remote tier that keeps cards (:class:`~kvoffload.tiers.remote.RedisTier`)."""

    def put_card(self, name: str, text: str) -> None: ...

    def cards(self) -> list[bytes]: ...

    def close(self) -> None: ...


def key_mismatch(mine: KeyIdentity, cards: Sequence[KeyIdentity], now: float) -> str | None:
    """The warning for ``mine`` among ``cards``: ``None`` unless the other role has recent
    cards and none of them names chunks as ``mine`` does."""
    other = _OTHER_ROLE.get(mine.role)
    peers = [c for c in cards if c.role == other and now - c.written_at < CARD_MAX_AGE_S]
    if not peers or any(mine.same_keys(peer) for peer in peers):
        return None
    newest = max(peers, key=lambda card: card.written_at)
    effect = (
        "its lookups miss what they store"
        if mine.role == "kv_consumer"
        else "they will not find what it stores"
    )
    return (
        f"kvoffload: this {mine.role} names chunks unlike every {other} that left a card on "
        f"the shared tier, so {effect}: the newest ({newest.where}, "
        f"{now - newest.written_at:.0f} s ago) has " + "; ".join(mine.differences(newest))
    )


def _card_name(identity: KeyIdentity) -> str:
    named = (identity.role, identity.namespaces, identity.tokens_per_chunk, identity.key_source)
    return f"{identity.role}-{hashlib.blake2b(repr(named).encode(), digest_size=8).hexdigest()}"


def _disk_cards(path: str, identity: KeyIdentity, text: str) -> list[KeyIdentity]:
    """Write ``identity``'s card under ``path``; every readable card there, its own included."""
    directory = Path(path) / HANDOFF_DIR / "cards"
    name = _card_name(identity)
    with contextlib.suppress(OSError):  # the disk tier reports an unusable path itself
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = directory / f".{name}.{os.getpid()}.tmp"
        temp.write_text(text)
        temp.replace(directory / f"{name}.json")
    cards = []
    with contextlib.suppress(OSError):
        for entry in directory.glob("*.json"):
            with contextlib.suppress(OSError):
                card = KeyIdentity.from_json(entry.read_bytes()[:65536])
                if card is not None:
                    cards.append(card)
    return cards


def _remote_cards(tier: CardHolder, identity: KeyIdentity, text: str) -> list[KeyIdentity]:
    try:
        tier.put_card(_card_name(identity), text)
        found = tier.cards()
    except TierError as exc:  # the tier warns of an outage itself; a later start compares
        logger.debug("kvoffload: key cards not exchanged on the remote tier: %s", exc)
        return []
    finally:
        tier.close()
    return [card for card in map(KeyIdentity.from_json, found) if card is not None]


def exchange_cards(config: OffloadConfig, identity: KeyIdentity) -> str | None:
    """Leave ``identity``'s card on the shared tiers and compare it with the other role's:
    the warning :func:`key_mismatch` gives, or ``None``."""
    from kvoffload.tiers.from_config import remote_tier

    now = time.time()
    identity = identity.stamped(now)
    text, cards = identity.to_json(), []
    if config.disk_path is not None:
        cards += _disk_cards(config.disk_path, identity, text)
    if config.remote_url is not None:
        tier = remote_tier(config, bytes.fromhex(identity.namespaces[0]))
        if isinstance(tier, CardHolder):
            cards += _remote_cards(tier, identity, text)
        else:
            tier.close()
    return key_mismatch(identity, cards, now)
