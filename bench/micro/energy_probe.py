"""Energy per call under sustained load: m99 as eager bf16, gemmfuse bf16 and the bare cuBLAS
bf16 GEMM (F.linear alone), plus eager fp32 and gemmfuse `fast`, each run back to back for a
few seconds.

At the H100's power cap a tensor-core kernel's time is set by its energy: the chip lowers its
clock until the draw fits. So under sustained load, the ratio of two variants' times tends to
the ratio of their energies per call, and the energy per call says whether a kernel spends
more than cuBLAS's GEMM on the same flops (docs/measurements.md). Energy comes from
NVML's total-energy counter (mJ) read through ctypes at the ends of each window; SM clock,
power and temperature are sampled every 20 ms in a thread.
    python3 -m bench.micro.energy_probe [--seconds 3] [--warmup-s 1.5] [--out F]
"""
import argparse
import ctypes
import json
import statistics
import threading
import time

import torch
import torch.nn.functional as F

import gemmfuse
from bench.models import M99

B, K, N = 1024, 8192, 8192


class Nvml:
    """The few NVML calls this probe needs, on device 0, through the driver's library."""

    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        assert self.lib.nvmlInit_v2() == 0
        self.dev = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.dev)) == 0

    def _u(self, fn, *args, kind=ctypes.c_uint):
        v = kind()
        rc = fn(self.dev, *args, ctypes.byref(v))
        return v.value if rc == 0 else float("nan")

    def energy_mj(self):
        return self._u(self.lib.nvmlDeviceGetTotalEnergyConsumption, kind=ctypes.c_ulonglong)

    def sm_mhz(self):
        return self._u(self.lib.nvmlDeviceGetClockInfo, 1)  # NVML_CLOCK_SM

    def power_w(self):
        return self._u(self.lib.nvmlDeviceGetPowerUsage) / 1e3

    def temp_c(self):
        return self._u(self.lib.nvmlDeviceGetTemperature, 0)  # NVML_TEMPERATURE_GPU


class Sampler(threading.Thread):
    def __init__(self, nvml):
        super().__init__(daemon=True)
        self.nvml, self.rows, self.stop = nvml, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.rows.append((self.nvml.sm_mhz(), self.nvml.power_w(), self.nvml.temp_c()))
            time.sleep(0.02)


def window(fn, xs, seconds, nvml):
    """Calls fn over rotated inputs for `seconds`, the queue kept a few calls deep."""
    torch.cuda.synchronize()
    sampler = Sampler(nvml)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0 = nvml.energy_mj()
    sampler.start()
    start.record()
    calls, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(8):
            fn(xs[calls % len(xs)])
            calls += 1
        end.record()
        end.synchronize()  # at most 8 calls queued: the window ends when the GPU's work does
    gpu_ms = start.elapsed_time(end)
    e1 = nvml.energy_mj()
    sampler.stop.set()
    sampler.join()
    clocks = [r[0] for r in sampler.rows]
    power = [r[1] for r in sampler.rows]
    return {"calls": calls, "ms_per_call": gpu_ms / calls, "mj_per_call": (e1 - e0) / calls,
            "avg_w": (e1 - e0) / gpu_ms, "sm_mhz_median": statistics.median(clocks),
            "power_w_median": statistics.median(power), "temp_c_end": sampler.rows[-1][2]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--warmup-s", type=float, default=1.5)
    ap.add_argument("--passes", type=int, default=2, help="passes over the variants, order reversed each")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    nvml = Nvml()
    torch.manual_seed(0)
    m32 = M99(K, N).to(dev)
    m16 = M99(K, N).to(dev)
    m16.load_state_dict(m32.state_dict())
    m16 = m16.to(torch.bfloat16)
    x32 = [torch.rand(B, K, device=dev) for _ in range(4)]
    x16 = [x.to(torch.bfloat16) for x in x32]
    fast = gemmfuse.optimize(m32, (x32[0],), precision="fast")
    fused16 = gemmfuse.optimize(m16, (x16[0],))
    w16, b16 = m16.linear.weight, m16.linear.bias
    variants = {
        "eager-bf16": (m16, x16),
        "gemmfuse-bf16": (fused16, x16),
        "cublas-linear-bf16": (lambda x: F.linear(x, w16, b16), x16),
        "eager-fp32": (m32, x32),
        "gemmfuse-fast": (fast, x32),
    }
    rows = []
    with torch.no_grad():
        for p in range(args.passes):
            order = list(variants) if p % 2 == 0 else list(reversed(variants))
            for name in order:
                fn, xs = variants[name]
                window(fn, xs, args.warmup_s, nvml)
                r = {"pass": p, "variant": name, **window(fn, xs, args.seconds, nvml)}
                rows.append(r)
                print(f"pass {p} {name:>19}: {r['ms_per_call'] * 1e3:8.1f} us/call "
                      f"{r['mj_per_call']:7.2f} mJ/call {r['avg_w']:6.1f} W "
                      f"SM {r['sm_mhz_median']:6.0f} MHz {r['temp_c_end']:3.0f} C "
                      f"({r['calls']} calls)", flush=True)
    print("\nper variant, median over passes:")
    for name in variants:
        rs = [r for r in rows if r["variant"] == name]
        print(f"{name:>19}: {statistics.median(r['ms_per_call'] for r in rs) * 1e3:8.1f} us/call "
              f"{statistics.median(r['mj_per_call'] for r in rs):7.2f} mJ/call")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "seconds": args.seconds,
                       "warmup_s": args.warmup_s, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
