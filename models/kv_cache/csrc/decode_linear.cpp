// kvlab's linear layers for a few rows (a decode step's 1-8 tokens), on the CPU: y = x W^T + b with W (N, K) in
// nn.Linear's own (out, in) layout, float32, float16 or bfloat16, read once per call in that layout (each thread a
// contiguous range of W's rows, several rows side by side), converted to float32 as it is read, the products summed in
// float32 (as GPUs and llama.cpp sum half-precision products), the bias added in float32, the result rounded once to
// x's dtype. Both cores: ATen's thread pool over W's rows.
//
// Built without -march: each instruction set's kernel is compiled for its own target (GCC's target pragma) and picked
// at run time by what this CPU has (isa_best): AVX-512 (avx512f), AVX2 (avx2 + fma + f16c), or the portable C++ path,
// which every CPU runs and the tests compare the others to. Also here: read_gbps, the machine's read bandwidth
// measured the way these kernels read (every thread streaming its own part of one buffer), the roofline's peak.
// Built on first use by models/kv_cache/kernels.py (torch.utils.cpp_extension).
#ifndef KVLAB_LINEAR_BODY
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVLAB_X86 1
#include <immintrin.h>
#endif

namespace {

enum Isa : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t MAX_ROWS = 8;  // rows per pass over W: more rows are taken 8 at a time

inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }

// Where the results go: y in its own dtype (x's), each float32 sum rounded once as it is stored, so no float32 copy
// of y is made and converted after.
struct Out {
  void* p;
  c10::ScalarType t;
  Out at(int64_t i) const {  // the results from element i on
    const int64_t size = t == c10::ScalarType::Float ? 4 : 2;
    return {static_cast<char*>(p) + i * size, t};
  }
  inline void put(int64_t i, float v) const {
    if (t == c10::ScalarType::Float) static_cast<float*>(p)[i] = v;
    else if (t == c10::ScalarType::Half) static_cast<c10::Half*>(p)[i] = c10::Half(v);
    else static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v);
  }
};

// The portable path: for each of W's rows, 8 partial sums per x row (the lanes of the vector paths), then their sum.
template <typename T>
void rows_portable(const float* x, int64_t R, int64_t K, const T* w, const float* bias, Out y, int64_t N, int64_t o0,
                   int64_t o1) {
  std::vector<float> wf(K);
  for (int64_t o = o0; o < o1; ++o) {
    const T* row = w + o * K;
    for (int64_t k = 0; k < K; ++k) wf[k] = to_f(row[k]);
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * K;
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int j = 0; j < 8; ++j) lane[j] += wf[k + j] * xr[k + j];
      float s = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
      for (; k < K; ++k) s += wf[k] * xr[k];
      y.put(r * N + o, s + (bias ? bias[o] : 0.f));
    }
  }
}

// The portable decode attention of one (sequence, head): as the vector paths compute it, one key at a time.
template <typename T>
void attend_portable(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t n, int64_t hs, float* p,
                     float* out) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    float s = 0;
    for (int64_t c = 0; c < hs; ++c) s += to_f(k[j * ks + c]) * q[c];
    p[j] = s;
    m = std::max(m, s);
  }
  float z = 0;
  for (int64_t j = 0; j < n; ++j) z += (p[j] = std::exp(p[j] - m));
  for (int64_t c = 0; c < hs; ++c) out[c] = 0;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < hs; ++c) out[c] += to_f(v[j * vs + c]) * p[j];
  const float inv = 1.f / z;
  for (int64_t c = 0; c < hs; ++c) out[c] *= inv;
}

