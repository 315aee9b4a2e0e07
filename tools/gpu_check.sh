#!/usr/bin/env bash
# The GPU check, one command from the repository root of a CUDA machine (no internet
# needed): build shardadam with its CUDA backend, run the CUDA tests (pytest: the CUDA
# backend and FSDP2's CPU offload under a CUDA mesh; then the C++ CUDA tests, among
# them the per-block scaled moments' kernel against the CPU core and the fp8
# instructions against the integer rule, and the CPU core's adam_test, codec_test,
# measure_skip_test and block_test on the host's SIMD targets), the GPU benchmark, an
# Nsight Compute profile of the fp8, bf16 and block8 moments' kernels, then the CPU kernel
# benchmark on 1, 2, 4, 8 and 16 threads (a GPU host has more cores than the other
# machines here; the block presets at 56M elements too). Everything lands in $OUT
# (default build/gpu-check): summary.txt, pytest.xml, cuda_bench.json, kernel_bench.json
# and logs.tar.gz (env.txt and one log per stage), five files.
# Stays within GPU_CHECK_BUDGET_S seconds (default 560): each stage is cut short so
# the later ones keep their share. Exits 1 if any stage failed (a benchmark target
# that is missed is reported, not a failure).
#
# Highway, GoogleTest and pkg-config come from the machine where it has them, else
# from the Debian packages tools/gpu_check_prepare.sh unpacks into .deps/.
#
#   PYTHON                 interpreter with torch, nanobind, scikit-build-core, pytest
#                          (default python3)
#   SHARDADAM_CUDA_ARCHS   CMAKE_CUDA_ARCHITECTURES to build (default: the GPU's own,
#                          e.g. 90-real, which builds fastest)
#   GPU_CHECK_BUDGET_S     total seconds (560)
#   GPU_CHECK_FORCE_DEPS=1 use .deps/ even where the machine has its own copies
#   GPU_CHECK_QUICK=1      the GPU tests, the benchmark and the profile only (a rerun
#                          after a kernel change: about 4 minutes against about 5)
#   GPU_CHECK_SKIP="a b"   stages left out by name (e.g. "offload cpp profile": the
#                          build, test_cuda_backend.py and the benchmark, 2 minutes)
#   GPU_CHECK_NO_GPU_OK=1  carry on without a GPU (tries the script itself: the GPU
#                          tests then skip and the benchmark fails)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/build/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-560}
QUICK=${GPU_CHECK_QUICK:-0}
START=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/shardadam-gpu-check.XXXXXX")  # build tree, install
SITE=$WORK/site
BUILD_DIR=$WORK/build
SUMMARY=()
FAILED=0

record() {
  SUMMARY+=("$(printf '%-10s %s' "$1" "$2")")
}

# stage NAME CAP RESERVE SHOW -- COMMAND...: runs COMMAND with a time limit of CAP
# seconds, or less so that RESERVE seconds of the budget stay for later stages; logs
# to $OUT/NAME.log and prints its last SHOW lines (40 on failure).
stage() {
  local name=$1 cap=$2 reserve=$3 show=$4
  shift 5
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    record "$name" "left out (GPU_CHECK_SKIP)"
    return 0
  fi
  local limit=$((BUDGET - (SECONDS - START) - reserve))
  ((limit > cap)) && limit=$cap
  if ((limit < 10)); then
    record "$name" "SKIPPED: out of time"
    FAILED=1
    return 1
  fi
  echo "== $name (limit ${limit}s)"
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$? took=$((SECONDS - began))
  if ((rc == 0)); then
    record "$name" "ok (${took}s)"
    ((show > 0)) && tail -n "$show" "$OUT/$name.log"
    return 0
  fi
  if ((rc == 124 || rc == 137)); then
    record "$name" "TIMED OUT after ${took}s (see $name.log)"
  else
    record "$name" "FAILED, exit status $rc after ${took}s (see $name.log)"
  fi
  FAILED=1
  echo "---- last lines of $name.log"
  tail -n 40 "$OUT/$name.log"
  return 1
}

finish() {
  {
    echo "== summary ($((SECONDS - START))s of ${BUDGET}s)"
    printf '%s\n' "${SUMMARY[@]}"
  } | tee "$OUT/summary.txt"
  # The device tool brings back at most 8 files: the logs travel as one.
  (cd "$OUT" && tar czf logs.tar.gz --remove-files -- *.log env.txt 2>/dev/null)
  rm -rf "$WORK"
  exit "$FAILED"
}

