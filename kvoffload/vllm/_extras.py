"""What a vLLM request's KV depends on besides its token ids, as :class:`~kvoffload.keys.KeyExtras`.

* **Cache salt** (``request.cache_salt``): the tenant; mixed into every key.
* **LoRA adapter**: a digest of the adapter's files as vLLM reads them
  (``adapter_config.json`` and ``adapter_model.safetensors`` / ``.bin`` /
  ``.pt``). Not the name: a label, which ``load_lora_adapter`` may point at
  other weights. Not the path alone: the files at a path may be replaced
  between two runs, and the disk and remote tiers outlive the run. Not
  ``lora_int_id``: a counter per process (``vllm serve`` numbers adapters as
  they are loaded), so the same id names different adapters in two engines
  that share a remote tier. The weights themselves are what the KV depends
  on, so two names for one adapter share chunks (with token keys; vLLM's block
  hashes hold the name) and nothing else does. The
  digest is taken once per adapter id and path in this process, at the
  adapter's first request, which is when vLLM's worker loads it too.
* **Multimodal items**: each ``mm_feature``'s ``identifier`` (vLLM's hash of
  the media and its processing) and its placeholder's offset and length.
* **Prompt embeddings**: the tensor's bytes and dtype, and the mixed-prompt
  mask; chunks hash the rows they cover.

What cannot be keyed is refused by name (:class:`Unkeyable`): the connector
serves such a request without offloading and logs the reason once. Today
that is an adapter whose files this process cannot read (a hub id vLLM would
download on the worker, a missing directory).
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.keys import KeyExtras, MMItem, PromptEmbeds

__all__ = ["ExtrasReader", "Unkeyable", "adapter_digest"]

logger = logging.getLogger("kvoffload")

#: The files vLLM loads an adapter from (vllm/lora/lora_model.py, peft_helper.py).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
_READ_BYTES = 1 << 20


class Unkeyable(Exception):
    """A request whose KV inputs cannot be named exactly; ``str(exc)`` says which and why."""


def adapter_digest(path: str) -> bytes:
    """A 16-byte digest of the adapter files vLLM reads from directory ``path``.

    Raises :class:`Unkeyable` if ``path`` is not a readable directory holding
    ``adapter_config.json`` and one of the weight files.
    """
    if not os.path.isdir(path):
        raise Unkeyable(f"{path!r} is not a directory this process can read")
    weights = [name for name in ADAPTER_WEIGHTS if os.path.isfile(os.path.join(path, name))]
    names = [ADAPTER_CONFIG, *weights]
    if not weights or not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        raise Unkeyable(f"{path!r} holds no {ADAPTER_CONFIG} and {' / '.join(ADAPTER_WEIGHTS)}")
    hasher = hashlib.blake2b(b"kvoffload/lora-adapter/v1\x00", digest_size=16)
    try:
        for name in names:
            with open(os.path.join(path, name), "rb") as f:
                hasher.update(
                    name.encode() + b"\x00" + os.fstat(f.fileno()).st_size.to_bytes(8, "little")
                )
                while block := f.read(_READ_BYTES):
                    hasher.update(block)
    except OSError as exc:
        raise Unkeyable(f"cannot read the adapter's files under {path!r}: {exc}") from exc
    return hasher.digest()


def _embeds(request: Any) -> PromptEmbeds | None:
    tensor = request.prompt_embeds
    if tensor is None:
        return None
    import torch

    t = tensor.detach().to("cpu").contiguous()
    if t.ndim != 2 or t.shape[0] == 0:
        raise Unkeyable(f"prompt embeddings of shape {tuple(t.shape)} (expected rows x hidden)")
    data = t.view(torch.uint8).numpy().tobytes()
    mask = request.prompt_is_token_ids
    is_token = None if mask is None else bytes(1 if m else 0 for m in mask)
    try:
        return PromptEmbeds(data, int(t.shape[0]), str(t.dtype), is_token)
    except ConfigError as exc:
        raise Unkeyable(f"prompt embeddings: {exc}") from exc


def _mm(request: Any) -> tuple[MMItem, ...]:
    items = []
    for feature in request.mm_features or ():
        identifier = feature.identifier
        if not identifier:
            raise Unkeyable(f"a {feature.modality} input has no identifier (content hash)")
        position = feature.mm_position
        items.append(MMItem(str(identifier), int(position.offset), int(position.length)))
    return tuple(items)


class ExtrasReader:
    """Reads :class:`KeyExtras` off vLLM requests; remembers adapter digests per process."""

    def __init__(self) -> None:
        #: (adapter id, path) -> its digest, or why it has none.
        self._adapters: dict[tuple[int, str], bytes | str] = {}
        #: Why requests were served without offloading -> how many.
        self._refused: dict[str, int] = {}

    @property
    def refused(self) -> int:
        """Requests served without offloading because :meth:`read` refused them."""
        return sum(self._refused.values())

    def refuse(self, reason: str) -> None:
        """Count a request :meth:`read` refused; each reason is logged once."""
        if reason not in self._refused:
            logger.warning("kvoffload: requests are served without offloading: %s", reason)
        self._refused[reason] = self._refused.get(reason, 0) + 1

    def read(self, request: Any) -> KeyExtras | None:
        """The request's extras, ``None`` for a plain one; :class:`Unkeyable` if unkeyable."""
        lora, salt = request.lora_request, request.cache_salt or None
        plain = not request.mm_features and request.prompt_embeds is None
        if lora is None and salt is None and plain:
            return None
        adapter = None if lora is None else self._adapter(lora)
        return KeyExtras(salt=salt, adapter=adapter, mm=_mm(request), embeds=_embeds(request))

    def _adapter(self, lora: Any) -> bytes:
        cache_key = (int(lora.lora_int_id), str(lora.lora_path))
        known = self._adapters.get(cache_key)
        if known is None:
            try:
                known = adapter_digest(str(lora.lora_path))
            except Unkeyable as exc:
                known = f"LoRA adapter {lora.lora_name!r}: {exc}"
            self._adapters[cache_key] = known
        if isinstance(known, str):
            raise Unkeyable(known)
        return known
