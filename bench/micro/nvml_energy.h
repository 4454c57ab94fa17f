// The GPU's energy counter for the micro-benchmarks: NVML's total energy since the driver
// loaded (mJ) and the SM clock, on device 0, through the driver's own libnvidia-ml (opened at
// run time, so the probes build without NVML and still run where it is missing).
#pragma once

#include <dlfcn.h>

#include <cmath>

class NvmlEnergy {
 public:
  NvmlEnergy() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib_) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    auto handle = reinterpret_cast<int (*)(unsigned, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByIndex_v2"));
    energy_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(
        dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(lib_, "nvmlDeviceGetClockInfo"));
    if (!init || !handle || !energy_ || !clock_ || init() != 0 || handle(0, &dev_) != 0) energy_ = nullptr;
  }
  bool ok() const { return energy_ != nullptr; }
  double energy_mj() const {
    unsigned long long v = 0;
    return ok() && energy_(dev_, &v) == 0 ? double(v) : NAN;
  }
  double sm_mhz() const {
    unsigned v = 0;
    return ok() && clock_(dev_, 1 /* NVML_CLOCK_SM */, &v) == 0 ? double(v) : NAN;
  }

 private:
  void* lib_ = nullptr;
  void* dev_ = nullptr;
  int (*energy_)(void*, unsigned long long*) = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
};
