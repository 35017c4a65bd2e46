"""Why a recurrent (Mamba / gated DeltaNet) group is refused at engine start, in words.

``state_refusal`` reads a vLLM ``MambaSpec``'s fields only, so plain objects
with those fields stand in for it here; ``tests_e2e/test_spec_kinds.py`` and
``tests_e2e/test_speculative_recurrent.py`` check the same on vLLM's own specs
and a real engine.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvoffload.vllm._layout import state_refusal


def spec(mode: str | None, speculative_blocks: int = 0) -> SimpleNamespace:
    return SimpleNamespace(mamba_cache_mode=mode, num_speculative_blocks=speculative_blocks)


def test_align_mode_without_speculative_decoding_is_served() -> None:
    assert state_refusal(spec("align")) is None


def test_no_boundary_states_names_the_settings_that_keep_them() -> None:
    why = state_refusal(spec("none"))
    assert why is not None and "mamba_cache_mode is 'none'" in why
    assert 'enable_prefix_caching=True and mamba_cache_mode="align"' in why


def test_speculative_decoding_in_align_mode_is_served() -> None:
    """MTP keeps 1 speculative state block per speculative token (measured on a tiny
    Qwen3-Next with an MTP layer); the states accepted drafts move are not stored
    (tests/test_drafted_states.py, tests_e2e/test_speculative_recurrent.py)."""
    for blocks in (1, 2, 3):
        assert state_refusal(spec("align", speculative_blocks=blocks)) is None
    why = state_refusal(spec("none", speculative_blocks=1))
    assert why is not None and "mamba_cache_mode is 'none'" in why