#ifdef KVLAB_X86
// ---- AVX2: 8 lanes, 16 registers ---------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
struct V {
  using reg = __m256;
  static constexpr int W = 8;
  static constexpr int REGS = 16;
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline reg load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline reg load(const c10::BFloat16* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static inline reg set1(float x) { return _mm256_set1_ps(x); }
  static inline void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static inline float sum(reg v) {  // the lanes as the portable path adds them: (0+4)+(1+5) + (2+6)+(3+7)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
};
#define KVLAB_LINEAR_BODY 1
#include __FILE__
#undef KVLAB_LINEAR_BODY
}  // namespace avx2
#pragma GCC pop_options

// ---- AVX-512: 16 lanes, 32 registers -----------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace avx512 {
struct V {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr int REGS = 32;
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline reg load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline reg load(const c10::BFloat16* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static inline reg set1(float x) { return _mm512_set1_ps(x); }
  static inline void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static inline float sum(reg v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
};
#define KVLAB_LINEAR_BODY 1
#include __FILE__
#undef KVLAB_LINEAR_BODY
}  // namespace avx512
#pragma GCC pop_options
#endif  // KVLAB_X86

bool isa_supported(int64_t isa) {
#ifdef KVLAB_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == AVX2) return avx2;
  if (isa == AVX512) return avx2 && __builtin_cpu_supports("avx512f");
#endif
  return isa == PORTABLE;
}

int64_t isa_best() { return isa_supported(AVX512) ? AVX512 : isa_supported(AVX2) ? AVX2 : PORTABLE; }

std::string isa_name(int64_t isa) { return isa == AVX512 ? "avx512" : isa == AVX2 ? "avx2" : "portable"; }

template <typename T>
void run_isa(int64_t isa, const float* x, int64_t R, int64_t K, const T* w, const float* bias, Out y, int64_t N,
             int64_t o0, int64_t o1) {
#ifdef KVLAB_X86
  if (isa == AVX512) return avx512::run(x, R, K, w, bias, y, N, o0, o1);
  if (isa == AVX2) return avx2::run(x, R, K, w, bias, y, N, o0, o1);
#endif
  rows_portable(x, R, K, w, bias, y, N, o0, o1);
}

template <typename T>
void linear_rows(int64_t isa, const float* x, int64_t R, int64_t K, const T* w, const float* bias, Out y, int64_t N) {
  // each thread at least ~64 KiB of W (fewer threads for a small layer: a wake-up costs more than its share)
  const int64_t grain = std::max<int64_t>(16, (64 << 10) / std::max<int64_t>(1, K * int64_t(sizeof(T))));
  at::parallel_for(0, N, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t r0 = 0; r0 < R; r0 += MAX_ROWS)
      run_isa(isa, x + r0 * K, std::min(MAX_ROWS, R - r0), K, w, bias, y.at(r0 * N), N, o0, o1);
  });
}

bool kept(c10::ScalarType t) { return t == torch::kFloat || t == torch::kHalf || t == torch::kBFloat16; }

// t's values as float32: t itself where it is float32 already, else a copy in buf (t contiguous, of a kept dtype; a
// few thousand values, one loop, cheaper than an ATen conversion's dispatch).
const float* as_float(const torch::Tensor& t, std::vector<float>& buf) {
  if (t.scalar_type() == torch::kFloat) return t.data_ptr<float>();
  buf.resize(t.numel());
  if (t.scalar_type() == torch::kHalf) {
    const c10::Half* p = t.data_ptr<c10::Half>();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = to_f(p[i]);
  } else {
    const c10::BFloat16* p = t.data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = to_f(p[i]);
  }
  return buf.data();
}

// x (..., K) in any float dtype; w (N, K) contiguous float32, float16 or bfloat16; b (N,) or None; isa: -1 for the
// best this CPU has. Returns (..., N) in x's dtype, written in it by the kernel (float32, float16, bfloat16).
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b, int64_t isa) {
  RECORD_FUNCTION("kvlab::linear", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "w must be a contiguous (N, K) CPU tensor");
  const auto wt = w.scalar_type();
  TORCH_CHECK(kept(wt), "w must be float32, float16 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.is_floating_point() && x.device().is_cpu(),
              "x must be (..., K) floats on the CPU, K = w.size(1)");
  if (isa < 0) isa = isa_best();
  TORCH_CHECK(isa_supported(isa), "this CPU has no ", isa_name(isa), " instructions");
  auto xc = x.reshape({-1, K});
  if (!kept(xc.scalar_type()) || !xc.is_contiguous()) xc = xc.to(torch::kFloat).contiguous();
  std::vector<float> xbuf, bbuf;
  const float* xp = as_float(xc, xbuf);
  const int64_t R = xc.size(0);
  torch::Tensor bc;
  const float* bp = nullptr;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK(b->dim() == 1 && b->size(0) == N, "b must be (N,)");
    bc = *b;
    if (!kept(bc.scalar_type()) || !bc.is_contiguous()) bc = bc.to(torch::kFloat).contiguous();
    bp = as_float(bc, bbuf);
  }
  auto shape = x.sizes().vec();
  shape.back() = N;
  const auto yt = kept(x.scalar_type()) ? x.scalar_type() : torch::kFloat;
  auto y = torch::empty(shape, x.options().dtype(yt));
  const Out out{y.data_ptr(), yt};
  if (R > 0 && N > 0) {
    if (wt == torch::kFloat)
      linear_rows(isa, xp, R, K, w.data_ptr<float>(), bp, out, N);
    else if (wt == torch::kHalf)
      linear_rows(isa, xp, R, K, w.data_ptr<c10::Half>(), bp, out, N);
    else
      linear_rows(isa, xp, R, K, w.data_ptr<c10::BFloat16>(), bp, out, N);
  }
  return yt == x.scalar_type() ? y : y.to(x.scalar_type());
}

