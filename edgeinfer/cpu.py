"""The cores that other processes leave free: llama.cpp's default thread count, and its re-check.

A llama.cpp step waits for its slowest thread, and its OpenMP workers spin while they wait, so a
thread that shares its core with another busy process stalls every step. Measured on a 2-core
machine (`benchmarks/bench_threads.py`, benchmarks/RESULTS.md "Threads"), one-token decode:

    default model (135M)    idle: 2 threads 65 tok/s, 1 thread 41    one busy process: 2 → 23, 1 → 46
    Qwen2.5-Coder-1.5B      idle: 2 threads 9.9,      1 thread 6.4   one busy process: 2 → 3.4, 1 → 5.9

So when the caller does not pin a thread count, llama.cpp gets the cores that others leave free,
read from /proc/stat around the model's load, and re-checked every few seconds while it decodes
(our own process's CPU time is subtracted, so our own threads never count as "others").
`OMP_WAIT_POLICY=PASSIVE` (workers sleep instead of spinning) softens the stall (23 → 32 tok/s)
but costs 2 threads on an idle machine 20 % on one VM (65 → 52) and 3.7x on another (74 → 20), so it
is left to the user.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CpuSample", "ThreadGovernor", "read_sample", "others_busy", "threads_for", "usable_cores"]

log = logging.getLogger(__name__)

NOISE_CORES = 0.25  # others' use below this (kernel threads, a terminal) is not worth a thread
RECHECK_S = 2.0  # how often a decoding runtime re-reads the free cores
MIN_WINDOW_S = 0.05  # a shorter sample is mostly the 10 ms tick's rounding


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cgroup cpusets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU time (clock ticks) of the whole machine and of this process, at one moment."""

    at: float  # time.monotonic()
    total: int  # all CPUs, every state
    idle: int  # all CPUs, idle + iowait
    own: int  # this process (every thread): user + system
    n_cpu: int  # CPUs counted in `total`


def read_sample() -> CpuSample | None:
    """Now's counters from /proc/stat and /proc/self/stat; None where there are none (not Linux)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.read().splitlines()
        with open("/proc/self/stat", encoding="ascii") as f:
            own_fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
        at = time.monotonic()
        fields = [int(x) for x in lines[0].split()[1:]]
        n_cpu = sum(1 for line in lines[1:] if line.startswith("cpu"))
        own = int(own_fields[11]) + int(own_fields[12])  # utime, stime (fields 14, 15 of stat)
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    return CpuSample(at=at, total=sum(fields[:8]), idle=fields[3] + fields[4], own=own, n_cpu=max(1, n_cpu))


def others_busy(before: CpuSample, after: CpuSample) -> float:
    """Cores' worth of CPU that other processes used between two samples (0 … n_cpu)."""
    elapsed = after.total - before.total
    if elapsed <= 0:
        return 0.0
    busy = elapsed - (after.idle - before.idle) - (after.own - before.own)
    return min(float(after.n_cpu), max(0.0, busy / elapsed * after.n_cpu))


def threads_for(others: float, usable: int, n_cpu: int) -> int:
    """Threads for llama.cpp when others keep `others` cores busy: the free ones, at least one."""
    free = n_cpu - math.ceil(max(0.0, others - NOISE_CORES))
    return max(1, min(usable, free))


class ThreadGovernor:
    """Keeps a runtime's thread count at the free cores: `start()` before the load, `settle()` after
    it (the load's duration is the first sample window), `check()` between decode steps (cheap: it
    reads /proc only every `interval` seconds)."""

    def __init__(self, apply: Callable[[int], None], *, interval: float = RECHECK_S,
                 sampler: Callable[[], CpuSample | None] = read_sample, usable: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._apply = apply
        self._clock = clock  # the clock of the samples' `at`
        self._interval = interval
        self._sampler = sampler
        self.usable = usable or usable_cores()
        self.threads = self.usable
        self._last: CpuSample | None = None

    def start(self) -> None:
        self._last = self._sampler()

    def settle(self) -> int:
        """The thread count to create the context with (from the window since `start`)."""
        self._update(min_window=MIN_WINDOW_S, apply=False)
        return self.threads

    def check(self) -> None:
        """Between steps: re-read the free cores if `interval` has passed, and move to them."""
        last = self._last
        if last is None or self._clock() - last.at >= self._interval:
            self._update(min_window=0.0, apply=True)

    def _update(self, min_window: float, apply: bool) -> None:
        now = self._sampler()
        if now is None:
            return
        last = self._last
        if last is not None and now.at - last.at < min_window:
            return  # too short to tell: keep the window open
        self._last = now
        if last is None:
            return
        others = others_busy(last, now)
        want = threads_for(others, self.usable, now.n_cpu)
        if want != self.threads:
            log.info("other processes keep %.1f of %d cores busy: llama.cpp threads %d -> %d",
                     others, now.n_cpu, self.threads, want)
            self.threads = want
            if apply:
                self._apply(want)
