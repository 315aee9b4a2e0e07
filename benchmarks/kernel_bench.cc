// Kernel benchmark of the C++ core (docs/benchmarking.md). For each state preset it
// times shardadam::AdamStep and a bandwidth probe that reads arrays of the same
// dtypes and sizes (its own copies) and writes the same ones in place, with trivial
// integer arithmetic and the same thread count, interleaved (probe, kernel, probe,
// kernel, ...). It reports the median (min/max) seconds, elements/s, GB/s at
// docs/benchmarking.md's minimum bytes per element and the kernel's fraction of the
// probe. Presets with per-tensor scaled moments also get a two-pass probe: a
// read-only pass over grad and the scaled moments, then the one-pass probe -- the
// traffic of any exact step of such a layout, which must know the new moments'
// absmax before it stores them. Only ratios from one run mean
// anything here.
//
//   kernel_bench [--numel N] [--reps R] [--threads T] [--json PATH] [--preset SUBSTR]
//                [--settle-ms MS] [--target NAME]
//
// --preset runs only the presets whose name contains SUBSTR (e.g. "m=fp8").
// --target steps with the kernels of SIMD target NAME (one of SupportedTargets(),
// e.g. AVX2 on an AVX-512 machine) instead of the best one: the kernels a CPU
// without the better targets runs, timed on this one.
// --settle-ms sleeps MS milliseconds before each timed probe and kernel, as
// `python -m shardadam bench` does before each timed step: a core that has just been
// idle runs a step measurably slower than one that has just streamed the same arrays
// (cache contents, clock), so the yardstick is timed the way the steps it is compared
// with are. Default 0: back to back.
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"  // internal::CompiledTargets, SetTargetForTest
#include "shardadam/adam.h"
#include "stochastic_blocks.h"  // RoundsStochastically: as FusedAdam rounds

