// CPU kernel for ridgefill::scattered_rows_attention (schema in csrc/bindings.cpp;
// contract and pure-torch reference in ridgefill_runtime/ops/scattered_rows_attention.py;
// the CUDA kernel is csrc/scattered_rows_attention.cu).
//
// The runtime's batched paged attention on CPU: every decode row, prefill-chunk
// row and scattered exact row of all sequences in one call per layer. Row i is
// sequence b = q_seq[i] at position q_pos[i] and sees b's keys 0..q_pos[i],
// read where they lie in the paged cache (no gather of the context):
//   slot(b, j) = block_tables[b, j / block_size] * block_size + j % block_size.
// With a sliding window (window > 0, Gemma 3's local layers) the row sees only
// keys max(0, q_pos[i] - window + 1)..q_pos[i]: every loop below starts at that
// key rather than masking the earlier ones, because a sliding-window cache may
// hold anything (NaN included) in the slots before it.
// GQA: query head h reads KV head h / (H / Hkv).
//
// One task = one row (or, split-KV, a chunk of its keys), all its heads. A first
// pass over the keys reads each key's K row of each KV head once and scores it
// for the G = H / Hkv query heads of that group (keys four at a time: independent
// FMA chains, one transposing reduction per head), into a per-thread scores
// buffer; a softmax runs over that buffer; a second pass reads each V row once
// and accumulates it for the group's heads, kTile keys at a time. Reading all KV
// heads of a key together walks each slot's [Hkv, D] row contiguously, which
// measured about 1.2x faster than (row, KV head) tasks on the strided slabs.
// Both passes prefetch the scattered slots ahead (into L2: ~1.7x on DRAM-bound
// batches). Rows longer than kMaxChunkKeys run several passes merged with
// log-sum-exp weights, so the buffer stays small. Scores, softmax and sums are
// fp32; the output is cast to q's dtype. float and bfloat16 rows are read in
// place (bfloat16 widened 32 at a time by a shift and a mask, see load32);
// float16 rows go through an fp32 copy (a group of keys, every KV head, widened
// per call: widen_rows). int8 rows (cache.kv_dtype = "int8",
// ridgefill::scattered_rows_attention_int8) go through the fp32 copy too,
// each value widened (vpmovsxbd + vcvtdq2ps, see kInt8Rows) and multiplied by
// its group's float32 scale (one per 32 values of a (slot, KV head) row):
// float(q) * s, the product every other reader of the cache forms
// (ridgefill_runtime/cache/int8_kv.py), so the kernel matches the reference.
//
// Split-KV (flash-decoding): when few rows carry the work (fewer than
// kTasksPerThread tasks per thread otherwise), rows are cut into chunks of at
// least kMinSplitKeys keys that run as separate tasks, each leaving (max, sum,
// unnormalised acc) per head; a merge pass combines them with log-sum-exp weights.
//
// key_mass (the probe selector's ranking): a second phase over (sequence, key
// chunk) tasks recomputes each row's scores for the chunk's keys and adds
// exp(s - m) / l with the final (m, l) of each (row, head). Every task owns its
// slice of key_mass[b], so there are no atomics and the result is deterministic;
// the scores are recomputed by the same code on the same inputs, hence bitwise
// the same as in the first phase.
//
// Tasks are handed out dynamically (an atomic counter inside at::parallel_for),
// largest first. The hot functions are compiled for x86-64-v4 (AVX-512),
// x86-64-v3 (AVX2 + FMA) and the baseline and picked at load time
// (target_clones -> ifunc), so one binary runs anywhere; the vector code uses
// GCC/Clang vector extensions of 16 floats, which each clone lowers to zmm,
// 2 x ymm or 4 x xmm. The v3 and v4 clones give bitwise the same results (same
// lane-wise arithmetic and reduction trees) except over widened rows, whose V
// pass runs a KV group's heads together on AVX-512 only (kGroupHeads) and sums
// in another order there; the baseline differs by rounding (no FMA).
//
// Debug/test knob: RIDGEFILL_CPU_ATTN_SPLIT=0 never splits, =1 splits every
// row longer than kMinSplitKeys keys; unset (or anything else) = heuristic.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vector helpers are always inlined; no ABI crossing
#endif

// Run-time ISA dispatch for the hot functions (-DRIDGEFILL_ATTN_CLONES= builds one variant, e.g. to test the
// baseline code on an AVX-512 machine).
#ifdef RIDGEFILL_ATTN_CLONES
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__ELF__)
#define RIDGEFILL_ATTN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__clang__) && __clang_major__ >= 14 && defined(__ELF__)
// Not built in this project's CI (GCC); clang's avx2 clone has no FMA.
#define RIDGEFILL_ATTN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RIDGEFILL_ATTN_CLONES
#endif
#define RIDGEFILL_INLINE inline __attribute__((always_inline))