template <typename T>
void attend_isa(int64_t isa, const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t n, int64_t hs,
                float* p, float* out) {
#ifdef KVLAB_X86
  if (isa == AVX512) return avx512::attend_one(q, k, ks, v, vs, n, hs, p, out);
  if (isa == AVX2) return avx2::attend_one(q, k, ks, v, vs, n, hs, p, out);
#endif
  attend_portable(q, k, ks, v, vs, n, hs, p, out);
}

template <typename T>
void attention_heads(int64_t isa, const float* q, const torch::Tensor& k, const torch::Tensor& v, float* out,
                     int64_t B, int64_t nh, int64_t hs) {
  const int64_t nkv = k.size(1), n = k.size(2), groups = nh / nkv;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  at::parallel_for(0, B * nh, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> p(n);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / nh, g = u % nh / groups;  // the K/V head this query head reads
      attend_isa(isa, q + u * hs, kp + b * k.stride(0) + g * k.stride(1), k.stride(2),
                 vp + b * v.stride(0) + g * v.stride(1), v.stride(2), n, hs, p.data(), out + u * hs);
    }
  });
}

// A decode step's attention over dense K/V, in float32: q (B, nh, 1, hs) in any float dtype, k and v (B, nkv, n, hs)
// of one dtype (float32, float16 or bfloat16: read as the cache stores them, never copied; each row contiguous, any
// other strides), nkv dividing nh (a K/V head serves its group of query heads), no mask: every query sees all n
// keys. Returns (B, nh, 1, hs) in q's dtype, rounded once.
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t isa) {
  RECORD_FUNCTION("kvlab::decode_attention", c10::ArrayRef<c10::IValue>({}));
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1, "q (B, nh, 1, hs), k and v 4-d");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(3);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(3) == hs && k.size(2) > 0 && nh % k.size(1) == 0,
              "k and v (B, nkv, n > 0, hs) with nkv dividing nh");
  TORCH_CHECK(q.is_floating_point() && v.scalar_type() == k.scalar_type() && k.stride(3) == 1 && v.stride(3) == 1 &&
              q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "q floats, k and v of one dtype, on the CPU, each K/V row contiguous");
  if (isa < 0) isa = isa_best();
  TORCH_CHECK(isa_supported(isa), "this CPU has no ", isa_name(isa), " instructions");
  auto qf = (q.to(torch::kFloat) * (1.0 / std::sqrt(double(hs)))).contiguous();
  auto out = torch::empty({B, nh, 1, hs}, qf.options());
  const auto t = k.scalar_type();
  if (t == torch::kFloat)
    attention_heads<float>(isa, qf.data_ptr<float>(), k, v, out.data_ptr<float>(), B, nh, hs);
  else if (t == torch::kHalf)
    attention_heads<c10::Half>(isa, qf.data_ptr<float>(), k, v, out.data_ptr<float>(), B, nh, hs);
  else if (t == torch::kBFloat16)
    attention_heads<c10::BFloat16>(isa, qf.data_ptr<float>(), k, v, out.data_ptr<float>(), B, nh, hs);
  else
    TORCH_CHECK(false, "k and v must be float32, float16 or bfloat16");
  return out.to(q.scalar_type());
}

// The sum of p[0 .. n) (n a multiple of 64) with the widest loads this CPU has: one thread's part of a read pass.
float read_part(int64_t isa, const float* p, int64_t n) {
#ifdef KVLAB_X86
  if (isa == AVX512) return avx512::read(p, n);
  if (isa == AVX2) return avx2::read(p, n);
#endif
  float s = 0;
  for (int64_t i = 0; i < n; ++i) s += p[i];
  return s;
}