namespace shardadam {
namespace {

struct Preset {
  const char* name;
  DType param, grad, exp_avg, exp_avg_sq, master;
  int32_t scale_block = 0;  // per-block scaled moments: elements per scale
  Rounding param_rounding = Rounding::kNearest;  // a bf16 param with no master
};

// The presets the project's targets are stated for.
const Preset kPresets[] = {
    {"p=fp32 g=fp32 m=fp32 v=fp32", DType::kFloat32, DType::kFloat32, DType::kFloat32,
     DType::kFloat32, DType::kNone},
    {"p=bf16 g=bf16 master=fp32 m=fp32 v=fp32", DType::kBFloat16, DType::kBFloat16,
     DType::kFloat32, DType::kFloat32, DType::kFloat32},
    {"p=bf16 g=bf16 master=fp32 m=bf16 v=bf16", DType::kBFloat16, DType::kBFloat16,
     DType::kBFloat16, DType::kBFloat16, DType::kFloat32},
    {"p=bf16 g=bf16 master=remainder m=bf16 v=bf16", DType::kBFloat16,
     DType::kBFloat16, DType::kBFloat16, DType::kBFloat16, DType::kInt16Remainder},
    {"p=bf16 g=bf16 master=fp32 m=fp8 v=fp8", DType::kBFloat16, DType::kBFloat16,
     DType::kFloat8E4M3, DType::kFloat8E4M3, DType::kFloat32},
    {"p=bf16 g=bf16 master=fp32 m=fp8 v=bf16", DType::kBFloat16, DType::kBFloat16,
     DType::kFloat8E4M3, DType::kBFloat16, DType::kFloat32},
    // FusedAdam's moment_format="block8" (S2.9, S2.10), blocks of 256.
    {"p=bf16 g=bf16 master=remainder m=fp8-block v=ufp8-block", DType::kBFloat16,
     DType::kBFloat16, DType::kFloat8E4M3Block, DType::kUFloat8E4M4Block,
     DType::kInt16Remainder, 256},
    {"p=fp32 g=fp32 m=fp8-block v=ufp8-block", DType::kFloat32, DType::kFloat32,
     DType::kFloat8E4M3Block, DType::kUFloat8E4M4Block, DType::kNone, 256},
    // moment_format="block4" (S2.12), blocks of 128: two codes per byte, both
    // rounded stochastically (S2.13).
    {"p=bf16 g=bf16 master=remainder m=fp4-block v=ufp4-block", DType::kBFloat16,
     DType::kBFloat16, DType::kFloat4E2M1Block, DType::kUFloat4E3M1Block,
     DType::kInt16Remainder, 128},
    // The smallest states: bf16 params with no master, rounded stochastically
    // (S2.14), beside block8 and block4.
    {"p=bf16-sr g=bf16 m=fp8-block v=ufp8-block", DType::kBFloat16, DType::kBFloat16,
     DType::kFloat8E4M3Block, DType::kUFloat8E4M4Block, DType::kNone, 256,
     Rounding::kStochastic},
    {"p=bf16-sr g=bf16 m=fp4-block v=ufp4-block", DType::kBFloat16, DType::kBFloat16,
     DType::kFloat4E2M1Block, DType::kUFloat4E3M1Block, DType::kNone, 128,
     Rounding::kStochastic},
};

size_t Bits(DType t) { return t == DType::kNone ? 0 : static_cast<size_t>(FormatOf(t).item_bits); }

// Bytes the step must move per element (docs/benchmarking.md "minimum"): grad, both
// moments and the master (or the param when there is none) are read; param, master
// and both moments are written. Per-block scales (the two moments' 8 bytes per block
// read and 8 written: 0.0625 bytes per element for blocks of 256, 0.125 for 128) are
// left out.
double MinimumBytes(const Preset& p) {
  // A remainder master is read together with the param it completes.
  const size_t weight_read = p.master == DType::kNone ? Bits(p.param)
                             : p.master == DType::kInt16Remainder
                                 ? Bits(p.param) + Bits(p.master)
                                 : Bits(p.master);
  const size_t reads = Bits(p.grad) + weight_read + Bits(p.exp_avg) + Bits(p.exp_avg_sq);
  const size_t writes = Bits(p.param) + Bits(p.master) + Bits(p.exp_avg) +
                        Bits(p.exp_avg_sq);
  return static_cast<double>(reads + writes) / 8;
}

// One buffer per stream, 64-byte aligned like torch's CPU allocator.
struct Buffer {
  std::unique_ptr<uint8_t, decltype(&std::free)> data{nullptr, &std::free};
  size_t bytes = 0;
  void Allocate(size_t n) {
    bytes = n;
    data.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64 + 64)));
    if (!data) {
      std::fprintf(stderr, "kernel_bench: cannot allocate %zu bytes\n", n);
      std::exit(1);
    }
  }
  void* get() const { return data.get(); }
};

template <class T>
T* As(const Buffer& b) { return static_cast<T*>(b.get()); }

// Probe body over one range: the same streams, integer adds of matching widths.
// `Weight` is the type of the read weight stream (master, else param).
template <class G, class W, class M, class V, class P>
void ProbeRange(const G* g, W* w, M* m, V* v, P* p, bool param_write_only,
                size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const uint32_t x = g[i];
    const W wi = static_cast<W>(w[i] + x);
    w[i] = wi;
    m[i] = static_cast<M>(m[i] + x);
    v[i] = static_cast<V>(v[i] + x);
    if (param_write_only) p[i] = static_cast<P>(wi);
  }
}

// The read-only pass of the two-pass probe over one range: the gradient and the
// scaled moments, what the kernel's measuring pass reads (AdamW; an unscaled moment
// is not measured).
template <class G, class M>
uint32_t ReadRange(const G* g, const M* m, size_t begin, size_t end) {
  uint32_t acc = 0;
  for (size_t i = begin; i < end; ++i) acc ^= g[i] + m[i];
  return acc;
}