namespace ridgefill {
namespace {

constexpr int64_t kW = 16;              // floats per vector value (lowered to the clone's ISA)
constexpr int64_t kTile = 32;           // keys per V tile
constexpr int64_t kKeyGroup = 4;        // keys scored together (one transposing reduction per head)
constexpr int64_t kPrefetchKeys = 16;   // K rows are prefetched this many keys ahead
constexpr int64_t kMinSplitKeys = 256;  // never split a row into chunks shorter than this
constexpr int64_t kMaxChunkKeys = 4096; // keys per softmax pass (bounds the scores buffer; longer ranges merge)
constexpr int64_t kTasksPerThread = 4;  // split until a task is at most total / (this * threads) keys
constexpr int64_t kMassChunk = 256;     // keys per key-mass task
constexpr int64_t kSerialWork = 1 << 15;  // below this many (key x head x dim) MACs, run on one thread

typedef float vf __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

RIDGEFILL_INLINE vf splat(float x) { return vf{} + x; }
RIDGEFILL_INLINE vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
RIDGEFILL_INLINE void storef(float* p, const vf& v) { std::memcpy(p, &v, sizeof v); }

RIDGEFILL_INLINE float hsum(const vf& v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
RIDGEFILL_INLINE float hmax(const vf& v) {
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// 16 elements of T -> 16 floats.
template <typename T>
RIDGEFILL_INLINE vf load16(const T* p);
template <>
RIDGEFILL_INLINE vf load16<float>(const float* p) {
  return loadf(p);
}
template <>
RIDGEFILL_INLINE vf load16<c10::BFloat16>(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}
template <>
RIDGEFILL_INLINE vf load16<c10::Half>(const c10::Half* p) {
  // IEEE half -> float without F16C (branch-free; the FP16 library's method, also c10's scalar one).
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu w = __builtin_convertvector(h, vu) << 16;
  const vu sign = w & 0x80000000u;
  const vu two_w = w + w;
  const vf normalized = reinterpret_cast<vf>((two_w >> 4) + 0x70000000u) * 0x1.0p-112f;
  const vf denormalized = reinterpret_cast<vf>((two_w >> 17) | 0x3F000000u) - 0.5f;
  const vi is_normal = two_w >= (vu{} + (1u << 27));
  const vu bits = is_normal ? reinterpret_cast<vu>(normalized) : reinterpret_cast<vu>(denormalized);
  return reinterpret_cast<vf>(sign | bits);
}

// exp for the softmax (arguments are s - max <= 0). Cephes' expf: Cody-Waite reduction by ln 2 and a
// degree-6 polynomial, about 1 ulp; inputs are clamped to [-87, 88] (exp(-87) ~ 1.6e-38 where the true
// value would be smaller, irrelevant next to the softmax denominator, which is >= 1). NaN propagates.
RIDGEFILL_INLINE vf vexp(const vf& x_in) {
  vf x = x_in;
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer (ties to even)
  const vf t = x * 1.44269504088896341f + magic;
  const vf n = t - magic;
  const vi ni = reinterpret_cast<vi>(t) - reinterpret_cast<vi>(magic);
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = splat(1.9875691500E-4f);
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  const vf y = p * (r * r) + r + 1.0f;
  return y * reinterpret_cast<vf>((ni + 127) << 23);
}
RIDGEFILL_INLINE float sexp(float x) {
  const vf v = vexp(splat(x));
  return v[0];
}

// float16 and int8 K/V rows are widened to fp32 before the hot loops read them, one call per group of keys
// (every KV head of each): a call per row cost about a third of a float16 cache's attention time, each one
// waiting on its row's first load (benchmarks/decode.md). The conversions use F16C / AVX-512 instructions the
// clones cannot use in their own bodies (the baseline clone has neither), so the group goes through one call
// picked once at load time. Same values as the portable code: the conversions are exact, and an int8 value
// is float(q) * s, the product every other reader of the cache forms (ridgefill_runtime/cache/int8_kv.py).
//
// Row (i, h) of a group is key slots[i]'s row for KV head h: base + slots[i] * slot_stride + h * head_stride,
// written to dst + (i * kv_heads + h) * Dp (entries past D left as they are: zero padding).
struct RowGroup {
  const int64_t* slots;
  int64_t n, kv_heads, D, Dp;
  int64_t slot_stride, head_stride;      // the slab's, in elements
  const float* scale;                    // int8 only: [S, Hkv, D / 32] group scales
  int64_t s_slot_stride, s_head_stride;  // the scales', in elements
};

template <typename T>
RIDGEFILL_INLINE const T* group_src(const T* base, const RowGroup& g, int64_t i, int64_t h) {
  return base + g.slots[i] * g.slot_stride + h * g.head_stride;
}
RIDGEFILL_INLINE float* group_dst(float* dst, const RowGroup& g, int64_t i, int64_t h) {
  return dst + (i * g.kv_heads + h) * g.Dp;
}
RIDGEFILL_INLINE const float* group_scales(const RowGroup& g, int64_t i, int64_t h) {
  return g.scale + g.slots[i] * g.s_slot_stride + h * g.s_head_stride;
}

constexpr int64_t kInt8Group = 32;  // int8 values per scale
using HalfRowsFn = void (*)(const c10::Half*, const RowGroup&, float*);
using Int8RowsFn = void (*)(const int8_t*, const RowGroup&, float*);

void half_rows_portable(const c10::Half* base, const RowGroup& g, float* dst) {
  for (int64_t i = 0; i < g.n; ++i) {
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const c10::Half* src = group_src(base, g, i, h);
      float* out = group_dst(dst, g, i, h);
      int64_t d = 0;
      for (; d + kW <= g.D; d += kW) storef(out + d, load16(src + d));
      for (; d < g.D; ++d) out[d] = static_cast<float>(src[d]);
    }
  }
}
void int8_rows_portable(const int8_t* base, const RowGroup& g, float* dst) {
  for (int64_t i = 0; i < g.n; ++i) {
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const int8_t* src = group_src(base, g, i, h);
      const float* sc = group_scales(g, i, h);
      float* out = group_dst(dst, g, i, h);
      for (int64_t d = 0; d < g.D; ++d) out[d] = static_cast<float>(src[d]) * sc[d / kInt8Group];
    }
  }
}
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) void half_rows_avx512(const c10::Half* base, const RowGroup& g, float* dst) {
  for (int64_t i = 0; i < g.n; ++i) {
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const c10::Half* src = group_src(base, g, i, h);
      float* out = group_dst(dst, g, i, h);
      int64_t d = 0;
      for (; d + 16 <= g.D; d += 16)
        _mm512_storeu_ps(out + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
      for (; d < g.D; ++d) out[d] = static_cast<float>(src[d]);
    }
  }
}
__attribute__((target("avx,f16c"))) void half_rows_f16c(const c10::Half* base, const RowGroup& g, float* dst) {
  for (int64_t i = 0; i < g.n; ++i) {
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const c10::Half* src = group_src(base, g, i, h);
      float* out = group_dst(dst, g, i, h);
      int64_t d = 0;
      for (; d + 8 <= g.D; d += 8)
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
      for (; d < g.D; ++d) out[d] = static_cast<float>(src[d]);
    }
  }
}
// int8: one vpmovsxbd + vcvtdq2ps per 16 (8) values (GCC 12 lowers the clones' vector conversion of int8
// lanes to one scalar vcvtsi2ss each, ~8x slower), times the value's group scale.
__attribute__((target("avx512f"))) void int8_rows_avx512(const int8_t* base, const RowGroup& g, float* dst) {
  for (int64_t i = 0; i < g.n; ++i) {
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const int8_t* src = group_src(base, g, i, h);
      const float* sc = group_scales(g, i, h);
      float* out = group_dst(dst, g, i, h);
      int64_t d = 0;
      for (; d + 16 <= g.D; d += 16) {  // 16 values lie in one group of 32
        const __m512 x =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
        _mm512_storeu_ps(out + d, _mm512_mul_ps(x, _mm512_set1_ps(sc[d / kInt8Group])));
      }
      for (; d < g.D; ++d) out[d] = static_cast<float>(src[d]) * sc[d / kInt8Group];
    }
  }
}
__attribute__((target("avx2"))) void int8_rows_avx2(const int8_t* base, const RowGroup& g, float* dst) {
  for (int64_t i = 0; i < g.n; ++i) {
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      const int8_t* src = group_src(base, g, i, h);
      const float* sc = group_scales(g, i, h);
      float* out = group_dst(dst, g, i, h);
      int64_t d = 0;
      for (; d + 8 <= g.D; d += 8) {
        const __m256 x =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d))));
        _mm256_storeu_ps(out + d, _mm256_mul_ps(x, _mm256_set1_ps(sc[d / kInt8Group])));
      }
      for (; d < g.D; ++d) out[d] = static_cast<float>(src[d]) * sc[d / kInt8Group];
    }
  }
}
// Test knob: RIDGEFILL_CPU_ATTN_WIDEN=avx2 or =portable caps the widening's instruction set (read at load),
// so the tests run every variant on an AVX-512 machine. 2: AVX-512, 1: AVX2 / F16C, 0: portable.
int widen_cap() {
  const char* env = std::getenv("RIDGEFILL_CPU_ATTN_WIDEN");
  if (env == nullptr) return 2;
  if (std::strcmp(env, "avx2") == 0) return 1;
  if (std::strcmp(env, "portable") == 0) return 0;
  return 2;
}
HalfRowsFn pick_half_rows() {
  __builtin_cpu_init();  // a static initializer may run before libgcc's own CPU detection
  const int cap = widen_cap();
  if (cap >= 2 && __builtin_cpu_supports("avx512f")) return half_rows_avx512;
  return cap >= 1 && __builtin_cpu_supports("f16c") ? half_rows_f16c : half_rows_portable;
}
Int8RowsFn pick_int8_rows() {
  __builtin_cpu_init();
  const int cap = widen_cap();
  if (cap >= 2 && __builtin_cpu_supports("avx512f")) return int8_rows_avx512;
  return cap >= 1 && __builtin_cpu_supports("avx2") ? int8_rows_avx2 : int8_rows_portable;
}
const HalfRowsFn kHalfRows = pick_half_rows();
const Int8RowsFn kInt8Rows = pick_int8_rows();
// The grouped V pass (accumulate_group) holds 16 accumulators of 16 floats: half of AVX-512's 32 zmm registers,
// but under AVX2 each is two of the 16 ymm registers and it would spill. It runs only where the x86-64-v4 clone
// runs (the features that clone's resolver checks); elsewhere the V pass goes a head at a time.
bool pick_group_heads() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
const bool kGroupHeads = pick_group_heads();
#else
constexpr HalfRowsFn kHalfRows = half_rows_portable;
constexpr Int8RowsFn kInt8Rows = int8_rows_portable;
constexpr bool kGroupHeads = false;
#endif

