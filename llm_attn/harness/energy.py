"""Energy per measurement: joules per prefill and per decoded token, read on the same repeats as the times.

Where the energy comes from (``open_meter``), in this order:

- **Jetson** (any device of the run: the rails measure the board): the INA3221 power monitors in sysfs, read by a
  sampling thread every ``JETSON_PERIOD_S`` and integrated over each repeat's window (piecewise linear between
  samples). Two layouts exist (checked against alumet's and jetson-stats' readers and the Tegra234 device trees):
  JetPack 5 and 6 (L4T r35/r36) use the hwmon driver, ``/sys/bus/i2c/drivers/ina3221/<bus>-<addr>/hwmon/hwmon*/``
  with ``in<N>_label``, ``in<N>_input`` (mV) and ``curr<N>_input`` (mA); JetPack 4 (L4T r32) the iio driver,
  ``/sys/bus/i2c/drivers/ina3221x/<bus>-<addr>/iio:device*/`` with ``rail_name_<N>`` and ``in_power<N>_input`` (mW).
  Which rail is which: ``RAIL_MEANING``. ``energy_j`` is the module input (``VDD_IN``) where the board has one
  (Orin NX / Orin Nano, Xavier NX), else the sum of every measured rail (AGX Orin has no input rail: VDD_GPU_SOC +
  VDD_CPU_CV + VIN_SYS_5V0 + VDDQ_VDD2_1V8AO, regulator losses not included); every rail's own energy is kept too.
  The nvpmodel mode is read at the start of each point (``/var/lib/nvpmodel/status`` and ``/etc/nvpmodel.conf``,
  else ``nvpmodel -q``).
- **NVIDIA GPU with NVML** (``nvidia-ml-py``, import name ``pynvml``; the ``nvml`` extra): the GPU's total-energy
  counter (``nvmlDeviceGetTotalEnergyConsumption``, mJ since the driver loaded, Volta and newer). The driver updates
  it only every ~100 ms (an H100, measured by experiments/energy_check.py), so its raw difference over a 69 ms
  prefill is 0 or one or two updates' worth (60 % repeat-to-repeat spread at 2k tokens on an H100). A thread polls it
  every ``NVML_PERIOD_S`` and keeps the times at which its value changed. A repeat's energy is read one of two ways,
  and the row says which (``energy.readings`` per repeat, ``energy.reading``, ``energy.note``):

  - *window* (a timed window of at least ``BURST_BELOW_PERIODS`` counter periods, or a caller that cannot repeat the
    work: decode): the counter interpolated linearly between its updates at the repeat's start and end (``end``
    waits for the first update past the end, at most ``COUNTER_WAIT_S``), the raw difference where no update
    brackets the window. Its resolution is still the update period: the updates around the window mix its power
    with the idle time around it (2.1 % spread at 8k on an H100, 270 ms; 8.7-10.6 % at 2k, 69 ms).
  - *burst* (a shorter window, where the caller passes ``again``: TTFT): right after the timed prefill, ``n``
    back-to-back prefills of the same input (as many as span ``BURST_PERIODS`` counter periods and
    ``BURST_MIN_UPDATES`` updates, at least 2: ``burst_done``) whose average power is the least-squares slope of the
    counter over its updates inside the burst (every one of them under load: no idle edge is mixed in; an update
    seen by a poll more than ``MAX_POLL_GAP_S`` after the poll before, a stalled poll thread, is left out); the
    repeat's J per prefill is that power x the burst's length / ``n``.
    It is the energy of one prefill among back-to-back ones, not a reading of the timed prefill alone, whose time
    stays the TTFT sample; repeat i of every implementation is its own burst, so the paired ratio still pairs
    repeat i with repeat i. On synthetic traces of a 100 ms counter with jitter (tests/test_energy.py) a 69 ms
    prefill reads within 1 % of the true energy with a 0.5-1.2 % spread (0.9-1.8 % with 8 ms jitter; the same
    with a poll thread stalled 50-400 ms every 2 s), where the window reading spreads 7-15 % and reads ~30 % low
    (idle at 90 W between repeats).

  The same thread reads ``nvmlDeviceGetPowerUsage`` for the peak power only (on Ampere and newer, except GA100, NVML
  returns that reading averaged over one second). The board power limit in force is read at the start of each point.
- **Neither** (a CPU run off a Jetson, a GPU without NVML or whose counter cannot be read: no nvidia-ml-py, a
  container without the library, NVML_ERROR_NO_PERMISSION, a pre-Volta GPU): the energy columns stay empty and
  ``energy.note`` says why. Reading energy never fails a run: a read that fails mid-run empties that repeat's value
  and says so in the note.

``LLM_ATTN_SYSFS_ROOT`` reads the Jetson files under another root (recorded sysfs trees: tests/fixtures/jetson_*).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llm_attn.harness.stats import format_ratio_interval, paired_ratio_interval, summarize

METHOD_NVML = "nvml_total_energy_counter"
METHOD_JETSON = "ina3221_rails_sampled"
NVML_PERIOD_S = 0.005  # the counter's poll (its updates come every ~100 ms) and the peak power's samples
COUNTER_WAIT_S = 0.5  # how long ``end`` waits for the counter's first update past a window
MAX_POLL_GAP_S = 0.025  # an update seen by a poll this long after the one before is not timed well enough for a burst
# A timed window shorter than BURST_BELOW_PERIODS counter updates is read from a burst (its interpolated window
# reading spreads by ~7 % x period / window on an H100: 2.1 % at 2.7 periods, 9-11 % at 0.7); the burst spans
# BURST_PERIODS updates: 4-5 updates inside it, ~0.8 % spread on synthetic traces with jitter (3 periods: ~1.6 %).
BURST_BELOW_PERIODS = 2.5
BURST_PERIODS = 5.0
BURST_MIN_UPDATES = 4  # well-timed counter updates inside a burst (3 intervals) before it may stop
BURST_MAX_PERIODS = 15.0  # ... unless it has run this long (a poll thread stalled throughout): then it stops
BURST_MAX_PREFILLS = 1000  # a 0.5 ms prefill would otherwise take more
READING_WINDOW = "window"
READING_BURST = "burst"
BURST_HOW = ("J per prefill = the average power of n back-to-back prefills of the same input run right after the "
             "timed one (the least-squares slope of the NVML counter over its updates inside the burst) x the "
             "burst's length / n; the timed prefill's own energy is below the counter's resolution")
JETSON_PERIOD_S = 0.01  # 6-8 sysfs reads per sample; a 256-token prefill on Orin (~170 ms) gets ~17 samples
SYSFS_ROOT_ENV = "LLM_ATTN_SYSFS_ROOT"

# What each INA3221 rail measures (NVIDIA's Jetson Linux power guides; rail names as the Tegra234/194/210 device
# trees label them). The module-input rails give a board's total; elsewhere the rails are summed.
RAIL_MEANING = {
    # Jetson AGX Orin (p3701): INA3221 at 1-0040 and 1-0041
    "VDD_GPU_SOC": "GPU and SoC core (AGX Orin)",
    "VDD_CPU_CV": "CPU cores and CV accelerators: DLA, PVA (AGX Orin)",
    "VIN_SYS_5V0": "the module's 5 V system rail: I/O and peripherals (AGX Orin); not the module's total input",
    "VDDQ_VDD2_1V8AO": "DRAM (VDDQ, VDD2) and the always-on 1.8 V rail (AGX Orin)",
    # Jetson Orin NX / Orin Nano (p3767), Xavier NX
    "VDD_IN": "module input: the whole module's power (Orin NX, Orin Nano, Xavier NX)",
    "VDD_CPU_GPU_CV": "CPU, GPU and CV accelerators together (Orin NX, Orin Nano, Xavier NX)",
    "VDD_SOC": "SoC core (Orin NX, Orin Nano, Xavier NX)",
    # Jetson AGX Xavier (JetPack 4 names)
    "GPU": "GPU (AGX Xavier)", "CPU": "CPU cores (AGX Xavier)", "SOC": "SoC core (AGX Xavier)",
    "CV": "CV accelerators (AGX Xavier)", "VDDRQ": "DRAM (AGX Xavier)", "SYS5V": "5 V system rail (AGX Xavier)",
    # Jetson Nano
    "POM_5V_IN": "module input: the whole module's power (Jetson Nano)", "POM_5V_GPU": "GPU (Jetson Nano)",
    "POM_5V_CPU": "CPU cores (Jetson Nano)",
}
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")
# Labels of channels that measure nothing: not connected, or the INA3221's summation channel (in7).
_SKIP_LABEL = re.compile(r"^(nc|)$|sum of shunt", re.IGNORECASE)


# -- the meters ---------------------------------------------------------------------------------------------------------
class Meter:
    """No energy source here: every window reads None and ``note`` says why. The base of the real meters.

    A meter's life: ``start_point()`` at the start of a point (reads ``settings()``: power limit / nvpmodel), then
    per timed repeat ``w = begin()`` right before it and ``end(w, tokens=..., again=...)`` right after it (the device
    idle at both), ``close()`` at the end of the run. ``end`` returns ``{"energy_j", "duration_s", "peak_w",
    "rails_j", "tokens", "reading", "burst"}`` or None. ``again``: a callable that runs the timed work once more and
    waits for the device (TTFT passes the prefill); a meter whose source is too coarse for the window may call it
    to measure a burst (``NvmlMeter``), and says so in ``reading`` / ``burst``."""

    available = False
    method: str | None = None
    scope: str | None = None
    peak_method: str | None = None
    interpolation: str | None = None  # how a window's energy is read between the source's updates, where it is

    def __init__(self, note: str | None = None):
        self.note = note
        self._errors: list[str] = []

    def settings(self) -> dict:
        return {}

    def begin(self):
        return None

    def end(self, window, tokens: int | None = None, again=None) -> dict | None:
        return None

    def close(self) -> None:
        pass

    def counter_period_s(self) -> float | None:
        """Seconds between the energy source's updates, where it has a counter that updates in steps."""
        return None

    def _failed(self, what: str, e: BaseException) -> None:
        msg = f"{what}: {type(e).__name__}: {e}"
        if msg not in self._errors:
            self._errors.append(msg)

    def start_point(self) -> dict:
        """The start of a measurement point: forget the last point's read failures, read ``settings()``."""
        self._errors = []
        return self.settings()

    def errors(self) -> list[str]:
        """Read failures since ``start_point`` (a repeat whose value is None says why here)."""
        return list(self._errors)