template <class G, class M, class V>
uint32_t ReadRange(const G* g, const M* m, const V* v, size_t begin, size_t end) {
  uint32_t acc = 0;
  for (size_t i = begin; i < end; ++i) acc ^= g[i] + m[i] + v[i];
  return acc;
}

bool ScaledMoments(const Preset& p) {
  const auto scaled = [](DType t) {
    return t == DType::kFloat16 || t == DType::kFloat8E4M3;
  };
  return scaled(p.exp_avg) || scaled(p.exp_avg_sq);
}

std::atomic<uint32_t> g_sink{0};  // keeps the read-only pass from being dropped

using Clock = std::chrono::steady_clock;

// A preset's buffers, one per stream.
struct Streams {
  Buffer param, grad, exp_avg, exp_avg_sq, master;

  Streams(const Preset& p, int64_t n) {
    param.Allocate(BufferBytes(p.param, n));
    grad.Allocate(BufferBytes(p.grad, n));
    exp_avg.Allocate(BufferBytes(p.exp_avg, n));
    exp_avg_sq.Allocate(BufferBytes(p.exp_avg_sq, n));
    if (p.master != DType::kNone) master.Allocate(BufferBytes(p.master, n));
  }

  double MiB() const {
    return (param.bytes + grad.bytes + exp_avg.bytes + exp_avg_sq.bytes + master.bytes) /
           1048576.0;
  }
};

struct Case {
  const Preset& preset;
  int64_t numel;
  int threads;
  // The kernel's state, and the probe's own copy of the same shape: the probe's
  // integer adds would turn the kernel's values into garbage (huge, inf, NaN), on
  // which some kernels take slower paths.
  Streams state, probe;
  float master_scale = 1.0f;
  // One scale per moment, or one per block of per-block scaled moments.
  std::vector<float> exp_avg_scales, exp_avg_sq_scales;

  Case(const Preset& p, int64_t n, int t)
      : preset(p), numel(n), threads(t), state(p, n), probe(p, n),
        exp_avg_scales(std::max<int64_t>(1, ScaleCount(p.exp_avg, 0, n, p.scale_block)), 1.0f),
        exp_avg_sq_scales(std::max<int64_t>(1, ScaleCount(p.exp_avg_sq, 0, n, p.scale_block)),
                          1.0f) {
    Fill();
    for (Buffer* b : {&probe.param, &probe.grad, &probe.exp_avg, &probe.exp_avg_sq,
                      &probe.master}) {
      if (b->get()) std::memset(b->get(), 0, b->bytes);  // first touch, untimed
    }
  }

  // Realistic values (first touch happens here, not in the timed region).
  void Fill() {
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> values(static_cast<size_t>(numel));
    auto store = [&](Buffer& b, DType t, float scale_of_values, bool positive) {
      for (auto& x : values) {
        x = normal(rng) * scale_of_values;
        if (positive) x = x * x;
      }
      // Remainders start at 0, per-block moments at 0 (the warm-up step fills them).
      if (t == DType::kInt16Remainder || IsBlockScaled(t)) {
        std::memset(b.get(), 0, b.bytes);
        return;
      }
      Error error;
      Convert(values.data(), DType::kFloat32, b.get(), t, numel, 1.0f, threads, &error);
    };
    store(state.param, preset.param, 0.02f, false);
    store(state.grad, preset.grad, 1e-3f, false);
    store(state.exp_avg, preset.exp_avg, 1e-4f, false);
    store(state.exp_avg_sq, preset.exp_avg_sq, 1e-4f, true);
    if (preset.master == DType::kFloat32) {
      Error error;
      std::vector<float> wide(static_cast<size_t>(numel));
      Convert(state.param.get(), preset.param, wide.data(), DType::kFloat32, numel, 1.0f,
              threads, &error);
      std::memcpy(state.master.get(), wide.data(), state.master.bytes);
    } else if (preset.master != DType::kNone) {
      store(state.master, preset.master, 0.0f, false);
    }
  }

