"""What an engine's log shows at start: the vLLM release the connector runs on, and an
accepted but odd configuration, one plain line each."""

from __future__ import annotations

from pathlib import Path

import vllm
from _harness import LLAMA_ENGINE, LLAMA_PROMPTS, Engine

from kvoffload.vllm._versions import span


def test_ignored_vllm_keys_and_a_created_disk_path_are_plain_log_lines(
    engine: Engine, llama: str, tmp_path: Path
) -> None:
    """Not the warnings module's ``file:line: IgnoredKeysWarning`` dump and source line."""
    disk = tmp_path / "new" / "disk"
    connector = {"cpu_bytes_to_use": "64MiB", "spec_name": "x", "disk_path": str(disk),
                 "disk_bytes_to_use": "64MiB"}  # fmt: skip
    result = engine(
        model=llama, engine=LLAMA_ENGINE, prompts=LLAMA_PROMPTS[:1], connector=connector
    )
    assert result["error"] is None
    log = Path(result["log"]).read_text().splitlines()
    ignored = [line for line in log if "ignores these keys" in line]
    created = [line for line in log if "does not exist: the disk tier creates" in line]
    assert ignored and created, "\n".join(log[-40:])
    assert all(line.endswith("OffloadingConnector: spec_name") for line in ignored)
    assert not any("IgnoredKeysWarning" in line or "warnings.warn" in line for line in log)
    assert disk.is_dir()
    # The release the connector runs on, once per engine, beside vLLM's own INFO lines.
    release = [line for line in log if f"kvoffload: vLLM {vllm.__version__} " in line]
    assert len(release) == 1 and f"(checked: {span()})" in release[0], release