class Sampler:
    """A daemon thread calling ``read()`` (-> (total W, {rail: W})) every ``period_s``, keeping (time, total, rails)
    samples for ``integrate``/``peak`` over a window of ``time.perf_counter`` times."""

    MAX_FAILURES = 20  # consecutive failed reads (an I2C glitch is one) before the thread gives up

    def __init__(self, read, period_s: float, keep: int = 200_000):
        self.read, self.period_s = read, period_s
        self.samples: deque = deque(maxlen=keep)
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llm_attn-power-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        nxt, failures = time.perf_counter(), 0
        while not self._stop.is_set():
            try:
                total, rails = self.read()
            except Exception as e:  # noqa: BLE001 (recorded; a window without samples reads None and says why)
                self.error, failures = e, failures + 1
                if failures >= self.MAX_FAILURES:  # not a glitch: the source is gone
                    return
            else:
                failures = 0
                with self.lock:
                    self.samples.append((time.perf_counter(), total, rails))
            nxt += self.period_s
            delay = nxt - time.perf_counter()
            if delay < 0:  # fell behind (a slow read): restart the schedule rather than burst
                nxt, delay = time.perf_counter(), 0.0
            self._stop.wait(delay)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_past(self, t: float, timeout: float) -> bool:
        """Wait until a sample taken at or after ``t`` exists (so a window's end can be interpolated)."""
        deadline = time.perf_counter() + timeout
        while True:
            with self.lock:
                if self.samples and self.samples[-1][0] >= t:
                    return True
            if not self.alive() or time.perf_counter() > deadline:
                return False
            time.sleep(self.period_s / 4)

    def _window(self, t0: float, t1: float) -> list[tuple]:
        """The samples inside [t0, t1] plus the nearest one on each side (to interpolate the edges), in time order.
        Walked from the newest: windows are recent, and the deque holds hours of samples."""
        picked, after = [], None
        with self.lock:
            for p in reversed(self.samples):
                if p[0] > t1:
                    after = p
                    continue
                picked.append(p)
                if p[0] < t0:
                    break
        picked.reverse()
        return picked + ([after] if after is not None else [])

    def peak(self, t0: float, t1: float) -> float | None:
        """The largest sample inside [t0, t1]; for a window shorter than the sampling period (no sample inside), the
        larger of the two samples around it, the ones ``integrate`` interpolates between. None without samples."""
        pts = self._window(t0, t1)
        inside = [p[1] for p in pts if t0 <= p[0] <= t1]
        if inside:
            return max(inside)
        return max(p[1] for p in pts) if pts else None

    def integrate(self, t0: float, t1: float) -> tuple[float, dict[str, float]] | None:
        """Joules over [t0, t1] of the total and of each rail: the trapezoid of the samples, linearly interpolated at
        the window's edges (held constant beyond the first/last sample). None without any sample."""
        pts = self._window(t0, t1)
        if not pts:
            return None
        ts = np.array([p[0] for p in pts])

        def joules(values) -> float:
            v = np.asarray(values, dtype=np.float64)
            inner = (ts > t0) & (ts < t1)
            x = np.concatenate([[t0], ts[inner], [t1]])
            y = np.concatenate([[np.interp(t0, ts, v)], v[inner], [np.interp(t1, ts, v)]])
            return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2)

        rails = {name: joules([p[2][name] for p in pts]) for name in pts[0][2]}
        return joules([p[1] for p in pts]), rails

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