  double TimeKernel(int64_t step) {
    TensorSlot slot;
    slot.numel = numel;
    slot.param = state.param.get();
    slot.param_dtype = preset.param;
    slot.grad = state.grad.get();
    slot.grad_dtype = preset.grad;
    slot.exp_avg = state.exp_avg.get();
    slot.exp_avg_dtype = preset.exp_avg;
    slot.exp_avg_scale = exp_avg_scales.data();
    slot.exp_avg_sq = state.exp_avg_sq.get();
    slot.exp_avg_sq_dtype = preset.exp_avg_sq;
    slot.exp_avg_sq_scale = exp_avg_sq_scales.data();
    slot.scale_block = preset.scale_block;
    // 4-bit moments and block8's exp_avg_sq round stochastically, as FusedAdam
    // steps them (S2.13).
    const auto rounding = [](DType t) {
      return RoundsStochastically(t) ? Rounding::kStochastic : Rounding::kNearest;
    };
    slot.exp_avg_rounding = rounding(preset.exp_avg);
    slot.exp_avg_sq_rounding = rounding(preset.exp_avg_sq);
    slot.master_param = state.master.get();
    slot.master_dtype = preset.master;
    slot.master_scale = &master_scale;
    slot.param_rounding = preset.param_rounding;
    StepParams params;
    params.lr = 1e-4;
    params.weight_decay = 0.01;
    params.step = step;
    Error error;
    const auto start = Clock::now();
    const Status status = AdamStep(&slot, 1, params, threads, &error);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (status != Status::kOk) {
      std::fprintf(stderr, "AdamStep failed: %s\n", error.message.c_str());
      std::exit(1);
    }
    return seconds;
  }

  template <class G, class W, class M, class V, class P>
  void ProbeTyped(size_t begin, size_t end) {
    const bool has_master = preset.master != DType::kNone;
    W* w = has_master ? As<W>(probe.master) : As<W>(probe.param);
    ProbeRange(As<const G>(probe.grad), w, As<M>(probe.exp_avg),
               As<V>(probe.exp_avg_sq), As<P>(probe.param), has_master, begin, end);
  }

  // Remainder: param and int16 remainder are both read and written in place.
  template <class M>
  void ProbeRemainder(size_t begin, size_t end) {
    using u16 = uint16_t;
    const u16* g = As<const u16>(probe.grad);
    u16 *p = As<u16>(probe.param), *r = As<u16>(probe.master);
    M *m = As<M>(probe.exp_avg), *v = As<M>(probe.exp_avg_sq);
    for (size_t i = begin; i < end; ++i) {
      const u16 x = g[i];
      p[i] = static_cast<u16>(p[i] + x);
      r[i] = static_cast<u16>(r[i] ^ x);
      m[i] = static_cast<M>(m[i] + x);
      v[i] = static_cast<M>(v[i] + x);
    }
  }

  // bf16 params (+ remainders) with 4-bit moments: per pair of elements (ranges
  // start on even elements), a u32 of the two bf16 params, of their remainders,
  // of their grads, and one byte of each moment.
  template <bool kRemainder>
  void ProbeNibbles(size_t begin, size_t end) {
    using u32 = uint32_t;
    const u32* g = As<const u32>(probe.grad);
    u32 *p = As<u32>(probe.param), *r = As<u32>(probe.master);
    uint8_t *m = As<uint8_t>(probe.exp_avg), *v = As<uint8_t>(probe.exp_avg_sq);
    for (size_t j = begin / 2; j < end / 2; ++j) {
      const u32 x = g[j];
      p[j] += x;
      if (kRemainder) r[j] ^= x;
      m[j] = static_cast<uint8_t>(m[j] + x);
      v[j] = static_cast<uint8_t>(v[j] + (x >> 16));
    }
  }