// One pass over buf's first floats (a multiple of 64), every thread streaming its own contiguous part: their sum.
double read_pass(const torch::Tensor& buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == torch::kFloat, "buf: contiguous float32");
  const int64_t chunks = buf.numel() / 64, isa = isa_best();
  const float* p = buf.data_ptr<float>();
  std::vector<double> part(at::get_num_threads() + 1, 0.0);
  at::parallel_for(0, chunks, 1024, [&](int64_t c0, int64_t c1) {
    part[at::get_thread_num()] += read_part(isa, p + c0 * 64, (c1 - c0) * 64);
  });
  double s = 0;
  for (double v : part) s += v;
  return s;
}

// The machine's read bandwidth as these kernels read: GB/s of each of `repeats` passes over buf.
std::vector<double> read_gbps(torch::Tensor buf, int64_t repeats) {
  std::vector<double> out;
  volatile double sink = 0;
  for (int64_t rep = 0; rep < repeats; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = sink + read_pass(buf);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.push_back(double(buf.numel() / 64 * 64) * 4 / dt / 1e9);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x W^T + b for a few rows, W (N, K) read once, float32 sums", py::arg("x"),
        py::arg("w"), py::arg("b") = py::none(), py::arg("isa") = -1);
  m.def("attention", &attention, "a decode step's attention over dense K/V, float32 math", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("isa") = -1);
  m.def("isa_supported", &isa_supported, "whether this CPU runs the path (0 portable, 1 avx2, 2 avx512)");
  m.def("isa_best", &isa_best, "the widest path this CPU runs");
  m.def("isa_name", &isa_name, "a path's name");
  m.def("read_gbps", &read_gbps, "GB/s of each of `repeats` reads of buf, every thread its own part");
  m.def("read_sum", &read_pass, "the sum of buf's first floats (a multiple of 64), read as read_gbps reads");
}

#else  // KVLAB_LINEAR_BODY: the kernels of one instruction set, written against its V (above, per namespace)

// One tile: TO of W's rows o, o + step, ..., o + (TO - 1) step against R rows of x, each W vector read once and used R
// times.
template <int R, int TO, typename T>
inline void tile(const float* x, int64_t K, const T* w, const float* bias, Out y, int64_t N, int64_t o,
                 int64_t step = 1) {
  typename V::reg acc[TO][R];
#pragma GCC unroll 16
  for (int t = 0; t < TO; ++t)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[t][r] = V::zero();
  const int64_t Kv = K / V::W * V::W;
  for (int64_t k = 0; k < Kv; k += V::W) {
    typename V::reg wv[TO];
#pragma GCC unroll 16
    for (int t = 0; t < TO; ++t) wv[t] = V::load(w + (o + t * step) * K + k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const typename V::reg xv = V::load(x + r * K + k);
#pragma GCC unroll 16
      for (int t = 0; t < TO; ++t) acc[t][r] = V::fma(wv[t], xv, acc[t][r]);
    }
  }
  for (int t = 0; t < TO; ++t)
    for (int r = 0; r < R; ++r) {
      float s = V::sum(acc[t][r]);
      const int64_t ot = o + t * step;
      for (int64_t k = Kv; k < K; ++k) s += to_f(w[ot * K + k]) * x[r * K + k];
      y.put(r * N + ot, s + (bias ? bias[ot] : 0.f));
    }
}

// How many of W's rows a tile takes for R rows of x (R > 1): as many accumulators as fit beside the W vectors and one
// x, each W vector used R times.
template <int R>
constexpr int tile_rows() {
  constexpr int fit = (V::REGS - 2) / (R + 1);
  return fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

// W's rows [o0, o1) against R rows of x. One row of x (a sequence's decode step): the rows' two halves side by side,
// so that the thread reads W as two long sequential streams, which the hardware prefetcher follows; neighbouring rows
// side by side are short streams (a row is K values, half as many bytes in fp16), which it followed too late to read
// at the machine's rate. A row's sums are the same in any tile (one accumulator per (W row, x row), k in order), so a
// sequence alone and in a batch gets the same bits.
template <int R, typename T>
void rows(const float* x, int64_t K, const T* w, const float* bias, Out y, int64_t N, int64_t o0, int64_t o1) {
  if constexpr (R == 1) {
    const int64_t half = (o1 - o0) / 2;
    for (int64_t i = 0; i < half; ++i) tile<1, 2>(x, K, w, bias, y, N, o0 + i, half);
    if ((o1 - o0) % 2) tile<1, 1>(x, K, w, bias, y, N, o1 - 1);
    return;
  }
  constexpr int TO = tile_rows<R>();
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) tile<R, TO>(x, K, w, bias, y, N, o);
  for (; o < o1; ++o) tile<R, 1>(x, K, w, bias, y, N, o);
}