# -- NVML ---------------------------------------------------------------------------------------------------------------
def _nvml_error(e: BaseException) -> str:
    """``NVMLError_NoPermission: Insufficient Permissions``: the NVML error class names the case."""
    return f"{type(e).__name__}: {e}"


def interpolated_counter_j(updates: list[tuple], t0: float, t1: float) -> float | None:
    """Joules over [t0, t1] of a counter seen as ``updates`` ((time first seen, mJ[, seconds since the poll
    before]), in time order), interpolated linearly between them; None when no update at or before ``t0`` is seen
    (beyond the last, it is held)."""
    if not updates or updates[0][0] > t0:
        return None
    ts = np.array([u[0] for u in updates])
    mj = np.array([u[1] for u in updates], dtype=np.float64)
    return float(np.interp(t1, ts, mj) - np.interp(t0, ts, mj)) / 1e3


def counter_power_w(updates: list[tuple], t0: float, t1: float) -> float | None:
    """Average watts over [t0, t1] from the counter's updates seen inside it: the least-squares slope of joules on
    time (every update counts, so the jitter of when each is seen averages out). An update whose poll came more than
    ``MAX_POLL_GAP_S`` after the poll before it (a stalled poll thread: it happened anywhere in that gap, and the
    updates before it in the gap were not seen) is left out. None with fewer than three left."""
    pts = [(u[0], u[1]) for u in updates if t0 <= u[0] <= t1 and (len(u) < 3 or u[2] <= MAX_POLL_GAP_S)]
    if len(pts) < 3:
        return None
    ts = np.array([t for t, _ in pts])
    j = np.array([v for _, v in pts], dtype=np.float64) / 1e3
    ts = ts - ts.mean()
    return float(np.sum(ts * (j - j.mean())) / np.sum(ts * ts))