  void ProbeRangeForPreset(size_t begin, size_t end) {
    using u8 = uint8_t;
    using u16 = uint16_t;
    using u32 = uint32_t;
    const bool fp8 = Bits(preset.exp_avg) == 8;
    if (preset.master == DType::kInt16Remainder && Bits(preset.exp_avg) == 4) {
      ProbeNibbles<true>(begin, end);
    } else if (preset.param == DType::kBFloat16 && Bits(preset.exp_avg) == 4) {
      ProbeNibbles<false>(begin, end);
    } else if (preset.param == DType::kBFloat16 && preset.master == DType::kNone && fp8) {
      ProbeTyped<u16, u16, u8, u8, u16>(begin, end);
    } else if (preset.param == DType::kFloat32 && fp8) {
      ProbeTyped<u32, u32, u8, u8, u32>(begin, end);
    } else if (preset.param == DType::kFloat32) {
      ProbeTyped<u32, u32, u32, u32, u32>(begin, end);
    } else if (preset.master == DType::kInt16Remainder) {
      if (fp8) {
        ProbeRemainder<u8>(begin, end);
      } else {
        ProbeRemainder<u16>(begin, end);
      }
    } else if (fp8 && Bits(preset.exp_avg_sq) == 8) {
      ProbeTyped<u16, u32, u8, u8, u16>(begin, end);
    } else if (fp8) {
      ProbeTyped<u16, u32, u8, u16, u16>(begin, end);
    } else if (Bits(preset.exp_avg) == 16) {
      ProbeTyped<u16, u32, u16, u16, u16>(begin, end);
    } else {
      ProbeTyped<u16, u32, u32, u32, u16>(begin, end);
    }
  }

  void ReadRangeForPreset(size_t begin, size_t end) {
    uint32_t acc;
    if (Bits(preset.exp_avg) == 8 && Bits(preset.exp_avg_sq) == 8) {
      acc = ReadRange(As<const uint16_t>(probe.grad), As<const uint8_t>(probe.exp_avg),
                      As<const uint8_t>(probe.exp_avg_sq), begin, end);
    } else if (Bits(preset.exp_avg) == 8) {  // bf16 exp_avg_sq: not measured
      acc = ReadRange(As<const uint16_t>(probe.grad), As<const uint8_t>(probe.exp_avg),
                      begin, end);
    } else {
      acc = ReadRange(As<const uint16_t>(probe.grad), As<const uint16_t>(probe.exp_avg),
                      As<const uint16_t>(probe.exp_avg_sq), begin, end);
    }
    g_sink.fetch_xor(acc, std::memory_order_relaxed);
  }

  // The calling thread takes a range itself (as the core's pool does), so one
  // thread starts none. Starting the others is timed: ~20 us each, noise beside
  // large cases.
  double TimeProbe(bool two_pass) {
    const auto start = Clock::now();
    std::vector<std::thread> workers;
    const size_t n = static_cast<size_t>(numel);
    const size_t chunk = (n / threads + 63) / 64 * 64;
    const auto range = [this, two_pass](size_t begin, size_t end) {
      if (two_pass) ReadRangeForPreset(begin, end);
      ProbeRangeForPreset(begin, end);
    };
    for (int t = 0; t + 1 < threads; ++t) {
      const size_t begin = std::min(n, t * chunk);
      workers.emplace_back(range, begin, std::min(n, begin + chunk));
    }
    range(std::min(n, (threads - 1) * chunk), n);
    for (auto& w : workers) w.join();
    return std::chrono::duration<double>(Clock::now() - start).count();
  }
};

struct Stats {
  double median, min, max;
};

// The median as Python's statistics.median takes it: the mean of the middle two of
// an even count.
Stats Summarize(std::vector<double> s) {
  std::sort(s.begin(), s.end());
  const size_t n = s.size();
  const double median = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
  return {median, s.front(), s.back()};
}

