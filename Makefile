# The two commands a user needs (README): `make bench` and `make test`. Each sets up
# what is missing first: system packages, a virtualenv with the pinned Python packages
# (requirements.txt), and the CMake build (core, executors, operator library, tests).
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
BUILD  := build
JOBS   ?= 2
BENCH_ARGS ?=

.PHONY: setup build test test-cpp test-python bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt scripts/system-deps.sh
	bash scripts/system-deps.sh
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements.txt
	touch $@

build: setup
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(abspath $(VPY))
	cmake --build $(BUILD) -j $(JOBS)

test-cpp: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

test-python: build
	GEMMFUSE_REQUIRE_LIB=1 PYTHONPATH=python $(VPY) -m pytest tests/python -q

test: test-cpp test-python

bench: build
	PYTHONPATH=python $(VPY) -m gemmfuse bench $(BENCH_ARGS)

clean:
	rm -rf $(BUILD)
