"""Several processes on one ``disk_path``: one budget, each other's chunks, no lost write.

Real processes (``tests/_disk_worker.py``) store, load and restart on one
directory while this test samples the bytes in it. A sample is taken while
holding the shared index's write lock, so no rename, eviction or reservation
happens during it: each sample is one consistent state of the directory, and
the assertions hold for every state, however the processes interleave.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _disk import bytes_in_files, indexed_keys, reservations
from _disk_worker import BASE, key_of, payload, size_of

from kvoffload import CacheGroup, KVLayout, build_offloading_config
from kvoffload.errors import TierError
from kvoffload.tiers._record import file_bytes
from kvoffload.tiers.disk import DiskProbe, DiskTier
from kvoffload.tiers.disk._schema import INDEX_NAME, LOCK_NAME
from kvoffload.tiers.from_config import lower_tiers

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_disk_worker.py")
NS = b"\x05" * 16
#: The largest chunk a worker stores, on disk.
CHUNK = file_bytes(BASE + 2 * 4096 + 6)


class Proc:
    """A worker process whose output lines a thread collects (a full pipe would block it)."""

    def __init__(
        self, root: Path, budget: int, *, worker: int, peers: int, rounds: int, stores: int
    ) -> None:
        args = [str(root), NS.hex(), str(budget), str(worker), str(peers), str(rounds), str(stores)]
        self.popen = subprocess.Popen(
            [sys.executable, str(WORKER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.strip())
        self.lines.put("")  # end of output

    def next_line(self, prefix: str) -> str:
        """The next output line starting with ``prefix`` (fails if the output ends first)."""
        while True:
            line = self.lines.get(timeout=120)
            assert line, f"worker ended early: {self.popen.wait()} {self.stderr()}"
            if line.startswith(prefix):
                return line

    def stderr(self) -> str:
        return (
            self.popen.stderr.read() if self.popen.stderr and self.popen.poll() is not None else ""
        )

    def finish(self) -> dict[str, object]:
        """Ask a worker that runs until stopped to stop; its totals once it exited."""
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        code = self.popen.wait(timeout=120)
        self._reader.join(timeout=120)
        lines = list(self.lines.queue)
        errors = self.stderr()
        self.close()
        assert code == 0, f"worker failed ({code}): {errors}"
        return json.loads(next(line for line in reversed(lines) if line.startswith("{")))

    def close(self) -> None:
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()


@contextlib.contextmanager
def index_locked(root: Path) -> Iterator[None]:
    """Hold the shared index's write lock: every other process's stores, evictions and
    renames wait, so the directory is one consistent state meanwhile."""
    db = sqlite3.connect(root / INDEX_NAME, timeout=60, isolation_level=None)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        db.execute("ROLLBACK")
        db.close()


def sample_while_running(root: Path, procs: list[Proc]) -> list[int]:
    """Bytes of chunk and temp files, sampled while any worker runs (at least once)."""
    samples = []
    while True:
        running = any(p.popen.poll() is None for p in procs)
        with index_locked(root):
            samples.append(bytes_in_files(root))
        if not running:
            return samples
        time.sleep(0.02)  # let the workers take the lock


def check_everything_loads(tier: DiskTier) -> None:
    keys = indexed_keys(tier.directory.parent, NS)
    for key in keys:
        out = np.empty(size_of(key), np.uint8)
        assert tier.get_into(key, out), key.hex()
        assert np.array_equal(out, payload(key)), key.hex()


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_share_one_directory_within_one_budget(tmp_path: Path, processes: int) -> None:
    """Each worker restarts 3 times, stores 16 chunks a round, loads the others' chunks."""
    budget = 20 * CHUNK
    DiskTier(tmp_path, budget, NS).close()  # the index exists before the first sample
    procs = [
        Proc(tmp_path, budget, worker=w, peers=processes, rounds=3, stores=16)
        for w in range(processes)
    ]
    samples = sample_while_running(tmp_path, procs)
    results = [p.finish() for p in procs]
    assert max(samples) <= budget, f"{sum(s > budget for s in samples)} samples over budget"
    for result in results:  # no failed start, no lost write, no wrong byte
        assert result["errors"] == []
        assert result["starts"] == 3 and result["stores"] == 48
        assert result["store_failures"] == result["bad_loads"] == 0
        assert result["corrupt"] == result["load_failures"] == 0
    final = DiskTier(tmp_path, budget, NS)
    assert reservations(tmp_path) == [] and not list(final.directory.glob("*.tmp"))
    assert final.stats().used_bytes <= budget and bytes_in_files(tmp_path) <= budget
    assert final.stats().counters["temp_files_cleaned"] == 0  # every writer cleaned up itself
    check_everything_loads(final)
    final.check_integrity()