const char kUsage[] =
    "usage: kernel_bench [--numel N] [--reps R] [--threads T] [--json PATH] "
    "[--preset SUBSTR] [--settle-ms MS] [--target NAME]\n";

// Prints the problem and the usage to stderr; main returns this status.
int Usage(const char* problem) {
  std::fprintf(stderr, "kernel_bench: %s\n%s", problem, kUsage);
  return 2;
}

// A whole decimal number >= 1, nothing else (atoll would take "12x" or "abc").
bool ParsePositive(const char* text, int64_t* out) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno != 0 || n < 1) return false;
  *out = n;
  return true;
}

// A decimal number of milliseconds in [0, 60000], nothing else.
bool ParseMilliseconds(const char* text, double* out) {
  char* end = nullptr;
  errno = 0;
  const double ms = std::strtod(text, &end);
  if (end == text || *end != '\0' || errno != 0 || !(ms >= 0 && ms <= 60'000)) return false;
  *out = ms;
  return true;
}

// Pins the kernels to the compiled target named `name`: SupportedTargets() lists
// the names in CompiledTargets()' order.
bool PinTarget(const std::string& name) {
  const std::vector<int64_t> targets = internal::CompiledTargets();
  const std::string names = SupportedTargets();
  size_t start = 0;
  for (int64_t target : targets) {
    const size_t end = std::min(names.find(' ', start), names.size());
    if (names.compare(start, end - start, name) == 0) {
      return internal::SetTargetForTest(target);
    }
    start = end + 1;
  }
  return false;
}

}  // namespace
}  // namespace shardadam