template <typename T>
RIDGEFILL_INLINE void widen_rows(const T* base, const RowGroup& g, float* dst) {
  if constexpr (std::is_same_v<T, int8_t>) {
    kInt8Rows(base, g, dst);
  } else {
    kHalfRows(base, g, dst);
  }
}

// How the hot loops read K/V rows of T: float and bfloat16 straight from the cache (bfloat16 widens with a
// shift), float16 through an fp32 copy (its bit-level conversion is too long to repeat for every head).
template <typename T>
struct RowType {
  using type = T;
};
template <>
struct RowType<c10::Half> {
  using type = float;
};
template <>
struct RowType<int8_t> {  // widened into the fp32 copy, times its group scales (widen_rows)
  using type = float;
};

// 32 elements of a row as two vectors, in the kernel's layout for R: the natural order (lo = p[0..16),
// hi = p[16..32)), except bfloat16, whose 32-element blocks split into even (lo) and odd (hi) elements: a 32-bit
// word holds two of them, so a shift and a mask widen 32 at once. The queries and accumulators use the same
// layout for each full 32-element block (pair_split_index), so dot products and sums do not care.
template <typename R>
RIDGEFILL_INLINE void load32(const R* p, vf& lo, vf& hi) {
  lo = load16(p);
  hi = load16(p + kW);
}
template <>
RIDGEFILL_INLINE void load32<c10::BFloat16>(const c10::BFloat16* p, vf& lo, vf& hi) {
  vu w;
  std::memcpy(&w, p, sizeof w);
  lo = reinterpret_cast<vf>(w << 16);
  hi = reinterpret_cast<vf>(w & 0xFFFF0000u);
}
template <typename R>
constexpr bool kPairSplit = std::is_same_v<R, c10::BFloat16>;
// Where element d of a row sits in the kernel's layout (d32 = the row's full 32-element blocks).
template <typename R>
RIDGEFILL_INLINE int64_t pair_split_index(int64_t d, int64_t d32) {
  if constexpr (kPairSplit<R>) {
    if (d < d32) return (d & ~int64_t{31}) + (d & 1) * kW + ((d & 31) >> 1);
  }
  return d;
}

// {hsum(a), hsum(b), hsum(c), hsum(d)}: one transposing reduction instead of four.
RIDGEFILL_INLINE vf4 hsum4(const vf& a, const vf& b, const vf& c, const vf& d) {
  const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // Lanes 4i..4i+3 of x hold four partial sums of input i (a, b, c, d).
  const vf x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vf y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vf z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return __builtin_shufflevector(z, z, 0, 4, 8, 12);
}

// Software prefetch of one K/V row (the slots are scattered, so the hardware prefetcher cannot follow). Hint 1
// (into L2): prefetching into L1 stalled on its few miss buffers and was ~1.7x slower on DRAM-bound batches.
template <typename T>
RIDGEFILL_INLINE void prefetch_row(const T* p, int64_t D) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
  __builtin_prefetch(c + bytes - 1, 0, 1);
}

// Calls f(j, slot) for the keys j in [j0, j1) of a sequence, in order, walking its block table.
template <typename F>
RIDGEFILL_INLINE void for_each_slot(const int32_t* table, int64_t block_size, int64_t j0, int64_t j1, F&& f) {
  int64_t blk = j0 / block_size, off = j0 % block_size, j = j0;
  while (j < j1) {
    const int64_t base = static_cast<int64_t>(table[blk]) * block_size + off;
    const int64_t run = std::min(block_size - off, j1 - j);
    for (int64_t i = 0; i < run; ++i) f(j + i, base + i);
    j += run;
    ++blk;
    off = 0;
  }
}

template <typename T>
struct Problem {
  const T* q;  // [R, H, D] contiguous
  // A float32 model over a narrower K/V cache (cache.kv_dtype): the queries and the output stay
  // float32 (q_f32 / out_f32 set, q unused), so only the stored keys and values were rounded.
  const float* q_f32;
  float* out_f32;
  const int32_t* q_seq;
  const int64_t* q_pos;
  const T* k;  // [S, Hkv, D], unit stride in D
  const T* v;
  int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
  // int8 slabs only: float32 [S, Hkv, G] scales (last dim contiguous); value d of row (slot, h) is
  // float(k[slot, h, d]) * k_scale[slot, h, d / 32]
  const float* k_scale;
  const float* v_scale;
  int64_t ks_slot_stride, ks_head_stride, vs_slot_stride, vs_head_stride;
  const int32_t* tables;  // [B, max_blocks] contiguous
  int64_t max_blocks, block_size;
  int64_t heads, kv_heads, group, head_dim, dpad;
  float scale;
  int64_t window;  // 0: full causal; > 0: row r sees keys first_key(r)..q_pos[r]
};

// First key row r sees; its last is q_pos[r].
template <typename T>
RIDGEFILL_INLINE int64_t first_key(const Problem<T>& P, int64_t row) {
  return P.window > 0 ? std::max<int64_t>(0, P.q_pos[row] - P.window + 1) : 0;
}

// Prefetch of one key's K (or V) rows for every KV head: one contiguous run when the heads are adjacent.
template <typename T>
RIDGEFILL_INLINE void prefetch_slot(const T* slot_base, int64_t kv_heads, int64_t head_stride, int64_t D) {
  if (head_stride == D) {
    prefetch_row(slot_base, kv_heads * D);
  } else {
    for (int64_t h = 0; h < kv_heads; ++h) prefetch_row(slot_base + h * head_stride, D);
  }
}

// Per-thread buffers (floats; dpad = head dim rounded up to kW, padding kept at zero).
struct Scratch {
  std::vector<float> qf;       // [H, dpad] queries times scale
  std::vector<float> scores;   // [H, cap]
  std::vector<int64_t> slots;  // [cap] slot of each key of the task
  std::vector<float> ktile;    // [kKeyGroup, wide_heads, dpad] K rows widened to fp32 (float16, int8 slabs)
  std::vector<float> vtile;    // [kTile, wide_heads, dpad] V rows likewise
  std::vector<float> acc;      // [H, dpad]
  std::vector<float> m, l;     // [H]
  std::vector<float> run_acc, run_m, run_l;  // attend_range's running merge of passes
  std::vector<float> mass;     // [kMassChunk]
  int64_t cap;                 // score row stride: keys per pass plus a key group
  // wide_heads: the KV heads whose rows are widened (0 where the slabs are read in place)
  Scratch(int64_t heads, int64_t wide_heads, int64_t dpad, int64_t cap_keys)
      : qf(heads * dpad), scores(heads * (cap_keys + kKeyGroup)), slots(cap_keys),
        ktile(kKeyGroup * wide_heads * dpad), vtile(kTile * wide_heads * dpad), acc(heads * dpad), m(heads), l(heads), run_acc(heads * dpad), run_m(heads),
        run_l(heads), mass(kMassChunk), cap(cap_keys + kKeyGroup) {}
};