template <typename T>
void run(const float* x, int64_t R, int64_t K, const T* w, const float* bias, Out y, int64_t N, int64_t o0,
         int64_t o1) {
  switch (R) {
    case 1: return rows<1>(x, K, w, bias, y, N, o0, o1);
    case 2: return rows<2>(x, K, w, bias, y, N, o0, o1);
    case 3: return rows<3>(x, K, w, bias, y, N, o0, o1);
    case 4: return rows<4>(x, K, w, bias, y, N, o0, o1);
    case 5: return rows<5>(x, K, w, bias, y, N, o0, o1);
    case 6: return rows<6>(x, K, w, bias, y, N, o0, o1);
    case 7: return rows<7>(x, K, w, bias, y, N, o0, o1);
    default: return rows<8>(x, K, w, bias, y, N, o0, o1);
  }
}

// One (sequence, head) of a decode step's attention, in float32: q (hs, scaled already) against n keys at
// k + j * ks, their values at v + j * vs; p: room for n floats; out (hs) gets softmax(q . K^T) . V.
template <typename T>
void attend_one(const float* q, const T* k, int64_t ks, const T* v, int64_t vs, int64_t n, int64_t hs, float* p,
                float* out) {
  const int64_t hv = hs / V::W * V::W;
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // four keys at a time: four independent sums
    typename V::reg a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    const T *k0 = k + j * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
    for (int64_t c = 0; c < hv; c += V::W) {
      const typename V::reg qv = V::load(q + c);
      a0 = V::fma(V::load(k0 + c), qv, a0);
      a1 = V::fma(V::load(k1 + c), qv, a1);
      a2 = V::fma(V::load(k2 + c), qv, a2);
      a3 = V::fma(V::load(k3 + c), qv, a3);
    }
    float s[4] = {V::sum(a0), V::sum(a1), V::sum(a2), V::sum(a3)};
    const T* kk[4] = {k0, k1, k2, k3};
    for (int i = 0; i < 4; ++i) {
      for (int64_t c = hv; c < hs; ++c) s[i] += to_f(kk[i][c]) * q[c];
      p[j + i] = s[i];
      m = std::max(m, s[i]);
    }
  }
  for (; j < n; ++j) {
    const T* kj = k + j * ks;
    typename V::reg a = V::zero();
    for (int64_t c = 0; c < hv; c += V::W) a = V::fma(V::load(kj + c), V::load(q + c), a);
    float s = V::sum(a);
    for (int64_t c = hv; c < hs; ++c) s += to_f(kj[c]) * q[c];
    p[j] = s;
    m = std::max(m, s);
  }
  float z = 0;
  for (j = 0; j < n; ++j) z += (p[j] = std::exp(p[j] - m));
  for (int64_t c = 0; c < hs; ++c) out[c] = 0;
  for (j = 0; j < n; ++j) {
    const T* vj = v + j * vs;
    const typename V::reg pj = V::set1(p[j]);
    for (int64_t c = 0; c < hv; c += V::W) V::store(out + c, V::fma(V::load(vj + c), pj, V::load(out + c)));
    for (int64_t c = hv; c < hs; ++c) out[c] += to_f(vj[c]) * p[j];
  }
  const float inv = 1.f / z;
  for (int64_t c = 0; c < hs; ++c) out[c] *= inv;
}

// The sum of n floats (a multiple of 64): a pass that only reads, its two halves side by side (two sequential streams,
// as the linear kernel reads a thread's rows of W for one sequence), two vectors of each at a time.
inline float read(const float* p, int64_t n) {
  typename V::reg a = V::zero(), b = V::zero(), c = V::zero(), d = V::zero();
  const int64_t h = n / (4 * V::W) * (2 * V::W);  // the first half, a multiple of two vectors
  for (int64_t i = 0; i < h; i += 2 * V::W) {
    a = V::add(a, V::load(p + i));
    b = V::add(b, V::load(p + i + V::W));
    c = V::add(c, V::load(p + h + i));
    d = V::add(d, V::load(p + h + i + V::W));
  }
  for (int64_t i = 2 * h; i < n; i += V::W) a = V::add(a, V::load(p + i));
  return V::sum(a) + V::sum(b) + V::sum(c) + V::sum(d);
}

#endif  // KVLAB_LINEAR_BODY
