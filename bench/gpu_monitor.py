"""The GPU's SM clock, power and temperature while the bench times, sampled by `nvidia-smi`.

Under sustained tensor-core load an H100 lowers its clock as it warms (its 700 W power cap),
so one kernel's time differs by several percent between a cool and a warm chip
(docs/measurements.md). Each record then says at what clock and power it was measured.

`nvidia-smi --query-gpu ... -lms P` prints one sample every P ms with its own wall-clock
timestamp; a reader thread keeps them, and `window(t0, t1)` returns the samples between two
`time.time()` readings. Without nvidia-smi (or with an older one lacking a field) it records
what it can, or nothing; the bench runs the same either way.
"""
from __future__ import annotations

import functools
import operator
import shutil
import statistics
import subprocess
import threading
from datetime import datetime

# NVML's clock event reasons (nvidia-smi's clocks_event_reasons.active bitmask).
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap",
           0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
           0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake", 0x100: "display_clock"}

# Field sets, preferred first: newer drivers have the instantaneous power and the new name of
# the reasons field.
FIELD_SETS = (
    ("timestamp", "clocks.sm", "power.draw.instant", "temperature.gpu", "clocks_event_reasons.active"),
    ("timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"),
    ("timestamp", "clocks.sm", "power.draw", "temperature.gpu"),
)


def decode_reasons(mask):
    return [name for bit, name in REASONS.items() if mask & bit]


def _number(s):
    try:
        return float(s)
    except ValueError:
        return None


def parse_sample(line):
    """(wall time, sm MHz, W, °C, reasons mask or None) from one csv,noheader,nounits line."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4:
        return None
    try:
        t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None
    mask = None
    if len(parts) > 4:
        try:
            mask = int(parts[4], 16)
        except ValueError:
            pass
    return (t, _number(parts[1]), _number(parts[2]), _number(parts[3]), mask)


class GpuMonitor:
    """Samples one GPU (`uuid`, as nvidia-smi names it: "GPU-...") every `period_ms`."""

    def __init__(self, uuid, period_ms=10, exe=None):
        self.uuid, self.period_ms = uuid, period_ms
        self.exe = shutil.which("nvidia-smi") if exe is None else exe
        self.samples, self.fields, self.why_not = [], None, None
        self._proc, self._thread, self._lock = None, None, threading.Lock()

    @classmethod
    def for_device(cls, dev, **kw):
        """The monitor of torch device `dev` (matched by UUID, so CUDA_VISIBLE_DEVICES's
        renumbering does not matter); one that records nothing if the UUID is unknown."""
        import torch
        try:
            return cls("GPU-" + str(torch.cuda.get_device_properties(dev).uuid), **kw)
        except (AttributeError, RuntimeError) as e:
            m = cls("", exe="", **kw)
            m.why_not = f"no device UUID: {e}"
            return m

    def _query(self, fields, loop):
        return [self.exe, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits",
                "--id=" + self.uuid] + (["-lms", str(self.period_ms)] if loop else [])

    def start(self):
        if not self.exe:
            self.why_not = self.why_not or "nvidia-smi not found"
            return self
        for fields in FIELD_SETS:  # the first set this nvidia-smi answers
            try:
                r = subprocess.run(self._query(fields, False), capture_output=True, text=True,
                                   timeout=10)
            except (OSError, subprocess.SubprocessError) as e:
                self.why_not = f"nvidia-smi failed: {e}"
                return self
            first = (r.stdout.strip().splitlines() or [""])[0]
            if r.returncode == 0 and parse_sample(first):
                self.fields = fields
                break
        else:
            self.why_not = "nvidia-smi answered none of the field sets"
            return self
        stdbuf = shutil.which("stdbuf")  # line-buffered output through the pipe
        cmd = ([stdbuf, "-oL"] if stdbuf else []) + self._query(self.fields, True)
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            s = parse_sample(line)
            if s is not None:
                with self._lock:
                    self.samples.append(s)

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._thread.join(timeout=5)
            self._proc = None
        return self

    def window(self, t0, t1):
        """Samples stamped in [t0, t1] (time.time()), widened by half a period each side so
        that a window shorter than the period still meets its nearest sample."""
        pad = 0.5e-3 * self.period_ms
        with self._lock:
            return [s for s in self.samples if t0 - pad <= s[0] <= t1 + pad]


def summarize(windows):
    """Per-record GPU state from its rounds' sample lists: medians over all samples, the SM
    clock per round, and every clock event reason seen. None when no sample fell in."""
    every = [s for w in windows for s in w]
    if not every:
        return None

    def med(i, samples):
        v = [s[i] for s in samples if s[i] is not None]
        return statistics.median(v) if v else None

    masks = [s[4] for s in every if s[4] is not None]
    out = {"sm_mhz": med(1, every), "power_w": med(2, every), "temp_c": med(3, every),
           "sm_mhz_rounds": [med(1, w) for w in windows], "samples": len(every)}
    if masks:
        out["clock_event_reasons"] = decode_reasons(functools.reduce(operator.or_, masks))
    return out