def timed_updates(updates: list[tuple], t0: float, t1: float) -> int:
    """How many of ``updates`` inside [t0, t1] are timed well enough for ``counter_power_w``."""
    return sum(1 for u in updates if t0 <= u[0] <= t1 and (len(u) < 3 or u[2] <= MAX_POLL_GAP_S))


def burst_done(n: int, elapsed_s: float, period_s: float, timed: int) -> bool:
    """Whether a burst of ``n`` repeats that has lasted ``elapsed_s`` with ``timed`` well-timed counter updates
    inside is long enough: at least two repeats spanning ``BURST_PERIODS`` counter periods with
    ``BURST_MIN_UPDATES`` updates (a stalled poll loses some), or ``BURST_MAX_PERIODS`` periods, or
    ``BURST_MAX_PREFILLS`` repeats. Judged on the clock and the updates seen, not predicted from the timed window (a
    prefill's time varies: a loaded host); the rule knows nothing of the power, so where it stops cannot bias the
    reading."""
    if n >= BURST_MAX_PREFILLS or (n >= 2 and elapsed_s >= BURST_MAX_PERIODS * period_s):
        return True
    return n >= 2 and elapsed_s >= BURST_PERIODS * period_s and timed >= BURST_MIN_UPDATES


def wants_burst(window_s: float, period_s: float | None) -> bool:
    """A window shorter than ``BURST_BELOW_PERIODS`` counter periods (period known) is read from a burst."""
    return period_s is not None and window_s < BURST_BELOW_PERIODS * period_s


