"""The GPU tier's lanes lock (tests/gpu_util.engine_starting / sleep_or_wake), with real
processes and a real lock file: a sleep waits for the starts in progress, holds new starts off
meanwhile, and starts overlap one another. Unset, both are no-ops."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest

from tests.gpu_util import LANES_LOCK_ENV, engine_starting, sleep_or_wake

CTX = mp.get_context("fork")


def _hold(kind: str, name: str, entered, release, times) -> None:
    """Hold the lock `kind` until `release` is set; report (name, entered, left) times."""
    with engine_starting() if kind == "start" else sleep_or_wake():
        t_in = time.monotonic()
        entered.set()
        release.wait(20)
        t_out = time.monotonic()
    times.put((name, t_in, t_out))


def _spawn(kind: str, name: str, times):
    entered, release = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_hold, args=(kind, name, entered, release, times))
    proc.start()
    return proc, entered, release


@pytest.fixture
def times(tmp_path, monkeypatch):
    """The lock file set for this test; the queue the holders report their times to."""
    monkeypatch.setenv(LANES_LOCK_ENV, str(tmp_path / "lanes.lock"))
    return CTX.Queue()


def _join(*procs) -> None:
    for proc in procs:
        proc.join(10)
        assert proc.exitcode == 0, proc


def test_unset_both_are_no_ops(monkeypatch) -> None:
    monkeypatch.delenv(LANES_LOCK_ENV, raising=False)
    done = threading.Event()

    def nested() -> None:  # with a lock, a second exclusive hold in one process would block
        with sleep_or_wake(), sleep_or_wake(), engine_starting():
            done.set()

    threading.Thread(target=nested, daemon=True).start()
    assert done.wait(5), "without GPU_LANES_LOCK the lane helpers must not lock"


def test_sleep_waits_for_starts_and_holds_new_ones_off(times) -> None:
    first, first_in, first_go = _spawn("start", "first start", times)
    assert first_in.wait(10)
    sleeper, sleeper_in, sleeper_go = _spawn("sleep", "sleep", times)
    time.sleep(0.5)  # the sleep now waits for the first start, holding the gate
    assert not sleeper_in.is_set(), "a sleep entered while an engine start held the lock"
    second, second_in, second_go = _spawn("start", "second start", times)
    time.sleep(0.5)
    assert not second_in.is_set(), "a start passed a waiting sleep (the gate)"
    first_go.set()
    assert sleeper_in.wait(10), "the sleep never entered after the start left"
    time.sleep(0.3)
    assert not second_in.is_set(), "a start entered while a sleep held the lock"
    sleeper_go.set()
    assert second_in.wait(10), "the second start never entered after the sleep left"
    second_go.set()
    _join(first, sleeper, second)
    got = {name: (t_in, t_out) for name, t_in, t_out in (times.get(timeout=5) for _ in range(3))}
    assert got["sleep"][0] >= got["first start"][1], got
    assert got["second start"][0] >= got["sleep"][1], got


def test_starts_overlap(times) -> None:
    first, first_in, first_go = _spawn("start", "first", times)
    assert first_in.wait(10)
    second, second_in, second_go = _spawn("start", "second", times)
    assert second_in.wait(10), "two engine starts must not exclude each other"
    first_go.set()
    second_go.set()
    _join(first, second)


def test_a_long_wait_is_reported(times, capfd) -> None:
    holder, holder_in, holder_go = _spawn("sleep", "holder", times)
    assert holder_in.wait(10)
    threading.Timer(1.2, holder_go.set).start()
    with engine_starting():
        pass
    _join(holder)
    assert "[gpu lanes] engine start: waited" in capfd.readouterr().err