# ---------------------------------------------------------------------------- machine
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  host: $(uname -srm)"
  grep -m1 PRETTY_NAME /etc/os-release 2>/dev/null
  # The CPU behind the thread sweep's figures, and how many cores it has.
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
  nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv,noheader \
    2>&1 || echo "nvidia-smi: not available"
  echo "nvcc: $(nvcc --version 2>&1 | grep -m1 release || echo missing)"
  echo "cmake: $(cmake --version 2>&1 | head -n1)  ninja: $(ninja --version 2>&1)"
  echo "c++: $(c++ --version 2>&1 | head -n1)"
  "$PYTHON" - <<'EOF'
import os, sys, sysconfig
print("python:", sys.version.split()[0], sys.executable)
include = sysconfig.get_paths()["include"]
print("Python.h:", "found" if os.path.exists(os.path.join(include, "Python.h")) else "MISSING",
      "in", include)
for name in ("torch", "nanobind", "scikit_build_core", "pytest", "hypothesis", "numpy"):
    try:
        module = __import__(name)
        print(f"{name}: {getattr(module, '__version__', '?')}")
    except Exception as error:
        print(f"{name}: MISSING ({error})")
import torch
print("torch cuda:", torch.version.cuda, "available:", torch.cuda.is_available(),
      "devices:", torch.cuda.device_count())
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---------------------------------------------------------------------------- deps
# Unpacked Debian packages (tools/gpu_check_prepare.sh); the .pc files name /usr as
# their prefix, so copies pointing into .deps are made for pkg-config.
DEPS=$ROOT/.deps/root
case "$(uname -m)" in
  x86_64) MULTIARCH=x86_64-linux-gnu DEB_ARCH=amd64 ;;
  aarch64) MULTIARCH=aarch64-linux-gnu DEB_ARCH=arm64 ;;
  *) MULTIARCH=unknown DEB_ARCH=unknown ;;
esac
DEPS_LIB=$DEPS/usr/lib/$MULTIARCH
have_deps() {
  [[ -d $DEPS ]] && [[ $(cat "$ROOT/.deps/ARCH" 2>/dev/null) == "$DEB_ARCH" ]]
}
if [[ -d $DEPS ]] && ! have_deps; then
  echo "note: .deps/ holds $(cat "$ROOT/.deps/ARCH" 2>/dev/null) packages, this machine is $DEB_ARCH: not used"
fi
FORCE=${GPU_CHECK_FORCE_DEPS:-0}

PKG_CONFIG_BIN=$(command -v pkg-config || command -v pkgconf || true)
if { [[ -z $PKG_CONFIG_BIN ]] || [[ $FORCE == 1 ]]; } && have_deps; then
  PKG_CONFIG_BIN=$DEPS/usr/bin/pkgconf
  export LD_LIBRARY_PATH=$DEPS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if [[ -z $PKG_CONFIG_BIN ]]; then
  record deps "FAILED: no pkg-config; run tools/gpu_check_prepare.sh and pass .deps"
  FAILED=1
  finish
fi
export PKG_CONFIG=$PKG_CONFIG_BIN  # CMake's FindPkgConfig reads it