class NvmlMeter(Meter):
    available = True
    method = METHOD_NVML
    scope = "the GPU board (NVML total-energy counter)"
    peak_method = f"max of nvmlDeviceGetPowerUsage sampled every {NVML_PERIOD_S * 1e3:.0f} ms inside the repeats"
    interpolation = ("the counter interpolated linearly between its updates (polled every "
                     f"{NVML_PERIOD_S * 1e3:.0f} ms) at each repeat's start and end")

    def __init__(self, pynvml, handle, match: str, period_s: float = NVML_PERIOD_S):
        super().__init__(None)
        self.nvml, self.handle, self.match = pynvml, handle, match
        # (perf_counter time first seen, mJ, seconds since the poll before) of each counter value
        self.updates: deque = deque(maxlen=20_000)
        self.updates_lock = threading.Lock()
        self._last_poll: float | None = None
        self.sampler = Sampler(self._power, period_s)

    def _power(self) -> tuple[float, dict]:
        self._poll_counter()
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3, {}

    def _poll_counter(self) -> None:
        try:
            mj = self.energy_mj()
        except Exception:  # noqa: BLE001 (end() reads the counter itself and records its failure)
            return
        t = time.perf_counter()
        gap, self._last_poll = t - (self._last_poll if self._last_poll is not None else -math.inf), t
        with self.updates_lock:
            if not self.updates or mj != self.updates[-1][1]:
                self.updates.append((t, mj, gap))

    def _timed_since(self, t0: float, t1: float) -> int:
        with self.updates_lock:
            recent = list(itertools.takewhile(lambda u: u[0] >= t0, reversed(self.updates)))
        return timed_updates(recent, t0, t1)

    def counter_period_s(self) -> float | None:
        """Median seconds between the counter's updates seen so far (None before three updates)."""
        with self.updates_lock:
            ts = [u[0] for u in self.updates]
        return float(np.median(np.diff(ts[-50:]))) if len(ts) > 3 else None

    def interpolated_j(self, t0: float, t1: float, wait_s: float = COUNTER_WAIT_S) -> float | None:
        """Joules over [t0, t1] from the counter interpolated between its updates, waiting up to ``wait_s`` for an
        update past ``t1``; None when no update at or before ``t0`` or after ``t1`` is seen (the caller keeps the raw
        difference)."""
        deadline = time.perf_counter() + wait_s
        while True:
            with self.updates_lock:
                last = self.updates[-1][0] if self.updates else None
            if last is not None and last > t1:
                break
            if time.perf_counter() > deadline or not self.sampler.alive():
                return None
            time.sleep(NVML_PERIOD_S)
        with self.updates_lock:
            pts = list(self.updates)
        return interpolated_counter_j(pts, t0, t1)

    def energy_mj(self) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def settings(self) -> dict:
        out = {"nvml_device_match": self.match}
        for key, fn in (("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit"),
                        ("default_power_limit_w", "nvmlDeviceGetPowerManagementDefaultLimit")):
            try:
                out[key] = getattr(self.nvml, fn)(self.handle) / 1e3
            except Exception as e:  # noqa: BLE001 (NVMLError or a missing function: recorded as unknown)
                out[key] = None
                self._failed(f"reading {fn}", e)
        return out

    def begin(self):
        try:
            return time.perf_counter(), self.energy_mj()
        except Exception as e:  # noqa: BLE001 (NVMLError: this repeat has no energy; the run goes on)
            self._failed("reading the NVML energy counter", e)
            return None

    def end(self, window, tokens: int | None = None, again=None) -> dict | None:
        if window is None:
            return None
        t0, e0 = window
        try:
            e1 = self.energy_mj()
        except Exception as e:  # noqa: BLE001
            self._failed("reading the NVML energy counter", e)
            return None
        t1 = time.perf_counter()
        if e1 < e0:
            self._failed("the NVML energy counter", ValueError(f"went backwards ({e0} -> {e1} mJ): driver reloaded?"))
            return None
        out = {"duration_s": t1 - t0, "peak_w": self.sampler.peak(t0, t1), "rails_j": None, "tokens": tokens,
               "reading": READING_WINDOW, "burst": None}
        period = self.counter_period_s()
        if again is not None and wants_burst(t1 - t0, period):
            burst = self._burst(again, t1 - t0, period)
            if burst is not None:
                return {**out, "energy_j": burst["energy_j"], "reading": READING_BURST, "burst": burst}
        joules = self.interpolated_j(t0, t1)
        if joules is None:  # no update brackets the window (the poll failed or stalled): the raw difference
            self._failed("interpolating the NVML energy counter",
                         RuntimeError("no counter update around the window; its raw difference is used"))
            joules = (e1 - e0) / 1e3
        return {**out, "energy_j": joules}

    def _burst(self, again, window_s: float, period_s: float) -> dict | None:
        """Run ``again`` back to back until ``burst_done`` and read their average power from the counter's updates
        inside the burst: ``{"n", "duration_s", "power_w", "energy_j" (per repeat), "window_periods"}``, or None
        (recorded) when fewer than three well-timed updates were seen inside it (the caller reads the timed window
        instead)."""
        n, b0 = 0, time.perf_counter()
        try:
            while not burst_done(n, (now := time.perf_counter()) - b0, period_s, self._timed_since(b0, now)):
                again()
                n += 1
        except Exception as e:  # noqa: BLE001 (the burst is for energy only: the timed repeat stands)
            self._failed("the energy burst", e)
            return None
        b1 = time.perf_counter()
        with self.updates_lock:
            pts = list(itertools.takewhile(lambda u: u[0] >= b0, reversed(self.updates)))[::-1]
        watts = counter_power_w(pts, b0, b1)
        if watts is None:
            self._failed("the energy burst", RuntimeError(
                f"fewer than 3 well-timed counter updates in a {b1 - b0:.3f} s burst (a stalled poll thread); the "
                "timed window is read instead"))
            return None
        return {"n": n, "duration_s": b1 - b0, "power_w": watts, "energy_j": watts * (b1 - b0) / n,
                "window_periods": window_s / period_s}

    def close(self) -> None:
        self.sampler.close()
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 (shutting down twice or after a driver error: nothing to do)
            pass


def _cuda_identity(index: int) -> str | None:
    """The CUDA device's UUID as NVML spells it (``GPU-...``): CUDA and NVML number devices differently under
    CUDA_VISIBLE_DEVICES."""
    try:
        import torch  # noqa: PLC0415

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 (an older torch without .uuid, or no CUDA)
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def open_nvml_meter(index: int, uuid: str | None = None) -> Meter:
    """An NvmlMeter for CUDA device ``index`` (found by ``uuid`` when given), or a Meter whose note says why not."""
    try:
        import pynvml  # noqa: PLC0415 (optional: the nvml extra)
    except ImportError:
        return Meter("no NVML: nvidia-ml-py is not installed (python -m pip install nvidia-ml-py, or the 'nvml' "
                     "extra)")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 (NVMLError_LibraryNotFound in a container without the driver library, ...)
        return Meter(f"NVML did not start ({_nvml_error(e)})")
    try:
        handle, match = None, None
        if uuid:
            try:
                handle, match = pynvml.nvmlDeviceGetHandleByUUID(uuid), "uuid"
            except Exception:  # noqa: BLE001 (fall back to the index)
                handle = None
        if handle is None:
            handle, match = pynvml.nvmlDeviceGetHandleByIndex(index), "index"
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception as e:  # noqa: BLE001 (NotSupported before Volta, NoPermission in some containers and vGPUs)
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        return Meter(f"the NVML total-energy counter cannot be read here ({_nvml_error(e)}); it needs a Volta or "
                     "newer GPU and permission to read it")
    return NvmlMeter(pynvml, handle, match)


