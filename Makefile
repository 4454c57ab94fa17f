# The two commands a user needs (README): `make bench` and `make test`. Each sets up what is
# missing first: system packages, a virtualenv with the pinned Python packages
# (pyproject.toml), and gemmfuse installed into it with `pip install -e .`, whose CMake build
# (in build/) also builds the GoogleTest suites.
PYTHON ?= python3
VENV   := .venv
VPY    := $(abspath $(VENV)/bin/python)
BUILD  := build
JOBS   ?= 2
BENCH_ARGS ?=

.PHONY: setup build test test-cpp test-python test-sizes emu-test bench wheel clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/system-deps.sh scripts/pins.py
	bash scripts/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $$($(PYTHON) scripts/pins.py build test bench)
	touch $@

# An editable install: the Python sources stay here, the operator library goes into the
# virtualenv; CMake rebuilds only what changed.
build: setup
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VPY) -m pip install -q --no-build-isolation --no-deps \
	  -Cbuild-dir=$(BUILD) -Ccmake.define.GEMMFUSE_TESTS=ON -e .

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

# From tests/, so that `gemmfuse` is the installed package, not a folder beside the tests.
test-python: build
	cd tests && GEMMFUSE_REQUIRE_LIB=1 $(VPY) -m pytest python -q

# A report, not a gate: the product's functions over 80 lines or cyclomatic complexity 20.
test-sizes: setup
	$(VPY) tools/function_sizes.py

test: test-cpp test-python test-sizes

# The attention kernels' and dW's transposed split's GoogleTests on the CPU through a host
# emulator (tools/kernel_emu/): a developer's check before a GPU call, not part of `make test`.
emu-test:
	tools/kernel_emu/run_gtests.sh

bench: build
	$(VPY) -m bench $(BENCH_ARGS)

# A wheel of this checkout in dist/ (py3-none-linux_x86_64), built against the pinned torch
# (in the same build folder as `make build`: only what changed is compiled).
wheel: setup
	rm -f dist/gemmfuse-*.whl
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VPY) -m pip wheel -q --no-build-isolation --no-deps \
	  -Cbuild-dir=$(BUILD) -Ccmake.define.GEMMFUSE_TESTS=ON -w dist .

clean:
	rm -rf $(BUILD) dist