if [[ $FORCE == 1 ]] || ! "$PKG_CONFIG_BIN" --exists libhwy 2>/dev/null; then
  if ! have_deps || [[ ! -f $DEPS_LIB/pkgconfig/libhwy.pc ]]; then
    record deps "FAILED: no Highway (libhwy); run tools/gpu_check_prepare.sh and pass .deps"
    FAILED=1
    finish
  fi
  mkdir -p "$WORK/pkgconfig"
  for pc in "$DEPS_LIB"/pkgconfig/*.pc; do
    sed "s|^prefix=.*|prefix=$DEPS/usr|" "$pc" >"$WORK/pkgconfig/$(basename "$pc")"
  done
  export PKG_CONFIG_PATH=$WORK/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$DEPS_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  HWY_FROM=".deps"
else
  HWY_FROM="the machine"
fi
system_gtest() {
  [[ -f /usr/include/gtest/gtest.h || -f /usr/local/include/gtest/gtest.h ]]
}
GTEST_DIR=""
if [[ $FORCE == 1 ]] || ! system_gtest; then
  if have_deps && [[ -f $DEPS_LIB/cmake/GTest/GTestConfig.cmake ]]; then
    GTEST_DIR=$DEPS_LIB/cmake/GTest
  fi
fi
GTEST_FROM="the machine (if it has it)"
[[ -n $GTEST_DIR ]] && GTEST_FROM=".deps"
record deps "ok: Highway $("$PKG_CONFIG_BIN" --modversion libhwy) from $HWY_FROM, GoogleTest from $GTEST_FROM"

# ---------------------------------------------------------------------------- build
ARCHS=${SHARDADAM_CUDA_ARCHS:-}
if [[ -z $ARCHS ]]; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
  [[ -n $cap ]] && ARCHS="${cap}-real"
fi
# Highway shared (the machine's or .deps' libhwy): a static one would be downloaded.
CONFIG=(--config-settings=build-dir="$BUILD_DIR"
        --config-settings=cmake.define.SHARDADAM_HWY=shared
        --config-settings=cmake.define.SHARDADAM_ENABLE_CUDA=ON
        --config-settings=cmake.define.PKG_CONFIG_EXECUTABLE="$PKG_CONFIG_BIN")
[[ -n $ARCHS ]] && CONFIG+=(--config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS")
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "building for CUDA architectures: ${ARCHS:-the project default}"
if ! stage build 300 150 0 -- "$PYTHON" -m pip install --no-build-isolation --no-deps \
    --no-index --target "$SITE" -v "${CONFIG[@]}" "$ROOT"; then
  finish
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

# The fresh build must be the one imported, with the CUDA backend, seeing the GPU:
# else every GPU test would skip and the benchmark would time the torch fallback.
export SITE
stage import 60 140 8 -- "$PYTHON" -c '
import os, shardadam, shardadam._C as C
from shardadam.__main__ import main
print("shardadam from", shardadam.__file__)
main(["info"])
assert shardadam.__file__.startswith(os.environ["SITE"]), \
    "another installed shardadam shadows the fresh build"
info = C.info()
assert info["cuda"], "the extension was built without CUDA"
if info["cuda_devices"] == 0:
    assert os.environ.get("GPU_CHECK_NO_GPU_OK") == "1", "the extension sees no CUDA device"
    print("no CUDA device: carrying on (GPU_CHECK_NO_GPU_OK=1); GPU tests will skip")
' || finish

# ---------------------------------------------------------------------------- tests
stage pytest 220 250 6 -- "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" tests/python/test_cuda_backend.py \
  tests/python/test_memory_order.py
# FSDP2's CPU offload under a CUDA mesh (its CPU-mesh cases run in CI), apart: ranks
# that hang on a collective must not cost the results above.
stage offload 90 230 6 -- "$PYTHON" -m pytest -q -rs -p no:cacheprovider \
  --junitxml="$WORK/offload.xml" -k "under_a_cuda_mesh" tests/python/test_cpu_offload.py
# The tests open issues name, by name: a skip counts as a pass above.
if [[ -f $OUT/pytest.xml ]]; then
  record named "$("$PYTHON" - "$OUT/pytest.xml" "$WORK/offload.xml" <<'EOF'
import collections, os, sys, xml.etree.ElementTree as ET
cases = [case for path in sys.argv[1:] if os.path.exists(path)
         for case in ET.parse(path).getroot().iter("testcase")]
for pattern in ("lr_in_a_cuda_tensor", "cpu_offload_under_a_cuda_mesh"):
    outcomes = collections.Counter(next((child.tag for child in case), "passed")
                                   for case in cases if pattern in case.get("name", ""))
    print(f"test_*{pattern}*: {dict(outcomes) or 'NONE ran'}", end="; ")
EOF
)"
fi

# C++ tests of the CUDA backend: tests/cpp/*cuda*_test.* and tests/cpp/cuda/*_test.*,
# one executable each, run directly (their GoogleTest names need not say "cuda"); and
# the CPU core's own suites, which run every SIMD target the host supports: a GPU
# host's CPU often has AVX-512, whose kernels no other machine here executes.
# The CUDA ones first; every one runs, whatever an earlier one did.
shopt -s nullglob
CPP_TESTS=()
for source in tests/cpp/*cuda*_test.cc tests/cpp/*cuda*_test.cu tests/cpp/cuda/*_test.cc \
    tests/cpp/cuda/*_test.cu; do
  name=$(basename "$source")
  CPP_TESTS+=("${name%.*}")
done
[[ $QUICK == 1 ]] || CPP_TESTS+=(adam_test codec_test measure_skip_test block_test)
# Reuses the wheel's build tree (the core is built already), adding the tests and
# kernel_bench; the tests an open issue names are shown last, by name.
# shellcheck disable=SC2016  # expanded by the inner shell
stage cpp 150 180 15 -- bash -c '
  set -eo pipefail
  cmake -S "$1" -B "$2" -DSHARDADAM_BUILD_TESTS=ON -DSHARDADAM_BUILD_BENCHMARKS=ON \
    ${3:+-DGTest_DIR=$3}
  cmake --build "$2" --target kernel_bench "${@:4}"
  rc=0
  for target in "${@:4}"; do
    binary=$(find "$2" -type f -name "$target" -perm -u+x | head -n1)
    echo "== $target ($binary)"
    "$binary" --gtest_brief=1 || rc=1
  done
  for named in "adam_cuda_test *LrInDeviceMemory*" "fp8_instructions_test *"; do
    binary=$(find "$2" -type f -name "${named%% *}" -perm -u+x | head -n1)
    "$binary" --gtest_filter="${named#* }" | grep -E "^\[ +(OK|FAILED|SKIPPED) +\]" || rc=1
  done
  exit $rc
' cpp "$ROOT" "$BUILD_DIR" "$GTEST_DIR" "${CPP_TESTS[@]}"

# ---------------------------------------------------------------------------- bench
stage bench 200 60 45 -- "$PYTHON" benchmarks/cuda_bench.py --json "$OUT/cuda_bench.json"

# Where per-tensor fp8 moments and block8 moments spend their time, beside bf16
# moments: Nsight Compute's speed of light, compute, instruction and warp-stall
# sections for the second step's kernels (64M elements), in profile.log.
if command -v ncu >/dev/null; then
  stage profile 90 20 0 -- ncu --clock-control none --kernel-name-base function \
    --kernel-name regex:"MeasureKernel|StoreKernel|BlockKernel" --launch-skip 4 --launch-count 4 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis "$PYTHON" -c '
import torch
from shardadam import FusedAdam
optimizers = []
# fp8: two kernels a step; bf16 and block8 (beside remainders): one each.
for moments in (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
                dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
                dict(moment_format="block8", store_param_remainders=True)):
    p = torch.nn.Parameter(torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    optimizers.append(FusedAdam([p], lr=1e-3, master_weights=True, **moments))
for _ in range(2):
    for opt in optimizers:
        opt.step()
torch.cuda.synchronize()
'
else
  record profile "SKIPPED: no ncu on this machine"
fi

[[ $QUICK == 1 ]] && finish
# The CPU core on this host's cores: every bf16-gradient preset of kernel_bench
# (bf16 params with a master, remainders or none; bf16, fp8, block8 and block4
# moments), 7M elements at 1 to 16 threads, the block presets at 56M on 16
# threads (less of each thread's time in starting) and on one thread in cache (their
# ceiling where instructions bind: 16 times that rate); each table in cpu_tables.log,
# the per-block rows in the output, the JSONs merged into one file.
# shellcheck disable=SC2016  # expanded by the inner shell
stage cpu_threads 120 0 30 -- bash -c '
  set -eo pipefail
  binary=$(find "$1" -type f -name kernel_bench -perm -u+x | head -n1)
  run() {  # NAME NUMEL THREADS PRESET [REPS]
    "$binary" --numel "$2" --reps "${5:-7}" --threads "$3" --preset "$4" \
      --json "$WORK_DIR/kb$1.json" \
      | tee -a "$LOG" | grep -E -- "-block" | sed "s/^/$1 /"
  }
  WORK_DIR=$2 LOG=$5
  for threads in 1 2 4 8 16; do run "t$threads" 7000000 "$threads" "g=bf16"; done
  run t16-56M 56000000 16 "-block"
  # One thread in cache: times 16, the block kernels ceiling on this host (the bench
  # lowbit cases kernel_bench-ceiling), to set against the 16-thread probe.
  run t1-cache 262144 1 "-block" 100
  "$3" - "$2" "$4" <<"PY"
import json, sys
names = [f"t{t}" for t in (1, 2, 4, 8, 16)] + ["t16-56M", "t1-cache"]
runs = {n: json.load(open(f"{sys.argv[1]}/kb{n}.json")) for n in names}
json.dump(runs, open(sys.argv[2], "w"), indent=1)
PY
' cpu_threads "$BUILD_DIR" "$WORK" "$PYTHON" "$OUT/kernel_bench.json" "$OUT/cpu_tables.log"
finish