# -- Jetson INA3221 rails -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rail:
    name: str
    sensor: str  # e.g. "1-0040/hwmon/hwmon3"
    layout: str  # "hwmon" (JetPack 5, 6) or "iio" (JetPack 4)
    volt: Path | None = None  # mV (hwmon)
    curr: Path | None = None  # mA (hwmon)
    power: Path | None = None  # mW (iio)

    def watts(self) -> float:
        if self.power is not None:
            return float(self.power.read_text().split()[0]) / 1e3
        return float(self.volt.read_text().split()[0]) * float(self.curr.read_text().split()[0]) / 1e6

    @property
    def meaning(self) -> str:
        return RAIL_MEANING.get(self.name, "not in llm_attn's rail table (harness/energy.py RAIL_MEANING)")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip().strip("\x00")
    except OSError:
        return None


def find_rails(root: str | os.PathLike = "/") -> list[Rail]:
    """The INA3221 rails under ``root`` (both layouts), skipping unconnected channels ("NC", no label) and the
    summation channel. Empty off a Jetson."""
    root = Path(root)
    rails = []
    hw = root / "sys" / "bus" / "i2c" / "drivers" / "ina3221"
    for dev in sorted(hw.glob("*-*")):
        for mon in sorted((dev / "hwmon").glob("hwmon*")):
            for label in sorted(mon.glob("in*_label"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)):
                n = re.sub(r"\D", "", label.name)
                name = _read(label) or ""
                volt, curr = mon / f"in{n}_input", mon / f"curr{n}_input"
                if _SKIP_LABEL.search(name) or not (volt.exists() and curr.exists()):
                    continue
                rails.append(Rail(name, f"{dev.name}/hwmon/{mon.name}", "hwmon", volt=volt, curr=curr))
    iio = root / "sys" / "bus" / "i2c" / "drivers" / "ina3221x"
    for dev in sorted(iio.glob("*-*")):
        for node in sorted(dev.glob("iio:device*")):
            for label in sorted(node.glob("rail_name_*")):
                n = label.name.rsplit("_", 1)[1]
                name = _read(label) or ""
                power = node / f"in_power{n}_input"
                if _SKIP_LABEL.search(name) or not power.exists():
                    continue
                rails.append(Rail(name, f"{dev.name}/{node.name}", "iio", power=power))
    return rails


def jetson_release(root: str | os.PathLike = "/") -> dict:
    """Board model, L4T release and the JetPack major it belongs to, from ``/proc/device-tree/model`` and
    ``/etc/nv_tegra_release`` (``# R36 (release), REVISION: 4.3, ...``)."""
    root = Path(root)
    model = _read(root / "proc" / "device-tree" / "model")
    release = _read(root / "etc" / "nv_tegra_release")
    l4t = jetpack = None
    m = re.match(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release or "")
    if m:
        l4t = f"R{m.group(1)}.{m.group(2)}"
        jetpack = {"32": "4", "34": "5", "35": "5", "36": "6", "38": "7"}.get(m.group(1))
    return {"model": model, "l4t": l4t, "jetpack": jetpack}


def nvpmodel_mode(root: str | os.PathLike = "/") -> dict:
    """The nvpmodel power mode in force: its id from ``/var/lib/nvpmodel/status`` (``pmode:0002``) and its name from
    ``/etc/nvpmodel.conf`` (``< POWER_MODEL ID=2 NAME=MAXN_SUPER >``); on a live system without the status file,
    ``nvpmodel -q``. ``{"id": None, "name": None, "source": None}`` when neither says."""
    root = Path(root)
    status = _read(root / "var" / "lib" / "nvpmodel" / "status")
    m = re.search(r"pmode:\s*0*(\d+)", status or "")
    if m:
        mode_id = int(m.group(1))
        conf = _read(root / "etc" / "nvpmodel.conf") or ""
        name = re.search(rf"<\s*POWER_MODEL\s+ID={mode_id}\s+NAME=([A-Za-z0-9_]+)", conf)
        return {"id": mode_id, "name": name.group(1) if name else None, "source": "/var/lib/nvpmodel/status"}
    if root == Path("/") and shutil.which("nvpmodel"):
        try:
            out = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        name = re.search(r"NV Power Mode:\s*(\S+)", out)
        num = re.search(r"^\s*(\d+)\s*$", out, re.MULTILINE)
        if name or num:
            return {"id": int(num.group(1)) if num else None, "name": name.group(1) if name else None,
                    "source": "nvpmodel -q"}
    return {"id": None, "name": None, "source": None}