template <typename T>
RIDGEFILL_INLINE void load_queries(const Problem<T>& P, int64_t row, float* __restrict__ qf) {
  using R = typename RowType<T>::type;
  const int64_t D = P.head_dim, d32 = D / (2 * kW) * (2 * kW);
  const int64_t at = row * P.heads * P.head_dim;
  for (int64_t h = 0; h < P.heads; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      const float x = P.q_f32 ? P.q_f32[at + h * D + d] : static_cast<float>(P.q[at + h * D + d]);
      qf[h * P.dpad + pair_split_index<R>(d, d32)] = x * P.scale;
    }
  }
}

// slots[j - j0] = slot of key j, j in [j0, j1).
RIDGEFILL_INLINE void collect_slots(const int32_t* table, int64_t block_size, int64_t j0, int64_t j1,
                                    int64_t* __restrict__ slots) {
  for_each_slot(table, block_size, j0, j1, [&](int64_t j, int64_t slot) { slots[j - j0] = slot; });
}

// The K (or V) rows of keys slots[0..n), every KV head, as a group to widen (widen_rows).
template <typename T>
RIDGEFILL_INLINE RowGroup k_group(const Problem<T>& P, const int64_t* slots, int64_t n) {
  return {slots, n, P.kv_heads, P.head_dim, P.dpad, P.k_slot_stride, P.k_head_stride,
          P.k_scale, P.ks_slot_stride, P.ks_head_stride};
}
template <typename T>
RIDGEFILL_INLINE RowGroup v_group(const Problem<T>& P, const int64_t* slots, int64_t n) {
  return {slots, n, P.kv_heads, P.head_dim, P.dpad, P.v_slot_stride, P.v_head_stride,
          P.v_scale, P.vs_slot_stride, P.vs_head_stride};
}

