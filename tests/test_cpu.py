"""edgeinfer.cpu: the free cores that unpinned llama.cpp threads follow.

The policy is checked on synthetic counters; the reading of /proc against processes this test
starts itself (busy loops it knows the count of); the runtime's wiring with a real model beside
such processes."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest

from edgeinfer.cpu import CpuSample, ThreadGovernor, others_busy, read_sample, threads_for, usable_cores
from edgeinfer.llama_backend import THREADS_ENV

BUSY_LOOP = "import time\nend = time.time() + 120\nwhile time.time() < end: pass\n"


def sample(at: float, total: int, idle: int, own: int, n_cpu: int = 2) -> CpuSample:
    return CpuSample(at=at, total=total, idle=idle, own=own, n_cpu=n_cpu)


def test_others_busy_subtracts_idle_time_and_our_own():
    a = sample(0.0, 1000, 500, 100)
    # 200 ticks passed on 2 CPUs: 50 idle, we used 100 -> others used 50 of 200 = 0.5 cores
    assert others_busy(a, sample(1.0, 1200, 550, 200)) == pytest.approx(0.5)
    assert others_busy(a, sample(1.0, 1200, 700, 100)) == 0.0  # all idle
    assert others_busy(a, sample(1.0, 1200, 500, 300)) == 0.0  # all ours
    assert others_busy(a, sample(1.0, 1200, 500, 100)) == pytest.approx(2.0)  # all others'
    assert others_busy(a, a) == 0.0  # no time passed


@pytest.mark.parametrize(("others", "usable", "n_cpu", "threads"), [
    (0.0, 2, 2, 2), (0.2, 2, 2, 2),  # noise is not worth a thread
    (0.4, 2, 2, 1), (1.0, 2, 2, 1), (2.0, 2, 2, 1),  # never fewer than one
    (1.0, 8, 8, 7), (3.3, 8, 8, 4),
    (0.0, 2, 8, 2),  # an affinity mask of 2 CPUs on an 8-CPU machine
])
def test_threads_follow_the_free_cores(others, usable, n_cpu, threads):
    assert threads_for(others, usable, n_cpu) == threads


class FakeMachine:
    """Counters that advance as the test says: `others` cores busy, `ours` cores ours."""

    def __init__(self, n_cpu: int = 2):
        self.n_cpu, self.at, self.total, self.idle, self.own = n_cpu, 0.0, 0, 0, 0

    def run(self, seconds: float, others: float, ours: float = 0.0) -> None:
        ticks = int(seconds * 100 * self.n_cpu)
        self.at += seconds
        self.total += ticks
        self.own += int(ticks * ours / self.n_cpu)
        self.idle += int(ticks * (self.n_cpu - others - ours) / self.n_cpu)

    def sample(self) -> CpuSample:
        return sample(self.at, self.total, self.idle, self.own, self.n_cpu)


def test_governor_settles_from_the_load_window_and_rechecks_between_steps():
    m = FakeMachine()
    applied: list[int] = []
    gov = ThreadGovernor(applied.append, interval=2.0, sampler=m.sample, usable=2, clock=lambda: m.at)
    gov.start()
    m.run(0.01, others=1.0)
    assert gov.settle() == 2  # 10 ms tells nothing: all usable cores, the window stays open
    m.run(0.5, others=1.0)
    assert gov.settle() == 1 and applied == []  # settle only chooses; the context is made with it
    m.run(1.0, others=0.0, ours=1.0)
    gov.check()
    assert gov.threads == 1 and applied == []  # not yet two seconds
    m.run(1.5, others=0.0, ours=1.0)
    gov.check()
    assert gov.threads == 2 and applied == [2]  # the other process ended
    m.run(2.5, others=0.6, ours=1.4)  # it is back, and gets only what our threads leave it
    gov.check()
    assert applied == [2, 1]


def test_governor_without_proc_keeps_all_usable_cores():
    gov = ThreadGovernor(lambda n: None, sampler=lambda: None, usable=3)
    gov.start()
    assert gov.settle() == 3
    gov.check()
    assert gov.threads == 3


def busy_processes(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    time.sleep(0.3)  # past the interpreter's start
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


@pytest.mark.slow
@pytest.mark.skipif(read_sample() is None, reason="no /proc/stat")
def test_busy_processes_count_as_others_and_our_own_threads_do_not():
    n = usable_cores()
    procs = busy_processes(n)
    try:
        a = read_sample()
        time.sleep(0.5)
        b = read_sample()
    finally:
        stop(procs)
    assert others_busy(a, b) >= min(n, b.n_cpu) - 0.5

    spin = threading.Event()

    def ours() -> None:
        # 0.5 s of this thread's own CPU time, however long a loaded machine takes to give it
        start = time.thread_time()
        while time.thread_time() - start < 0.5 and not spin.is_set():
            pass

    t = threading.Thread(target=ours)
    a = read_sample()
    t.start()
    t.join(timeout=60)
    spin.set()
    b = read_sample()
    # the spinning thread's 0.5 s of CPU showed up as ours (others_busy subtracts it: the synthetic test)
    assert b.own - a.own >= 40


@pytest.mark.slow
@pytest.mark.skipif(read_sample() is None, reason="no /proc/stat")
def test_an_unpinned_engine_gives_up_threads_to_busy_processes(default_model_path, monkeypatch):
    """With every usable core held by a busy process, an unpinned engine decodes on one thread
    within a few seconds (the governor's re-check); one pinned by n_threads or by EDGEINFER_THREADS
    keeps what it was given."""
    import edgeinfer

    n = usable_cores()
    if n < 2:
        pytest.skip("one core: nothing to give up")
    monkeypatch.delenv(THREADS_ENV, raising=False)  # the suite's workers pin their share
    unpinned = edgeinfer.load(default_model_path, n_ctx=1024)
    pinned = edgeinfer.load(default_model_path, n_ctx=1024, n_threads=n)
    monkeypatch.setenv(THREADS_ENV, str(n))
    env_pinned = edgeinfer.load(default_model_path, n_ctx=1024)
    opts = edgeinfer.GenerateOptions(max_tokens=8, sampling=edgeinfer.SamplingOptions(temperature=0.0))
    errors: list[BaseException] = []

    def decode_until(engine, done) -> None:
        try:
            while not done():
                engine.generate("Count from one to ten.", opts).result()
        except BaseException as e:  # noqa: BLE001 - re-raised by the test's thread
            errors.append(e)

    procs = busy_processes(n)
    try:
        with unpinned, pinned, env_pinned:
            # The three decode side by side (the busy processes hold the machine meanwhile): our own
            # threads never count as others' load, so the unpinned engine sees only the busy processes.
            t0 = time.monotonic()
            workers = [threading.Thread(target=decode_until, args=(unpinned, lambda: unpinned.threads == 1
                                                                   or time.monotonic() - t0 > 60))]
            workers += [threading.Thread(target=decode_until, args=(engine, lambda: time.monotonic() - t0 > 2.5))
                        for engine in (pinned, env_pinned)]  # past the governor's re-check, had there been one
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=120)
            assert not errors, errors
            assert unpinned.threads == 1
            assert pinned.threads == n and env_pinned.threads == n
    finally:
        stop(procs)


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "99999"])
def test_a_bad_edgeinfer_threads_is_one_clear_error(monkeypatch, value):
    import edgeinfer
    from edgeinfer.quantize import quantize_model

    monkeypatch.setenv(THREADS_ENV, value)
    for call in (lambda: edgeinfer.LoadOptions().validate(), lambda: quantize_model("nothing.gguf", "Q4_0")):
        with pytest.raises(edgeinfer.InvalidOptionError, match=rf"^EDGEINFER_THREADS must be a whole number in \[1, \d+\].*got '{re.escape(value)}'$"):
            call()


def test_edgeinfer_threads_pins_what_the_caller_leaves_open(monkeypatch):
    import edgeinfer

    monkeypatch.setenv(THREADS_ENV, "3")
    assert edgeinfer.LoadOptions().threads == 3 and edgeinfer.LoadOptions().pinned_threads == 3
    assert edgeinfer.LoadOptions(n_threads=1).threads == 1  # the caller's count wins
    monkeypatch.setenv(THREADS_ENV, "")
    assert edgeinfer.LoadOptions().pinned_threads is None and edgeinfer.LoadOptions().threads == usable_cores()