def test_a_chunk_one_process_stored_is_a_hit_for_another(tmp_path: Path) -> None:
    budget = 64 * CHUNK
    first = Proc(tmp_path, budget, worker=0, peers=1, rounds=1, stores=5)
    assert first.finish()["stores"] == 5
    probe = DiskProbe(tmp_path, NS)
    assert probe.contains_many([key_of(0, i) for i in range(6)]) == [True] * 5 + [False]
    second = Proc(tmp_path, budget, worker=1, peers=2, rounds=1, stores=1)
    result = second.finish()
    assert result["peer_loads"] == 5 and result["bad_loads"] == 0  # all of the first's chunks
    other_model = DiskProbe(tmp_path, b"\x06" * 16)
    assert other_model.contains_many([key_of(0, 0)]) == [False]
    other_model.close()
    probe.close()


def _start_and_store(root: str, worker: int, barrier: Any) -> str:
    """In a child process: wait for the others, open the tier, store one chunk."""
    barrier.wait()
    try:
        tier = DiskTier(root, 64 * CHUNK, NS)
        tier.put(key_of(worker, 0), payload(key_of(worker, 0)))
        tier.close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on /dev/shm where there is one (collisions at start were ~10x as likely
    there as on ext4 here), else ``tmp_path``."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="kvoffload-test-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_processes_starting_together_on_a_new_directory(fast_dir: Path) -> None:
    """Six processes create the index of a new disk_path at once: none fails to start."""
    context = multiprocessing.get_context("fork")
    with context.Manager() as manager, context.Pool(6) as pool:
        for trial in range(6):
            root, barrier = str(fast_dir / str(trial)), manager.Barrier(6)
            jobs = [pool.apply_async(_start_and_store, (root, w, barrier)) for w in range(6)]
            assert [job.get(timeout=120) for job in jobs] == ["ok"] * 6
            tier = DiskTier(root, 64 * CHUNK, NS)
            assert sorted(indexed_keys(Path(root), NS)) == sorted(key_of(w, 0) for w in range(6))
            tier.check_integrity()
            tier.close()


def test_kill_9_mid_write_with_other_processes_running(tmp_path: Path) -> None:
    budget = 16 * CHUNK
    DiskTier(tmp_path, budget, NS).close()
    procs = [Proc(tmp_path, budget, worker=w, peers=3, rounds=0, stores=0) for w in range(3)]
    tokens = [p.next_line("owner").split()[1] for p in procs]
    for p in procs:
        p.next_line("stored 3")
    victim, token = procs[0], tokens[0]
    ns_dir = tmp_path / NS.hex()
    for _ in range(100_000):  # kill the moment one of its writes is in flight
        if any(token in name and name.endswith(".tmp") for name in os.listdir(ns_dir)):
            break
    victim.popen.kill()
    assert victim.popen.wait() == -9
    victim._reader.join(timeout=120)
    victim.close()
    newcomer = DiskTier(tmp_path, budget, NS)  # starts while the others write
    assert not [name for name in os.listdir(ns_dir) if token in name]  # temps, owner file
    assert all(owner != token for _, owner, _ in reservations(tmp_path))
    for p in procs[1:]:
        stored = int(p.next_line("stored").split()[1])
        p.next_line(f"stored {stored + 3}")  # they keep storing after the newcomer started
    for result in [p.finish() for p in procs[1:]]:  # none lost a write in flight
        assert result["errors"] == [] and result["store_failures"] == 0
        assert result["bad_loads"] == result["corrupt"] == result["load_failures"] == 0
    assert reservations(tmp_path) == [] and not list(ns_dir.glob("*.tmp"))
    assert bytes_in_files(tmp_path) <= budget
    check_everything_loads(newcomer)
    newcomer.check_integrity()


