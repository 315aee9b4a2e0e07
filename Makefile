# The README's commands. Each target sets itself up on a fresh machine.
#   make demo    run the main job
#   make test    C++ tests (ctest) + Python tests (pytest)
#   make setup   system packages, .venv with pinned deps, editable package, C++ tests
#   make bench   side-by-side benchmark (docs/benchmarking.md): table,
#                build/bench/bench.{json,png}
VENV ?= .venv
PY := $(VENV)/bin/python
CPP_BUILD := build/cpp
CORE_SOURCES := $(shell find csrc bindings cmake -type f) CMakeLists.txt pyproject.toml
TEST_SOURCES := $(shell find tests/cpp benchmarks -type f 2>/dev/null)
# The CUDA architectures of these builds (the extension in the venv, the C++
# tests): the GPU's own where there is one; with none, PTX for compute
# capability 8.0 only, which compiles the kernels (checked, not run: their
# tests need a GPU) in about a quarter of the time of the shipped set, and still
# runs on any GPU from 8.0 on (its driver compiles it at first use). A wheel or
# a plain `cmake` build gets the shipped set (CMakeLists.txt); so does
# `make test CUDA_ARCHS="80-real;90-real;90-virtual"`.
CUDA_ARCHS ?= $(shell cap=$$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader \
	2>/dev/null | head -n1 | tr -d ' .' | grep -xE '[0-9]+'); \
	if [ -n "$$cap" ]; then echo $$cap-real; else echo 80-virtual; fi)
# Both builds are redone when the value changes: it is recorded here.
CUDA_ARCHS_RECORD := build/.cuda-archs
$(shell mkdir -p build && { [ "$$(cat $(CUDA_ARCHS_RECORD) 2>/dev/null)" = '$(CUDA_ARCHS)' ] \
	|| echo '$(CUDA_ARCHS)' > $(CUDA_ARCHS_RECORD); })

.PHONY: setup system-deps demo test test-cpp test-python kernel-bench bench clean

setup: $(VENV)/.package-stamp $(CPP_BUILD)/.build-stamp

# Debian packages: Highway, GoogleTest, the toolchain, and Python's venv and headers
# (the binding builds against them). Installed only when something is missing.
DEBIAN_PACKAGES := g++ cmake make pkg-config libhwy-dev libgtest-dev python3-venv python3-dev
system-deps:
	@if ! pkg-config --exists libhwy || [ ! -f /usr/include/gtest/gtest.h ] \
	    || ! command -v cmake >/dev/null || ! command -v g++ >/dev/null \
	    || ! python3 -c 'import ensurepip, sysconfig, os, sys; \
	         sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
	         2>/dev/null; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "missing Debian packages; as root: apt-get install $(DEBIAN_PACKAGES)" >&2; \
	    exit 1; \
	  fi; \
	  echo "installing Debian packages: $(DEBIAN_PACKAGES)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    $(DEBIAN_PACKAGES) >/dev/null; \
	fi

# A venv whose interpreter or pip is gone (base Python upgraded, creation
# interrupted) is rebuilt rather than left failing.
$(VENV)/.deps-stamp: requirements-dev.txt requirements-megatron-core.txt | system-deps
	$(PY) -m pip --version >/dev/null 2>&1 || python3 -m venv --clear $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/megatron-core \
	    -r requirements-megatron-core.txt
	touch $@

# Kept in the venv: each venv holds its own build of the extension. It links
# Debian's shared libhwy (system-deps installs it): nothing to download or build
# beyond our own code. A wheel links Highway statically (README, Install).
$(VENV)/.package-stamp: $(VENV)/.deps-stamp $(CORE_SOURCES) $(CUDA_ARCHS_RECORD)
	$(PY) -m pip install -q --no-build-isolation -C cmake.define.SHARDADAM_HWY=shared \
	    $(if $(CUDA_ARCHS),-C cmake.define.CMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)") -e .
	touch $@

CPP_CONFIGURE = cmake -S . -B $(CPP_BUILD) -DSHARDADAM_BUILD_TESTS=ON \
	-DSHARDADAM_BUILD_BENCHMARKS=ON \
	$(if $(CUDA_ARCHS),-DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)") >/dev/null

# MAKEFLAGS cleared: a Makefiles-generated tree's own make takes none of ours.
$(CPP_BUILD)/.build-stamp: $(CORE_SOURCES) $(TEST_SOURCES) $(CUDA_ARCHS_RECORD) | system-deps
	$(CPP_CONFIGURE)
	MAKEFLAGS= $(CPP_NICE) cmake --build $(CPP_BUILD) -j2
	touch $@

# kernel_bench alone, in the same tree: the bench's Python tests time it where it is
# built and skip that part where not, so CI builds it before `make test` (whose C++
# build would otherwise still be running when they start).
kernel-bench: | system-deps
	$(CPP_CONFIGURE)
	MAKEFLAGS= cmake --build $(CPP_BUILD) -j2 --target kernel_bench

demo: $(VENV)/.package-stamp
	$(PY) -m shardadam demo

# The C++ and the Python side by side: pytest keeps about one core busy (its
# ranks and the bench's timed steps wait on one another), ctest and the builds
# take the rest, at a lower priority (CPP_NICE): the Python side is the longer.
# Each one's output is printed together when it ends.
CPP_NICE := nice -n 10
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target test-cpp test-python

test-cpp: $(CPP_BUILD)/.build-stamp
	$(CPP_NICE) ctest --test-dir $(CPP_BUILD) --output-on-failure -j2 --timeout 900

test-python: $(VENV)/.package-stamp
	SHARDADAM_REQUIRE_CORE=1 $(PY) -m pytest -q

# Full side-by-side run (3-4 minutes; add BENCH_FLAGS=--quick for about 2).
bench: setup $(VENV)/.deepspeed-stamp
	mkdir -p build/bench
	$(PY) -m pip install -q -r requirements-bench.txt
	$(PY) -m shardadam bench $(BENCH_FLAGS) --json build/bench/bench.json --png build/bench/bench.png

# DeepSpeed's CPU Adam, built when it installs (about 2 minutes; its build needs wheel
# and py-cpuinfo first), tried once per venv (the stamp records a failure too: delete
# it to try again). Where it cannot build, the bench says why.
DEEPSPEED := deepspeed==0.19.8
$(VENV)/.deepspeed-stamp: | $(VENV)/.package-stamp
	$(PY) -m pip install -q wheel py-cpuinfo
	if DS_BUILD_CPU_ADAM=1 $(PY) -m pip install -q --no-build-isolation $(DEEPSPEED); then \
	  echo built > $@; \
	else \
	  echo "$(DEEPSPEED) did not build here: the bench reports it unavailable" | tee $@; \
	fi

clean:
	rm -rf build $(VENV)