class JetsonMeter(Meter):
    available = True
    method = METHOD_JETSON

    def __init__(self, rails: list[Rail], root: str | os.PathLike = "/", period_s: float = JETSON_PERIOD_S):
        super().__init__(None)
        self.rail_list, self.root, self.period_s = rails, Path(root), period_s
        names = [r.name for r in rails]
        self.total_rail = next((n for n in INPUT_RAILS if n in names), None)
        self.scope = (f"module input rail {self.total_rail}" if self.total_rail else
                      f"sum of the measured rails ({', '.join(names)}; this board has no module-input rail, so "
                      "regulator losses and the carrier board are not included)")
        self.peak_method = (f"max of the INA3221 samples (every {period_s * 1e3:.0f} ms) inside the repeats, "
                            f"{self.total_rail or 'sum of rails'}")
        self.sampler = Sampler(self._power, period_s)

    def _power(self) -> tuple[float, dict]:
        rails = {r.name: r.watts() for r in self.rail_list}
        total = rails[self.total_rail] if self.total_rail else sum(rails.values())
        return total, rails

    def settings(self) -> dict:
        return {"nvpmodel": nvpmodel_mode(self.root), "jetson": jetson_release(self.root),
                "rails": {r.name: {"meaning": r.meaning, "sensor": r.sensor, "layout": r.layout}
                          for r in self.rail_list}}

    def begin(self):
        return time.perf_counter()

    def end(self, window, tokens: int | None = None, again=None) -> dict | None:
        # ``again`` is not needed: the rails are sampled every JETSON_PERIOD_S, so a window is integrated directly.
        if window is None:
            return None
        t0, t1 = window, time.perf_counter()
        if not self.sampler.wait_past(t1, timeout=max(1.0, 20 * self.period_s)):
            self._failed("the INA3221 sampling thread", self.sampler.error or TimeoutError("no sample after the "
                                                                                          "window"))
            return None
        got = self.sampler.integrate(t0, t1)
        if got is None:
            return None
        total, rails = got
        return {"energy_j": total, "duration_s": t1 - t0, "peak_w": self.sampler.peak(t0, t1), "rails_j": rails,
                "tokens": tokens, "reading": READING_WINDOW, "burst": None}

    def close(self) -> None:
        self.sampler.close()


def open_meter(device, root: str | os.PathLike | None = None) -> Meter:
    """The energy source for a run on ``device`` (torch.device or str): Jetson rails when the board has them (whatever
    the device: they measure the whole board), else NVML for a CUDA device, else a Meter that says why there is
    none. Never raises."""
    root = Path(root if root is not None else os.environ.get(SYSFS_ROOT_ENV, "/"))
    try:
        rails = find_rails(root)
    except OSError as e:
        rails, why = [], f"the INA3221 sysfs tree could not be listed ({e})"
    else:
        why = None
    if rails:
        try:
            for r in rails:
                r.watts()
        except (OSError, ValueError) as e:
            return Meter(f"the Jetson INA3221 rails are not readable ({type(e).__name__}: {e})")
        return JetsonMeter(rails, root)
    dev = str(device)
    if dev.startswith("cuda"):
        index = int(dev.split(":")[1]) if ":" in dev else 0
        return open_nvml_meter(index, _cuda_identity(index))
    return Meter(why or f"{dev.upper()} run off a Jetson: NVML measures NVIDIA GPUs only and there are no INA3221 "
                        "rails, so there is no energy reading")


# -- row fields ---------------------------------------------------------------------------------------------------------
def _spread(values: list[float]) -> dict | None:
    return summarize(values) if values else None