int main(int argc, char** argv) {
  using namespace shardadam;
  // Not a power of two: buffers spaced by large powers of two alias in the caches.
  int64_t numel = 20'000'003;
  int reps = 11;
  int threads = DefaultThreads();
  const char* json_path = nullptr;
  std::string only;
  double settle_ms = 0;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    static const char* const kFlags[] = {"--numel", "--reps",      "--threads", "--json",
                                         "--preset", "--settle-ms", "--target"};
    if (std::find(std::begin(kFlags), std::end(kFlags), flag) == std::end(kFlags)) {
      return Usage(("unknown flag " + flag).c_str());
    }
    if (i + 1 == argc) return Usage(("missing value after " + flag).c_str());
    const char* value = argv[i + 1];
    if (flag == "--numel") {
      if (!ParsePositive(value, &numel)) return Usage("--numel wants a positive integer");
    } else if (flag == "--reps" || flag == "--threads") {
      const int64_t most = flag == "--reps" ? 1'000'000 : 1024;
      int64_t n = 0;
      if (!ParsePositive(value, &n) || n > most) {
        return Usage((flag + " wants an integer in [1, " + std::to_string(most) + "]")
                         .c_str());
      }
      (flag == "--reps" ? reps : threads) = static_cast<int>(n);
    } else if (flag == "--json") {
      json_path = value;
    } else if (flag == "--preset") {
      only = value;
    } else if (flag == "--settle-ms") {
      if (!ParseMilliseconds(value, &settle_ms)) {
        return Usage("--settle-ms wants a number of milliseconds in [0, 60000]");
      }
    } else if (flag == "--target") {
      if (!PinTarget(value)) {
        return Usage(("--target wants one of: " + SupportedTargets()).c_str());
      }
    }
  }
  if (std::none_of(std::begin(kPresets), std::end(kPresets), [&](const Preset& p) {
        return std::string(p.name).find(only) != std::string::npos;
      })) {
    return Usage(("no preset name contains \"" + only + "\"").c_str());
  }
  // Opened before the run, so that a path it cannot write fails at once.
  std::unique_ptr<FILE, int (*)(FILE*)> json_file{nullptr, &std::fclose};
  if (json_path) {
    json_file.reset(std::fopen(json_path, "w"));
    if (!json_file) {
      std::fprintf(stderr, "kernel_bench: cannot write %s\n", json_path);
      return 1;
    }
  }
  std::printf("shardadam kernel benchmark: target %s, %d threads, numel %lld, %d reps, "
              "%g ms idle before each\n",
              ChosenTarget(), threads, static_cast<long long>(numel), reps, settle_ms);
  std::printf("%-46s %9s %9s %9s %8s %8s %7s %9s\n", "preset", "state MiB", "kernel ms",
              "probe ms", "Gelem/s", "GB/s", "/probe", "/2-pass");
  std::string json = "[\n";
  for (const Preset& preset : kPresets) {
    if (std::string(preset.name).find(only) == std::string::npos) continue;
    Case c(preset, numel, threads);
    const bool two_pass = ScaledMoments(preset);
    c.TimeProbe(two_pass);  // warm-up: thread start, page mapping, caches
    c.TimeKernel(1);
    std::vector<double> kernel, probe, probe2;
    const auto settle = [settle_ms] {
      if (settle_ms > 0) {
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(settle_ms));
      }
    };
    for (int r = 0; r < reps; ++r) {
      settle();
      probe.push_back(c.TimeProbe(false));
      if (two_pass) {
        settle();
        probe2.push_back(c.TimeProbe(true));
      }
      settle();
      kernel.push_back(c.TimeKernel(r + 2));
    }
    const Stats k = Summarize(kernel), p = Summarize(probe);
    const double bytes = static_cast<double>(MinimumBytes(preset)) * numel;
    const double state_mib = c.state.MiB();
    char two_pass_cell[32] = "-";
    char two_pass_json[160] = "";
    if (two_pass) {
      const Stats p2 = Summarize(probe2);
      std::snprintf(two_pass_cell, sizeof(two_pass_cell), "%.2f", p2.median / k.median);
      std::snprintf(two_pass_json, sizeof(two_pass_json),
                    ", \"two_pass_probe_s\": {\"median\": %.6g, \"min\": %.6g, "
                    "\"max\": %.6g}, \"fraction_of_two_pass_probe\": %.4f",
                    p2.median, p2.min, p2.max, p2.median / k.median);
    }
    std::printf("%-46s %9.0f %9.2f %9.2f %8.3f %8.2f %7.2f %9s\n", preset.name,
                state_mib, k.median * 1e3, p.median * 1e3, numel / k.median / 1e9,
                bytes / k.median / 1e9, p.median / k.median, two_pass_cell);
    char row[1024];
    std::snprintf(row, sizeof(row),
                  "  {\"preset\": \"%s\", \"numel\": %lld, \"threads\": %d, "
                  "\"settle_ms\": %g, \"target\": \"%s\", \"bytes_per_element\": %g, "
                  "\"kernel_s\": {\"median\": %.6g, \"min\": %.6g, \"max\": %.6g}, "
                  "\"probe_s\": {\"median\": %.6g, \"min\": %.6g, \"max\": %.6g}, "
                  "\"elements_per_s\": %.6g, \"gb_per_s\": %.6g, "
                  "\"fraction_of_probe\": %.4f%s}",
                  preset.name, static_cast<long long>(numel), threads, settle_ms,
                  ChosenTarget(),
                  MinimumBytes(preset), k.median, k.min, k.max, p.median, p.min, p.max,
                  numel / k.median, bytes / k.median / 1e9, p.median / k.median,
                  two_pass_json);
    json += std::string(json.size() > 2 ? ",\n" : "") + row;
  }
  json += "\n]\n";
  if (json_file) {
    const bool written = std::fputs(json.c_str(), json_file.get()) >= 0 &&
                         std::fclose(json_file.release()) == 0;
    if (!written) {
      std::fprintf(stderr, "kernel_bench: cannot write %s\n", json_path);
      return 1;
    }
  }
  return 0;
}