// scores[h * cap + i] = qf[h] . K[slots[i], h / G] for i < n and every head h. Each key's K row of each KV
// head is read once for the G query heads of its group; keys go in groups of four (independent FMA chains and
// one transposing reduction per head). Writes up to 3 entries past n.
template <typename T>
RIDGEFILL_INLINE void score_keys(const Problem<T>& P, const int64_t* __restrict__ slots, int64_t n,
                                 const float* __restrict__ qf, float* __restrict__ scores, int64_t cap,
                                 float* __restrict__ ktile) {
  const int64_t G = P.group, D = P.head_dim, Dp = P.dpad, ks = P.k_slot_stride, khs = P.k_head_stride;
  const int64_t Dv = D / kW * kW;  // vector part of the head dim
  for (int64_t i0 = 0; i0 < n; i0 += kKeyGroup) {
    for (int64_t i = i0 + kPrefetchKeys; i < std::min(n, i0 + kPrefetchKeys + kKeyGroup); ++i) {
      prefetch_slot(P.k + slots[i] * ks, P.kv_heads, khs, D);
    }
    using R = typename RowType<T>::type;
    int64_t group[kKeyGroup];
    for (int64_t b = 0; b < kKeyGroup; ++b) group[b] = slots[std::min(i0 + b, n - 1)];  // a short group repeats its last key
    if constexpr (!std::is_same_v<T, R>) widen_rows(P.k, k_group(P, group, kKeyGroup), ktile);
    for (int64_t kvh = 0; kvh < P.kv_heads; ++kvh) {
      const R* kr[kKeyGroup];
      for (int64_t b = 0; b < kKeyGroup; ++b) {
        if constexpr (std::is_same_v<T, R>) {
          kr[b] = P.k + group[b] * ks + kvh * khs;
        } else {
          kr[b] = ktile + (b * P.kv_heads + kvh) * Dp;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const float* qh = qf + h * Dp;
        vf a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
        int64_t d = 0;
        for (; d + 2 * kW <= Dv; d += 2 * kW) {
          const vf x = loadf(qh + d), y = loadf(qh + d + kW);
          vf lo, hi;
          load32(kr[0] + d, lo, hi);
          a0 += x * lo;
          b0 += y * hi;
          load32(kr[1] + d, lo, hi);
          a1 += x * lo;
          b1 += y * hi;
          load32(kr[2] + d, lo, hi);
          a2 += x * lo;
          b2 += y * hi;
          load32(kr[3] + d, lo, hi);
          a3 += x * lo;
          b3 += y * hi;
        }
        if (d < Dv) {
          const vf x = loadf(qh + d);
          a0 += x * load16(kr[0] + d);
          a1 += x * load16(kr[1] + d);
          a2 += x * load16(kr[2] + d);
          a3 += x * load16(kr[3] + d);
        }
        vf4 s = hsum4(a0 + b0, a1 + b1, a2 + b2, a3 + b3);
        for (d = Dv; d < D; ++d) {
          s[0] += qh[d] * static_cast<float>(kr[0][d]);
          s[1] += qh[d] * static_cast<float>(kr[1][d]);
          s[2] += qh[d] * static_cast<float>(kr[2][d]);
          s[3] += qh[d] * static_cast<float>(kr[3][d]);
        }
        std::memcpy(scores + h * cap + i0, &s, sizeof s);
      }
    }
  }
}

// acc[0..D) += sum_i p[i] * rows[i][0..D) for i < nt (8 independent accumulators where D allows).
template <typename R>
RIDGEFILL_INLINE void accumulate_rows(float* __restrict__ a, const float* __restrict__ p, const R* const* rows,
                                      int64_t nt, int64_t D) {
  int64_t d = 0;
  for (; d + 4 * kW <= D; d += 4 * kW) {
    vf x0 = loadf(a + d), x1 = loadf(a + d + kW), x2 = loadf(a + d + 2 * kW), x3 = loadf(a + d + 3 * kW);
    vf y0 = {}, y1 = {}, y2 = {}, y3 = {};
    int64_t i = 0;
    vf v0, v1, v2, v3;
    for (; i + 2 <= nt; i += 2) {
      load32(rows[i] + d, v0, v1);
      load32(rows[i] + d + 2 * kW, v2, v3);
      x0 += p[i] * v0;
      x1 += p[i] * v1;
      x2 += p[i] * v2;
      x3 += p[i] * v3;
      load32(rows[i + 1] + d, v0, v1);
      load32(rows[i + 1] + d + 2 * kW, v2, v3);
      y0 += p[i + 1] * v0;
      y1 += p[i + 1] * v1;
      y2 += p[i + 1] * v2;
      y3 += p[i + 1] * v3;
    }
    if (i < nt) {
      load32(rows[i] + d, v0, v1);
      load32(rows[i] + d + 2 * kW, v2, v3);
      x0 += p[i] * v0;
      x1 += p[i] * v1;
      x2 += p[i] * v2;
      x3 += p[i] * v3;
    }
    storef(a + d, x0 + y0);
    storef(a + d + kW, x1 + y1);
    storef(a + d + 2 * kW, x2 + y2);
    storef(a + d + 3 * kW, x3 + y3);
  }
  if (d + 2 * kW <= D) {  // one full 32-element block left
    vf x0 = loadf(a + d), x1 = loadf(a + d + kW), y0 = {}, y1 = {}, v0, v1;
    int64_t i = 0;
    for (; i + 2 <= nt; i += 2) {
      load32(rows[i] + d, v0, v1);
      x0 += p[i] * v0;
      x1 += p[i] * v1;
      load32(rows[i + 1] + d, v0, v1);
      y0 += p[i + 1] * v0;
      y1 += p[i + 1] * v1;
    }
    if (i < nt) {
      load32(rows[i] + d, v0, v1);
      x0 += p[i] * v0;
      x1 += p[i] * v1;
    }
    storef(a + d, x0 + y0);
    storef(a + d + kW, x1 + y1);
    d += 2 * kW;
  }
  for (; d + kW <= D; d += kW) {
    vf x0 = loadf(a + d), x1 = {}, x2 = {}, x3 = {};
    int64_t i = 0;
    for (; i + 4 <= nt; i += 4) {
      x0 += p[i] * load16(rows[i] + d);
      x1 += p[i + 1] * load16(rows[i + 1] + d);
      x2 += p[i + 2] * load16(rows[i + 2] + d);
      x3 += p[i + 3] * load16(rows[i + 3] + d);
    }
    for (; i < nt; ++i) x0 += p[i] * load16(rows[i] + d);
    storef(a + d, (x0 + x1) + (x2 + x3));
  }
  for (; d < D; ++d) {
    float x = a[d];
    for (int64_t i = 0; i < nt; ++i) x += p[i] * static_cast<float>(rows[i][d]);
    a[d] = x;
  }
}

// For NH query heads of one KV group at once: a[hh][0..D) += sum_i p[hh * cap + i] * rows[i][0..D) (D a multiple
// of 4 * kW). Each 64-wide block of a V row is loaded once for all NH heads (NH * 4 accumulators in registers),
// where accumulate_rows loads it once per head: with Gemma 3's four query heads per KV head that is a quarter of
// the loads. Used for the widened rows only (float16, int8: the fp32 tile sits in L1, so the loads are the
// cost): over rows read in place from DRAM (float32 decode batches) it measured 1.15-1.2x slower than a head at
// a time, whose extra loads hit L1 while the first head's sweep waits on memory.
template <int NH, typename R>
RIDGEFILL_INLINE void accumulate_rows_heads(float* __restrict__ a, int64_t a_stride, const float* __restrict__ p,
                                            int64_t cap, const R* const* rows, int64_t nt, int64_t D) {
  for (int64_t d = 0; d < D; d += 4 * kW) {
    vf x[NH][4];
    for (int hh = 0; hh < NH; ++hh) {
      for (int c = 0; c < 4; ++c) x[hh][c] = loadf(a + hh * a_stride + d + c * kW);
    }
    for (int64_t i = 0; i < nt; ++i) {
      vf v[4];
      load32(rows[i] + d, v[0], v[1]);
      load32(rows[i] + d + 2 * kW, v[2], v[3]);
      for (int hh = 0; hh < NH; ++hh) {
        const float w = p[hh * cap + i];
        for (int c = 0; c < 4; ++c) x[hh][c] += w * v[c];
      }
    }
    for (int hh = 0; hh < NH; ++hh) {
      for (int c = 0; c < 4; ++c) storef(a + hh * a_stride + d + c * kW, x[hh][c]);
    }
  }
}

// accumulate_rows for the G query heads of one KV group (a and p at its first head), four heads per pass where D
// allows; a head dim that is not a multiple of 4 * kW, and a single head left over, go a head at a time.
template <typename R>
RIDGEFILL_INLINE void accumulate_group(float* __restrict__ a, int64_t a_stride, const float* __restrict__ p,
                                       int64_t cap, const R* const* rows, int64_t nt, int64_t D, int64_t G) {
  int64_t g = 0;
  if (D % (4 * kW) == 0) {
    for (; g + 4 <= G; g += 4) accumulate_rows_heads<4>(a + g * a_stride, a_stride, p + g * cap, cap, rows, nt, D);
    if (G - g == 3) {
      accumulate_rows_heads<3>(a + g * a_stride, a_stride, p + g * cap, cap, rows, nt, D);
      return;
    }
    if (G - g == 2) {
      accumulate_rows_heads<2>(a + g * a_stride, a_stride, p + g * cap, cap, rows, nt, D);
      return;
    }
  }
  for (; g < G; ++g) accumulate_rows(a + g * a_stride, p + g * cap, rows, nt, D);
}

// One task: keys [j0, j1) of one row, all heads. Leaves S.m, S.l (max score and sum of exp(s - max) per head)
// and S.acc (unnormalised sum of exp(s - max) * V per head) for the caller.
template <typename T>
RIDGEFILL_ATTN_CLONES void attend_chunk(const Problem<T>& P, int64_t row, int64_t j0, int64_t j1, Scratch& S) {
  const int64_t H = P.heads, G = P.group, D = P.head_dim, Dp = P.dpad, cap = S.cap, n = j1 - j0;
  const int32_t* table = P.tables + static_cast<int64_t>(P.q_seq[row]) * P.max_blocks;
  float* __restrict__ qf = S.qf.data();
  float* __restrict__ scores = S.scores.data();
  float* __restrict__ acc = S.acc.data();
  int64_t* __restrict__ slots = S.slots.data();
  collect_slots(table, P.block_size, j0, j1, slots);
  load_queries(P, row, qf);
  score_keys(P, slots, n, qf, scores, cap, S.ktile.data());

  // Softmax numerators in place.
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores + h * cap;
    int64_t j = 0;
    float m = s[0];
    if (n >= kW) {
      vf vm = loadf(s);
      for (j = kW; j + kW <= n; j += kW) {
        const vf x = loadf(s + j);
        vm = x > vm ? x : vm;
      }
      m = hmax(vm);
    }
    for (; j < n; ++j) m = s[j] > m ? s[j] : m;
    vf vl = {};
    for (j = 0; j + kW <= n; j += kW) {
      const vf e = vexp(loadf(s + j) - m);
      storef(s + j, e);
      vl += e;
    }
    float l = hsum(vl);
    for (; j < n; ++j) {
      s[j] = sexp(s[j] - m);
      l += s[j];
    }
    S.m[h] = m;
    S.l[h] = l;
  }

  // Weighted sum of V, kTile keys at a time, each V row read once for its group's heads (rows two tiles ahead
  // prefetched).
  std::fill(acc, acc + H * Dp, 0.0f);
  const int64_t vs = P.v_slot_stride, vhs = P.v_head_stride;
  for (int64_t i = 0; i < std::min(n, 2 * kTile); ++i) prefetch_slot(P.v + slots[i] * vs, P.kv_heads, vhs, D);
  using R = typename RowType<T>::type;
  const R* rows[kTile];
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t nt = std::min(kTile, n - t0);
    for (int64_t i = t0 + 2 * kTile; i < std::min(n, t0 + 3 * kTile); ++i) {
      prefetch_slot(P.v + slots[i] * vs, P.kv_heads, vhs, D);
    }
    if constexpr (!std::is_same_v<T, R>) widen_rows(P.v, v_group(P, slots + t0, nt), S.vtile.data());
    for (int64_t kvh = 0; kvh < P.kv_heads; ++kvh) {
      for (int64_t i = 0; i < nt; ++i) {
        if constexpr (std::is_same_v<T, R>) {
          rows[i] = P.v + slots[t0 + i] * vs + kvh * vhs;
        } else {
          rows[i] = S.vtile.data() + (i * P.kv_heads + kvh) * Dp;
        }
      }
      if (!std::is_same_v<T, R> && kGroupHeads) {
        accumulate_group(acc + kvh * G * Dp, Dp, scores + kvh * G * cap + t0, cap, rows, nt, D, G);
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = kvh * G + g;
          accumulate_rows(acc + h * Dp, scores + h * cap + t0, rows, nt, D);
        }
      }
    }
  }
  if constexpr (kPairSplit<R>) {  // back to the natural order
    const int64_t d32 = D / (2 * kW) * (2 * kW);
    for (int64_t h = 0; h < H; ++h) {
      float* a = acc + h * Dp;
      for (int64_t c = 0; c < d32; c += 2 * kW) {
        float block[2 * kW];
        for (int64_t i = 0; i < kW; ++i) {
          block[2 * i] = a[c + i];
          block[2 * i + 1] = a[c + kW + i];
        }
        std::copy(block, block + 2 * kW, a + c);
      }
    }
  }
}

