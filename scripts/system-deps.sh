#!/usr/bin/env bash
# System packages the build needs: a C++17 compiler, CMake, Ninja, GoogleTest, Python venv.
# nvcc (the CUDA toolkit) is optional: without it only the CPU executor is built.
set -euo pipefail
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
[ -e /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
echo "gemmfuse: installing system packages: ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "gemmfuse: not root; install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