def _common(windows: list[dict | None], meter: Meter, settings: dict) -> dict:
    ok = [w for w in windows if w is not None]
    notes = meter.errors()
    if len(ok) < len(windows):
        notes.insert(0, f"{len(windows) - len(ok)} of {len(windows)} repeats have no energy reading")
    energy = sum(w["energy_j"] for w in ok)
    # A burst's J per prefill belongs to its prefills' time in the burst, not to the timed window's.
    secs = sum(w["burst"]["duration_s"] / w["burst"]["n"] if w.get("burst") else w["duration_s"] for w in ok)
    peaks = [w["peak_w"] for w in ok if w.get("peak_w") is not None]
    out = {
        "method": meter.method, "scope": meter.scope,
        "samples_j": [w["energy_j"] if w else None for w in windows],
        "durations_s": [w["duration_s"] if w else None for w in windows],
        "avg_power_w": energy / secs if secs > 0 and ok else None,
        "peak_power_w": max(peaks) if peaks else None, "peak_method": meter.peak_method,
        "settings": settings, "note": "; ".join(notes) or None,
    }
    if meter.interpolation:
        out["interpolation"] = meter.interpolation
        out["counter_period_s"] = meter.counter_period_s()
    bursts = [w.get("burst") if w else None for w in windows]
    if any(bursts):
        n_burst = sum(1 for b in bursts if b)
        out["reading"] = READING_BURST if n_burst == len(ok) else "burst and window (see readings)"
        out["readings"] = [w.get("reading") if w else None for w in windows]
        out["burst"] = {"how": BURST_HOW, "below_periods": BURST_BELOW_PERIODS, "span_periods": BURST_PERIODS,
                        **{k: [b[k] if b else None for b in bursts] for k in ("n", "duration_s", "power_w")}}
        ns = [b["n"] for b in bursts if b]
        secs_b = [b["duration_s"] for b in bursts if b]
        said = (f"J per prefill of {n_burst} of {len(windows)} repeats from a burst of "
                f"{min(ns) if min(ns) == max(ns) else f'{min(ns)}-{max(ns)}'} back-to-back prefills "
                f"({float(np.median(secs_b)):.2f} s) right after the timed one, whose window is shorter than "
                f"{BURST_BELOW_PERIODS:g} counter updates: burst power x burst length / n, not the timed prefill's "
                "own reading (TTFT samples are the timed prefills)")
        out["note"] = "; ".join([said, *([out["note"]] if out["note"] else [])])
    elif ok and ok[0].get("reading"):
        out["reading"] = READING_WINDOW
    if any(w.get("rails_j") for w in ok):
        names = list(next(w["rails_j"] for w in ok if w.get("rails_j")))
        out["rails"] = {n: {"meaning": RAIL_MEANING.get(n), "samples_j": [w["rails_j"][n] if w else None
                                                                          for w in windows]} for n in names}
    return out


def unavailable_fields(meter: Meter, decode: bool) -> dict:
    key = "joules_per_token" if decode else "energy_j"
    return {key: None, "energy": {"method": None, "note": meter.note}}


def ttft_energy_fields(windows: list[dict | None], meter: Meter, settings: dict) -> dict:
    """A TTFT row's energy: ``energy_j`` (median J per prefill over the repeats) and ``energy`` (per-repeat joules in
    repeat order, their spread, average and peak power, method, power limit / nvpmodel, per-rail joules)."""
    if not meter.available:
        return unavailable_fields(meter, decode=False)
    e = _common(windows, meter, settings)
    valid = [x for x in e["samples_j"] if x is not None]
    e["stats"] = _spread(valid)
    return {"energy_j": float(np.median(valid)) if valid else None, "energy": e}


def decode_energy_fields(windows: list[dict | None], meter: Meter, settings: dict) -> dict:
    """A decode row's energy: ``joules_per_token`` (median over runs of the run's joules / tokens decoded over all
    sequences, the first token excluded as in tok/s) and ``energy`` (as for TTFT, plus ``joules_per_token_samples``)."""
    if not meter.available:
        return unavailable_fields(meter, decode=True)
    e = _common(windows, meter, settings)
    jpt = [w["energy_j"] / w["tokens"] if w and w.get("tokens") else None for w in windows]
    e["joules_per_token_samples"] = jpt
    valid = [x for x in jpt if x is not None]
    e["stats"] = _spread(valid)
    return {"joules_per_token": float(np.median(valid)) if valid else None, "energy": e}


def paired_energy(row: dict) -> dict[str, list] | None:
    """The per-repeat energies of every implementation paired with this row (J per prefill, or J per token)."""
    p = row.get("paired") or {}
    return p.get("energy_j") or p.get("joules_per_token")


def energy_verdicts(row: dict, references: list[str], seed: int = 0) -> dict[str, dict]:
    """``{reference: interval}`` of this row's energy against each reference paired with it, from the one statistics
    module (``stats.paired_ratio_interval``: median(reference J) / median(this row's J), > 1 = this row used less
    energy). A pair with a repeat that has no reading (or read 0 J: a window shorter than the counter's update
    period) gets no interval."""
    samples = paired_energy(row)
    if not samples or row["impl"] not in samples:
        return {}
    mine = samples[row["impl"]]
    out = {}
    for ref in references:
        if ref == row["impl"] or ref not in samples:
            continue
        pair = (samples[ref], mine)
        if any(v is None or v <= 0 for s in pair for v in s) or len(pair[0]) != len(pair[1]):
            continue
        out[ref] = paired_ratio_interval(*pair, seed=seed)
    return out


def format_energy_interval(iv: dict) -> str:
    """``1.05x [1.02, 1.08] less energy`` / ``0.97x [0.95, 0.99] more energy`` / ``... no difference``: the interval
    as ``stats.format_ratio_interval`` writes it, its verdict in words about energy."""
    text = format_ratio_interval(iv, words=False)
    if iv["contains_one"]:
        return text + " no difference"
    return text + (" less energy" if iv["low"] > 1.0 else " more energy")