// key_mass[b, j0:j1) = sum over b's rows and all heads of exp(s - m) / l, with each (row, head)'s final max m
// and denominator l from the attention pass (stats).
template <typename T>
RIDGEFILL_ATTN_CLONES void key_mass_chunk(const Problem<T>& P, const int64_t* b_rows, int64_t n_b_rows, int64_t b,
                                          int64_t j0, int64_t j1, const float* stats, Scratch& S,
                                          float* __restrict__ mass_out) {
  const int64_t H = P.heads, cap = S.cap;
  const int32_t* table = P.tables + b * P.max_blocks;
  float* __restrict__ mass = S.mass.data();
  float* __restrict__ scores = S.scores.data();
  int64_t* __restrict__ slots = S.slots.data();
  std::fill(mass, mass + (j1 - j0), 0.0f);
  collect_slots(table, P.block_size, j0, j1, slots);
  for (int64_t ri = 0; ri < n_b_rows; ++ri) {
    const int64_t row = b_rows[ri];
    // The row's keys in this chunk: [lo, lo + n), outside them it adds nothing (and reads nothing).
    const int64_t lo = std::max(j0, first_key(P, row));
    const int64_t n = std::min(j1, P.q_pos[row] + 1) - lo;
    if (n <= 0) continue;
    load_queries(P, row, S.qf.data());
    score_keys(P, slots + (lo - j0), n, S.qf.data(), scores, cap, S.ktile.data());
    float* row_mass = mass + (lo - j0);
    for (int64_t h = 0; h < H; ++h) {
      const float* st = stats + (row * H + h) * 2;
      const float m = st[0], inv_l = 1.0f / st[1];
      const float* s = scores + h * cap;
      int64_t j = 0;
      for (; j + kW <= n; j += kW) storef(row_mass + j, loadf(row_mass + j) + vexp(loadf(s + j) - m) * inv_l);
      for (; j < n; ++j) row_mass[j] += sexp(s[j] - m) * inv_l;
    }
  }
  std::copy(mass, mass + (j1 - j0), mass_out + j0);
}

// attend_chunk over any key range: passes of at most S.cap - kKeyGroup keys, merged with log-sum-exp weights.
template <typename T>
void attend_range(const Problem<T>& P, int64_t row, int64_t j0, int64_t j1, Scratch& S) {
  const int64_t step = S.cap - kKeyGroup;
  if (j1 - j0 <= step) {
    attend_chunk<T>(P, row, j0, j1, S);
    return;
  }
  const int64_t H = P.heads, Dp = P.dpad;
  for (int64_t c0 = j0; c0 < j1; c0 += step) {
    attend_chunk<T>(P, row, c0, std::min(j1, c0 + step), S);
    if (c0 == j0) {
      std::swap(S.m, S.run_m);
      std::swap(S.l, S.run_l);
      std::swap(S.acc, S.run_acc);
      continue;
    }
    for (int64_t h = 0; h < H; ++h) {
      const float m = std::max(S.run_m[h], S.m[h]);
      const float wr = std::exp(S.run_m[h] - m), wc = std::exp(S.m[h] - m);
      S.run_m[h] = m;
      S.run_l[h] = S.run_l[h] * wr + S.l[h] * wc;
      float* ra = S.run_acc.data() + h * Dp;
      const float* a = S.acc.data() + h * Dp;
      for (int64_t d = 0; d < P.head_dim; ++d) ra[d] = ra[d] * wr + a[d] * wc;
    }
  }
  std::swap(S.m, S.run_m);
  std::swap(S.l, S.run_l);
  std::swap(S.acc, S.run_acc);
}

// Runs body(scratch, task) for tasks 0..n_tasks-1 on up to `workers` threads, handing tasks out in order.
template <typename F>
void run_tasks(int64_t n_tasks, int64_t workers, int64_t heads, int64_t wide_heads, int64_t dpad, int64_t cap,
               F&& body) {
  if (n_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min(workers, n_tasks)), 1, [&](int64_t, int64_t) {
    Scratch scratch(heads, wide_heads, dpad, cap);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < n_tasks;) body(scratch, t);
  });
}

struct Task {
  int64_t row;
  int64_t j0, j1;
  int64_t part;  // index into the split partials, or -1 when the task is the whole row
};

int split_mode() {
  const char* env = std::getenv("RIDGEFILL_CPU_ATTN_SPLIT");
  if (env != nullptr && env[0] == '0' && env[1] == '\0') return 0;
  if (env != nullptr && env[0] == '1' && env[1] == '\0') return 1;
  return -1;
}

