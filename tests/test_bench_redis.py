"""``kvoffload bench --tier redis`` on a real server (loopback, tiny sizes; no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _redis_servers import RedisServer, free_port, need_redis_py

from kvoffload.cli import main
from kvoffload.errors import CorruptChunkError
from kvoffload.tiers._record import pack_record, unpack_record_into

TINY = ["--chunk-mib", "0.25", "--total-mib", "1", "--repeat", "1"]
RATES = {"store_gbps", "load_gbps", "ref_store_gbps", "ref_load_gbps"}
LOOKUPS = {"lookups_per_s", "ref_lookups_per_s"}


def bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_redis_rows_measure_the_tier_and_clean_up(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis_server.client()
    client.set(b"someone:else", b"kept")  # the server may be shared
    code, out, _ = bench(capsys, "--tier", "redis", "--remote-url", redis_server.url, *TINY,
                         "--json")  # fmt: skip
    assert code == 0
    [row] = json.loads(out)
    assert row["tier"] == "redis" and row["chunk_bytes"] == 1 << 18
    assert row["direct_io"] is False
    assert all(row[field] > 0 for field in RATES | LOOKUPS)
    assert client.keys() == [b"someone:else"]  # every key the bench wrote is gone


def test_all_includes_redis_only_with_a_url(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = [*TINY, "--disk-path", str(tmp_path), "--json"]
    code, out, _ = bench(capsys, *local)
    assert code == 0 and [row["tier"] for row in json.loads(out)] == ["cpu", "disk"]
    code, out, _ = bench(capsys, "--remote-url", redis_server.url, *local)
    rows = json.loads(out)
    assert code == 0 and [row["tier"] for row in rows] == ["cpu", "disk", "redis"]
    assert all(rows[0][field] is None for field in LOOKUPS)  # the CPU slab has no lookup
    assert all(row[field] > 0 for row in rows[1:] for field in LOOKUPS)  # disk, redis
    assert redis_server.client().dbsize() == 0


def test_table_names_the_redis_reference(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = bench(capsys, "--tier", "redis", "--remote-url", redis_server.url, *TINY)
    lines = out.splitlines()
    assert code == 0 and "lookup/s" in lines[0] and len(lines) == 4
    assert lines[2].startswith("redis") and lines[2].endswith("redis-py") and "%" in lines[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tier", "redis"], "--tier redis needs --remote-url"),
        (["--tier", "redis", "--remote-url", "http://127.0.0.1:6379"], "scheme 'http'"),
        (["--tier", "redis", "--remote-url", "redis://:pw@127.0.0.1"], "must not carry a password"),
        (["--tier", "redis", "--remote-url", "redis://127.0.0.1/x"], "database number"),
        (["--tier", "cpu", "--remote-url", "redis://127.0.0.1"], "--tier redis or all"),
    ],
)
def test_bad_remote_flags_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = bench(capsys, *argv, *TINY)
    assert code == 2 and out == ""
    assert err.startswith("kvoffload bench: error: ") and message in err
    assert "--remote-url" in err and "Traceback" not in err and err.count("\n") == 1


def test_an_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    need_redis_py()
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    code, _, err = bench(capsys, "--tier", "redis", "--remote-url", url, *TINY)
    assert code == 2 and "cannot reach the server" in err and url in err
    assert "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("nbytes", [1, 4097, 1 << 20])
def test_a_packed_record_unpacks_to_its_payload(nbytes: int) -> None:
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    namespace, key = bytes(range(16)), b"chunk-key"
    record = pack_record(namespace, key, payload)
    out = np.zeros(nbytes, dtype=np.uint8)
    unpack_record_into(record.tobytes(), (namespace, key), out)
    assert np.array_equal(out, payload)
    with pytest.raises(CorruptChunkError):
        unpack_record_into(record.tobytes(), (namespace, b"other-key"), out)


def test_a_cluster_url_benches_through_any_node(
    redis_cluster: list[RedisServer], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}"
    code, out, _ = bench(capsys, "--tier", "redis", "--remote-url", url, *TINY, "--json")
    assert code == 0 and json.loads(out)[0]["lookups_per_s"] > 0
    assert [node.client().dbsize() for node in redis_cluster] == [0, 0, 0]