def test_tensor_parallel_ranks_share_one_budget(tmp_path: Path) -> None:
    """Each rank has its own namespace directory; disk_bytes_to_use bounds them together."""
    group = CacheGroup(kind="full", tokens_per_block=16, layer_names=("a",), page_bytes=8192)
    budget = 10 * file_bytes(8192)
    config = build_offloading_config(
        {"cpu_bytes_to_use": 1 << 20, "disk_path": str(tmp_path), "disk_bytes_to_use": budget},
        KVLayout(groups=(group,)),
        world_size=2,
    )
    [rank0], [rank1] = lower_tiers(config, b"\x01" * 16), lower_tiers(config, b"\x02" * 16)
    for i in range(30):  # both ranks store their shard of every chunk
        for tier in (rank0, rank1):
            tier.put(key_of(0, i), np.full(8192, i, np.uint8))
            assert bytes_in_files(tmp_path) <= budget
    assert rank0.stats().used_bytes == rank1.stats().used_bytes == budget
    assert rank0.stats().evictions + rank1.stats().evictions == 60 - 10
    assert len(os.listdir(tmp_path / (b"\x01" * 16).hex())) > 1  # both ranks' directories
    for tier in (rank0, rank1):
        tier.check_integrity()
        tier.close()


def test_a_stuck_process_holding_the_index_fails_stores_instead_of_stalling(
    tmp_path: Path,
) -> None:
    """Another process holds the writer lock and never lets go (stopped, hung): stores fail
    after a bounded wait, counted; loads and lookups go on; once it lets go, stores work."""
    tier = DiskTier(tmp_path, 16 * CHUNK, NS)
    tier.put(key_of(0, 0), payload(key_of(0, 0)))
    stuck = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'rb'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(600)",
         str(tmp_path / LOCK_NAME)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert stuck.stdout is not None and stuck.stdout.readline() == "locked\n"
        with pytest.raises(TierError, match="held for over"):
            tier.put(key_of(0, 1), payload(key_of(0, 1)))
        assert tier.contains_many([key_of(0, 0), key_of(0, 1)]) == [True, False]
        out = np.empty(size_of(key_of(0, 0)), np.uint8)
        assert tier.get_into(key_of(0, 0), out) and np.array_equal(out, payload(key_of(0, 0)))
        assert tier.stats().store_failures == 1
    finally:
        stuck.kill()
        stuck.wait()
        assert stuck.stdout is not None
        stuck.stdout.close()
    tier.put(key_of(0, 1), payload(key_of(0, 1)))
    assert reservations(tmp_path) == [] and not list(tier.directory.glob("*.tmp"))
    tier.check_integrity()
    tier.close()


#: A writer that stops for good inside a store, at the step named by argv[3]: after its
#: reservation and half its temp file ("writing"), or after renaming the finished file into
#: place but before recording it ("renamed"). It uses the writer's private steps on purpose:
#: these are the instants a kill -9 can hit.
HALF_STORE = """
import os, sys, time
import numpy as np
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers._record import file_bytes
tier = DiskTier(sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[4]))
key = (7).to_bytes(16, "little")
data = np.frombuffer(np.random.default_rng(7).bytes(50_000), np.uint8)
writer = tier._writer
temp = writer.owner.temp_name(key.hex(), 99)
writer._reserve(temp, file_bytes(data.nbytes))
if sys.argv[3] == "writing":
    fd = writer.directory.create(temp)
    os.write(fd, b"half a chunk")
else:
    writer._write_temp(temp, key, data, file_bytes(data.nbytes))
    writer.directory.rename(temp, key.hex() + ".kv")
print("stopped", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("step", ["writing", "renamed"])
def test_a_writer_killed_inside_a_store_is_cleaned_up_by_the_next_start(
    tmp_path: Path, step: str
) -> None:
    budget = 16 * CHUNK
    child = subprocess.Popen(
        [sys.executable, "-c", HALF_STORE, str(tmp_path), str(budget), step, NS.hex()],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "stopped\n"
    [(temp, owner, reserved)] = reservations(tmp_path)
    child.kill()
    child.wait()
    child.stdout.close()
    tier = DiskTier(tmp_path, budget, NS)
    assert reservations(tmp_path) == [] and not (tier.directory / temp).exists()
    assert not list(tier.directory.glob(f"{owner}*"))  # nor its owner file
    key = (7).to_bytes(16, "little")
    if step == "writing":  # the half-written temp file is gone, nothing else is
        assert tier.stats().counters["temp_files_cleaned"] == 1
        assert tier.stats().used_bytes == 0 and not tier.contains_many([key])[0]
    else:  # the finished chunk is kept, and counted
        assert indexed_keys(tmp_path, NS) == [key]
        assert tier.stats().used_bytes == reserved == file_bytes(50_000)
        out = np.empty(50_000, np.uint8)
        assert tier.get_into(key, out)
        assert np.array_equal(out, np.frombuffer(np.random.default_rng(7).bytes(50_000), np.uint8))
    tier.check_integrity()
    tier.close()