template <typename T>
void run_attention(const Problem<T>& P, int64_t rows, int64_t batch, int64_t max_ctx, T* out, float* key_mass) {
  const int64_t D = P.head_dim, H = P.heads, Dp = P.dpad;
  // float16 and int8 rows are widened into the scratch tiles, every KV head at once; others are read in place.
  const int64_t wide_heads = std::is_same_v<T, typename RowType<T>::type> ? 0 : P.kv_heads;
  const int64_t threads = std::max(1, at::get_num_threads());
  // Keys row r reads: first_key(r)..q_pos[r].
  auto row_keys = [&](int64_t r) { return P.q_pos[r] + 1 - first_key(P, r); };
  int64_t total_keys = 0, longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    total_keys += row_keys(r);
    longest = std::max(longest, row_keys(r));
  }
  const int64_t workers = total_keys * H * D < kSerialWork ? 1 : threads;

  // Keys per task: a row longer than this is split into chunks (0: no split).
  int64_t chunk = 0;
  const int mode = split_mode();
  if (mode == 1) {
    chunk = kMinSplitKeys;
  } else if (mode != 0) {
    const int64_t share = (total_keys + kTasksPerThread * workers - 1) / (kTasksPerThread * workers);
    chunk = workers > 1 ? std::max(kMinSplitKeys, (share + kTile - 1) / kTile * kTile) : 0;
  }
  if (chunk >= longest) chunk = 0;

  // Tasks, the largest first (rows sorted by length, stable so a sequence's rows stay together).
  std::vector<int64_t> order(rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row_keys(a) > row_keys(b); });
  std::vector<Task> tasks;
  std::vector<int64_t> split_rows, part_begin;  // rows cut into chunks; their first part (then a sentinel)
  int64_t n_parts = 0;
  tasks.reserve(rows);
  for (int64_t r : order) {
    const int64_t first = first_key(P, r), end = P.q_pos[r] + 1;
    if (chunk == 0 || end - first <= chunk) {
      tasks.push_back({r, first, end, -1});
      continue;
    }
    split_rows.push_back(r);
    part_begin.push_back(n_parts);
    for (int64_t j0 = first; j0 < end; j0 += chunk) tasks.push_back({r, j0, std::min(end, j0 + chunk), n_parts++});
  }
  part_begin.push_back(n_parts);
  if (chunk > 0) {
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.j1 - a.j0 > b.j1 - b.j0; });
  }

  const int64_t cap = std::max(kMassChunk, std::min(kMaxChunkKeys, chunk > 0 ? chunk : longest));
  const int64_t part_size = H * (D + 2);  // m[H], l[H], acc[H, D]
  std::vector<float> partials(n_parts * part_size);
  std::vector<float> stats(key_mass != nullptr ? rows * H * 2 : 0);  // final (m, l) per (row, head)

  run_tasks(static_cast<int64_t>(tasks.size()), workers, H, wide_heads, Dp, cap, [&](Scratch& S, int64_t t) {
    const Task& task = tasks[t];
    attend_range<T>(P, task.row, task.j0, task.j1, S);
    if (task.part >= 0) {
      float* dst = partials.data() + task.part * part_size;
      std::copy(S.m.begin(), S.m.end(), dst);
      std::copy(S.l.begin(), S.l.end(), dst + H);
      for (int64_t h = 0; h < H; ++h) std::copy_n(S.acc.data() + h * Dp, D, dst + 2 * H + h * D);
      return;
    }
    for (int64_t h = 0; h < H; ++h) {
      const float inv_l = 1.0f / S.l[h];
      const float* a = S.acc.data() + h * Dp;
      if (P.out_f32) {
        float* of = P.out_f32 + (task.row * H + h) * D;
        for (int64_t d = 0; d < D; ++d) of[d] = a[d] * inv_l;
      } else {
        T* o = out + (task.row * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(a[d] * inv_l);
      }
      if (!stats.empty()) {
        stats[(task.row * H + h) * 2] = S.m[h];
        stats[(task.row * H + h) * 2 + 1] = S.l[h];
      }
    }
  });

  // Merge the split rows' chunks with log-sum-exp weights.
  const int64_t n_split = static_cast<int64_t>(split_rows.size());
  if (n_split > 0) {
    at::parallel_for(0, n_split, std::max<int64_t>(1, n_split / workers), [&](int64_t i0, int64_t i1) {
      std::vector<float> acc(D);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row = split_rows[i];
        const float* first = partials.data() + part_begin[i] * part_size;
        const int64_t np = part_begin[i + 1] - part_begin[i];
        for (int64_t h = 0; h < H; ++h) {
          float m = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < np; ++c) m = std::max(m, first[c * part_size + h]);
          float l = 0.0f;
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t c = 0; c < np; ++c) {
            const float* part = first + c * part_size;
            const float w = std::exp(part[h] - m);
            l += part[H + h] * w;
            const float* a = part + 2 * H + h * D;
            for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
          }
          const float inv_l = 1.0f / l;
          if (P.out_f32) {
            float* of = P.out_f32 + (row * H + h) * D;
            for (int64_t d = 0; d < D; ++d) of[d] = acc[d] * inv_l;
          } else {
            T* o = out + (row * H + h) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv_l);
          }
          if (!stats.empty()) {
            stats[(row * H + h) * 2] = m;
            stats[(row * H + h) * 2 + 1] = l;
          }
        }
      }
    });
  }

  if (key_mass == nullptr) return;
  // Key mass: rows grouped by sequence (counting sort), tasks = (sequence, kMassChunk keys) over the keys from the
  // first any of its rows sees (seq_first, past 0 with a window) to the last.
  std::vector<int64_t> seq_begin(batch + 1, 0), seq_keys(batch, 0), b_rows(rows);
  std::vector<int64_t> seq_first(batch, std::numeric_limits<int64_t>::max());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = P.q_seq[r];
    ++seq_begin[b + 1];
    seq_keys[b] = std::max(seq_keys[b], P.q_pos[r] + 1);
    seq_first[b] = std::min(seq_first[b], first_key(P, r));
  }
  for (int64_t b = 0; b < batch; ++b) seq_begin[b + 1] += seq_begin[b];
  {
    std::vector<int64_t> fill(seq_begin.begin(), seq_begin.end() - 1);
    for (int64_t r = 0; r < rows; ++r) b_rows[fill[P.q_seq[r]]++] = r;
  }
  std::vector<std::pair<int64_t, int64_t>> mass_tasks;  // (b, j0)
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j0 = seq_first[b]; j0 < seq_keys[b]; j0 += kMassChunk) mass_tasks.emplace_back(b, j0);
  }
  run_tasks(static_cast<int64_t>(mass_tasks.size()), workers, H, wide_heads, Dp, kMassChunk, [&](Scratch& S, int64_t t) {
    const auto [b, j0] = mass_tasks[t];
    const int64_t j1 = std::min(j0 + kMassChunk, seq_keys[b]);
    key_mass_chunk<T>(P, b_rows.data() + seq_begin[b], seq_begin[b + 1] - seq_begin[b], b, j0, j1, stats.data(), S,
                      key_mass + b * max_ctx);
  });
}

// k_scale / v_scale: null for float slabs; the int8 op's float32 [S, Hkv, G] scales.
std::tuple<at::Tensor, at::Tensor> attention_cpu(
    const char* kName, const at::Tensor& q, const at::Tensor& q_seq, const at::Tensor& q_pos,
    const at::Tensor& k_slab, const at::Tensor& v_slab, const at::Tensor* k_scale, const at::Tensor* v_scale,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size, double scale,
    bool return_key_mass, int64_t window) {
  TORCH_CHECK(q.device().is_cpu(), kName, "q must be a CPU tensor, got ", q.device());
  for (const at::Tensor* t : {&q_seq, &q_pos, &k_slab, &v_slab, &block_tables, &context_lens}) {
    TORCH_CHECK(t->device().is_cpu(), kName, "all tensors must be on the CPU, got ", t->device());
  }
  // The slabs' dtype picks the kernel; float32 queries may read a narrower cache (mixed).
  const auto dtype = k_slab.scalar_type();
  const bool mixed = q.scalar_type() == at::kFloat && dtype != at::kFloat;
  const bool quantized = k_scale != nullptr;
  if (quantized) {
    TORCH_CHECK_TYPE(dtype == at::kChar && v_slab.scalar_type() == at::kChar && q.scalar_type() == at::kFloat,
                     kName, "needs float32 q over int8 k_slab/v_slab; got ", q.scalar_type(), ", ", dtype, ", ",
                     v_slab.scalar_type());
    for (const at::Tensor* s : {k_scale, v_scale}) {
      TORCH_CHECK(s->device().is_cpu(), kName, "all tensors must be on the CPU, got ", s->device());
      TORCH_CHECK_TYPE(s->scalar_type() == at::kFloat, kName, "k_scale/v_scale must be float32, got ",
                       s->scalar_type());
      TORCH_CHECK_VALUE(s->dim() == 3 && s->size(0) == k_slab.size(0) && s->size(1) == k_slab.size(1) &&
                            s->size(2) == (k_slab.size(2) + kInt8Group - 1) / kInt8Group && s->stride(2) == 1,
                        kName, "k_scale/v_scale must be [S, Hkv, G], G = ceil(D / 32), last dim contiguous; got ",
                        s->sizes());
    }
  } else {
    TORCH_CHECK_TYPE((dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                         (q.scalar_type() == dtype || mixed) && v_slab.scalar_type() == dtype,
                     kName, "q, k_slab, v_slab must share a float dtype (float32, bfloat16 or float16), or q be "
                     "float32 over bfloat16/float16 slabs; got ", q.scalar_type(), ", ", dtype, ", ",
                     v_slab.scalar_type());
  }
  TORCH_CHECK_TYPE(q_seq.scalar_type() == at::kInt && q_pos.scalar_type() == at::kLong, kName,
                   "q_seq must be int32 and q_pos int64; got ", q_seq.scalar_type(), " and ", q_pos.scalar_type());
  TORCH_CHECK_TYPE(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt, kName,
                   "block_tables and context_lens must be int32; got ", block_tables.scalar_type(), " and ",
                   context_lens.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3 && k_slab.dim() == 3 && v_slab.sizes() == k_slab.sizes(), kName,
                    "need q [R, H, D], k_slab = v_slab [S, Hkv, D]; got ", q.sizes(), ", ", k_slab.sizes(), ", ",
                    v_slab.sizes());
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_slab.size(1), num_slots = k_slab.size(0);
  TORCH_CHECK_VALUE(k_slab.size(2) == head_dim && kv_heads > 0 && heads % kv_heads == 0, kName, "H=", heads,
                    " must be a multiple of Hkv=", kv_heads, " and head dims must match (", head_dim, " vs ",
                    k_slab.size(2), ")");
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= 256, kName, "head dim must be in [1, 256], got ", head_dim);
  TORCH_CHECK_VALUE(q_seq.dim() == 1 && q_seq.size(0) == rows && q_pos.dim() == 1 && q_pos.size(0) == rows, kName,
                    "q_seq and q_pos must be [R] with R=", rows, "; got ", q_seq.sizes(), " and ", q_pos.sizes());
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && context_lens.dim() == 1 &&
                        context_lens.size(0) == block_tables.size(0),
                    kName, "need block_tables [B, max_blocks] and context_lens [B]; got ", block_tables.sizes(),
                    " and ", context_lens.sizes());
  TORCH_CHECK_VALUE(block_size >= 1, kName, "block_size must be positive, got ", block_size);
  TORCH_CHECK_VALUE(window >= 0, kName, "window must be >= 0 (0 = no sliding window), got ", window);
  // The slabs are the whole KV cache: never copy them.
  TORCH_CHECK_VALUE(k_slab.stride(2) == 1 && v_slab.stride(2) == 1, kName,
                    "k_slab/v_slab need a contiguous last dim");
  const int64_t batch = block_tables.size(0), max_blocks = block_tables.size(1);
  const int64_t max_ctx = max_blocks * block_size;

  at::Tensor out = at::empty({rows, heads, head_dim}, q.options());  // q's dtype (float32 when mixed)
  at::Tensor key_mass = return_key_mass ? at::zeros({batch, max_ctx}, q.options().dtype(at::kFloat))
                                        : at::empty({0}, q.options().dtype(at::kFloat));
  if (rows == 0 || heads == 0) return {out, key_mass};

  // Data-dependent checks (the small index tensors only).
  const at::Tensor seq_c = q_seq.contiguous(), pos_c = q_pos.contiguous();
  const at::Tensor tables_c = block_tables.contiguous(), lens_c = context_lens.contiguous();
  const int32_t* seq = seq_c.const_data_ptr<int32_t>();
  const int64_t* pos = pos_c.const_data_ptr<int64_t>();
  const int32_t* tables = tables_c.const_data_ptr<int32_t>();
  const int32_t* lens = lens_c.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(lens[b] <= max_ctx, kName, "a context is longer than its block table (context_lens[", b,
                      "] = ", lens[b], " > ", max_blocks, " blocks x ", block_size, ")");
  }
  // Keys [seq_first[b], seq_keys[b]) cover every key a row of b reads; with a window the blocks before
  // seq_first[b] are never read, so they need not be valid.
  std::vector<int64_t> seq_keys(batch, 0), seq_first(batch, std::numeric_limits<int64_t>::max());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = seq[r];
    TORCH_CHECK_VALUE(b >= 0 && b < batch, kName, "q_seq out of range: q_seq[", r, "] = ", b, " with B=", batch);
    TORCH_CHECK_VALUE(pos[r] >= 0 && pos[r] < lens[b], kName,
                      "every q_pos must be in [0, context_lens[q_seq]); row ", r, " has q_pos ", pos[r],
                      " but sequence ", b, " has context_lens ", lens[b]);
    seq_keys[b] = std::max(seq_keys[b], pos[r] + 1);
    seq_first[b] = std::min(seq_first[b], window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : int64_t{0});
  }
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = seq_keys[b] > 0 ? seq_first[b] / block_size : 0; i * block_size < seq_keys[b]; ++i) {
      const int64_t block = tables[b * max_blocks + i];
      const int64_t used = std::min(block_size, seq_keys[b] - i * block_size);
      TORCH_CHECK_INDEX(block >= 0 && block * block_size + used <= num_slots, kName, "block_tables[", b, ", ", i,
                        "] = ", block, " points outside k_slab (", num_slots, " slots of block size ", block_size,
                        ")");
    }
  }

  const at::Tensor qc = q.contiguous();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> P{};
    P.q = mixed ? nullptr : qc.const_data_ptr<T>();
    P.q_f32 = mixed ? qc.const_data_ptr<float>() : nullptr;
    P.out_f32 = mixed ? out.data_ptr<float>() : nullptr;
    P.q_seq = seq;
    P.q_pos = pos;
    P.k = k_slab.const_data_ptr<T>();
    P.v = v_slab.const_data_ptr<T>();
    P.k_slot_stride = k_slab.stride(0);
    P.k_head_stride = k_slab.stride(1);
    P.v_slot_stride = v_slab.stride(0);
    P.v_head_stride = v_slab.stride(1);
    if (quantized) {
      P.k_scale = k_scale->const_data_ptr<float>();
      P.v_scale = v_scale->const_data_ptr<float>();
      P.ks_slot_stride = k_scale->stride(0);
      P.ks_head_stride = k_scale->stride(1);
      P.vs_slot_stride = v_scale->stride(0);
      P.vs_head_stride = v_scale->stride(1);
    }
    P.tables = tables;
    P.max_blocks = max_blocks;
    P.block_size = block_size;
    P.heads = heads;
    P.kv_heads = kv_heads;
    P.group = heads / kv_heads;
    P.head_dim = head_dim;
    P.dpad = (head_dim + kW - 1) / kW * kW;
    P.scale = static_cast<float>(scale);
    P.window = window;
    run_attention<T>(P, rows, batch, max_ctx, mixed ? nullptr : out.data_ptr<T>(),
                     return_key_mass ? key_mass.data_ptr<float>() : nullptr);
  };
  switch (dtype) {
    case at::kFloat:
      run(float{});
      break;
    case at::kBFloat16:
      run(c10::BFloat16{});
      break;
    case at::kChar:
      run(int8_t{});
      break;
    default:
      run(c10::Half{});
      break;
  }
  return {out, key_mass};
}

std::tuple<at::Tensor, at::Tensor> scattered_rows_attention_cpu(
    const at::Tensor& q, const at::Tensor& q_seq, const at::Tensor& q_pos, const at::Tensor& k_slab,
    const at::Tensor& v_slab, const at::Tensor& block_tables, const at::Tensor& context_lens,
    int64_t block_size, double scale, bool return_key_mass, int64_t window) {
  return attention_cpu("ridgefill::scattered_rows_attention: ", q, q_seq, q_pos, k_slab, v_slab, nullptr, nullptr,
                       block_tables, context_lens, block_size, scale, return_key_mass, window);
}

std::tuple<at::Tensor, at::Tensor> scattered_rows_attention_int8_cpu(
    const at::Tensor& q, const at::Tensor& q_seq, const at::Tensor& q_pos, const at::Tensor& k_slab,
    const at::Tensor& v_slab, const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
    const at::Tensor& context_lens, int64_t block_size, double scale, bool return_key_mass, int64_t window) {
  return attention_cpu("ridgefill::scattered_rows_attention_int8: ", q, q_seq, q_pos, k_slab, v_slab, &k_scale,
                       &v_scale, block_tables, context_lens, block_size, scale, return_key_mass, window);
}

}  // namespace
}  // namespace ridgefill

TORCH_LIBRARY_IMPL(ridgefill, CPU, m) {
  m.impl("scattered_rows_attention", &ridgefill::scattered_rows_attention_cpu);
  m.impl("scattered_rows_attention_int8", &ridgefill::scattered_rows_attention_int8_cpu);
}
