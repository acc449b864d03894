// Decode attention where a cache kind stores K and V, on the CPU, parallel over batch rows x heads, float32 math:
// - quant: the two reductions that read the quantised history (q . K^T and p . V), each reading the packed bytes and
//   their fp16 scales where they lie, one token row at a time, with no dequantised copy (scores, weighted), and
//   the whole decode attention of a layer over the cache's own tensors (attention); the step's tokens quantised
//   per token, into their slots (quantize_into) or as new tensors (quantize_tokens). Either scheme: asymmetric (a
//   scale and a minimum per group) or symmetric (a scale only, codes stored as q + N, N = 2^(bits - 1): wherever a
//   minimum is read, an empty minimum tensor stands for -N * scale, exact in float32);
// - paged: the whole attention of one query, reading each key and value row through the block table (paged).
// Built on first use by models/kv_cache/kernels.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// The scales and minimums are stored as fp16 (2 bytes each, as the kind's nbytes formula counts them) and read as
// such: one conversion per value read, the hardware's where the CPU has it.
inline float h2f(c10::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// One token row of `bits`-bit values packed along the channels, as floats; `out` has room for nb * (8 / bits).
template <int BITS>
inline void unpack_row(const uint8_t* p, int64_t nb, float* out) {
  constexpr int PER = 8 / BITS;
  constexpr int MASK = (1 << BITS) - 1;
#pragma omp simd
  for (int64_t b = 0; b < nb; ++b) {
    const int x = p[b];
    for (int i = 0; i < PER; ++i) out[b * PER + i] = static_cast<float>((x >> (BITS * i)) & MASK);
  }
}

constexpr int64_t MAX_HS = 256;  // the most channels a head may have (GPT-2's: 64); rows unpack on the stack

// Where one (sequence, head) row of the quantised history lies: packed bytes (S slots of nb), scales and minimums
// (ns slots of sw), and its layout (bits come as the template argument).
struct Packed {
  const uint8_t* q;
  const c10::Half* scale;
  const c10::Half* lo;  // null: the symmetric scheme, no minimum stored (its minimum is neg_offset * scale)
  int64_t nb, sw;
  bool channel;  // a scale and minimum per channel for each group of G tokens; else per token for each G channels
  int64_t G;
  float neg_offset;  // -2^(bits - 1): symmetric codes are stored as q + 2^(bits - 1)
};

// Group i's minimum, given its scale s (read already): the stored one, or -N * s for the symmetric scheme.
inline float low(const Packed& x, int64_t i, float s) { return x.lo ? h2f(x.lo[i]) : x.neg_offset * s; }

// Scratch for one row: per-group query sums (the unpacked row and the scaled query live on the stack).
struct Scratch {
  std::vector<float> qg;
  Scratch(int64_t hs, int64_t G) : qg((hs + G - 1) / G) {}
};

// o[j] = sum_c q[c] * (lo + value * scale) for the first n tokens of one row.
template <int BITS>
void score_row(const float* qq, const Packed& k, int64_t hs, int64_t n, float* o, Scratch& w) {
  const int64_t G = k.G, nb = k.nb, sw = k.sw;  // locals: no store through o can change them
  const uint8_t* pk = k.q;
  const c10::Half* scale = k.scale;
  alignas(64) float vals[MAX_HS + 8], qs[MAX_HS];
  float* qg = w.qg.data();
  if (k.channel) {  // fold each group's scales into the query, its minimums into one constant
    float ql = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      if (j % G == 0) {
        const c10::Half* s = scale + (j / G) * hs;
        ql = 0.f;
        for (int64_t c = 0; c < hs; ++c) {
          const float sc = h2f(s[c]);
          qs[c] = qq[c] * sc;
          ql += qq[c] * low(k, (j / G) * hs + c, sc);
        }
      }
      unpack_row<BITS>(pk + j * nb, nb, vals);
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < hs; ++c) acc += qs[c] * vals[c];
      o[j] = acc + ql;
    }
    return;
  }
  const int64_t ng = (hs + G - 1) / G;  // per token: a scale and minimum for each group of G channels
  for (int64_t g = 0; g < ng; ++g) {
    qg[g] = 0.f;
    for (int64_t c = g * G; c < std::min(hs, (g + 1) * G); ++c) qg[g] += qq[c];
  }
  for (int64_t j = 0; j < n; ++j) {
    unpack_row<BITS>(pk + j * nb, nb, vals);
    float acc = 0.f;
    for (int64_t g = 0; g < ng; ++g) {
      float part = 0.f;
      const int64_t c1 = std::min(hs, (g + 1) * G);
#pragma omp simd reduction(+ : part)
      for (int64_t c = g * G; c < c1; ++c) part += qq[c] * vals[c];
      const float sg = h2f(scale[j * sw + g]);
      acc += part * sg + qg[g] * low(k, j * sw + g, sg);
    }
    o[j] = acc;
  }
}

// o[c] += sum_j p[j] * (lo + value * scale) over the first n tokens of one row.
template <int BITS>
void weighted_row(const float* pp, const Packed& v, int64_t hs, int64_t n, float* o, Scratch& w) {
  const int64_t G = v.G, nb = v.nb, sw = v.sw;  // locals: no store through o can change them
  const uint8_t* pk = v.q;
  const c10::Half* scale = v.scale;
  alignas(64) float vals[MAX_HS + 8], acc[MAX_HS];
  if (v.channel) {  // per group of G tokens: sum p * value, then one scale and minimum per channel
    for (int64_t g0 = 0; g0 < n; g0 += G) {
      float psum = 0.f;
      for (int64_t c = 0; c < hs; ++c) acc[c] = 0.f;
      for (int64_t j = g0; j < std::min(n, g0 + G); ++j) {
        unpack_row<BITS>(pk + j * nb, nb, vals);
        const float pj = pp[j];
        psum += pj;
#pragma omp simd
        for (int64_t c = 0; c < hs; ++c) acc[c] += pj * vals[c];
      }
      const c10::Half* s = scale + (g0 / G) * hs;
      for (int64_t c = 0; c < hs; ++c) {
        const float sc = h2f(s[c]);
        o[c] += acc[c] * sc + psum * low(v, (g0 / G) * hs + c, sc);
      }
    }
    return;
  }
  const int64_t ng = (hs + G - 1) / G;  // per token: its own scale and minimum per group of G channels
  for (int64_t j = 0; j < n; ++j) {
    unpack_row<BITS>(pk + j * nb, nb, vals);
    const float pj = pp[j];
    for (int64_t g = 0; g < ng; ++g) {
      const float sg = h2f(scale[j * sw + g]);
      const float wg = pj * sg, ug = pj * low(v, j * sw + g, sg);
      const int64_t c1 = std::min(hs, (g + 1) * G);
#pragma omp simd
      for (int64_t c = g * G; c < c1; ++c) o[c] += wg * vals[c] + ug;
    }
  }
}

// GPT-2's heads (64 channels) with K per channel and V per token in groups of 32 channels (the kind's defaults), the
// row left packed: byte b holds channels b * PER + i (i < PER) in its bit fields, so the query (K) and the
// accumulator (V) are kept as PER planes of NB values, plane i holding field i's channels, and each token's row is
// one pass over its NB bytes with every size a compile-time constant (what lets the loop vectorise whole: the same
// loops with sizes known only at run time were slower than unpacking each row first; docs/cache-kinds.md has the
// figures). 8-bit K keeps the plain path (no fields to take out).
constexpr int64_t HS64 = 64, G32 = 32;

template <int BITS>
struct Row64 {
  static constexpr int PER = 8 / BITS, MASK = (1 << BITS) - 1;
  static constexpr int64_t NB = HS64 / PER, GB = G32 / PER;  // bytes a row, bytes a group of 32 channels
  static inline int64_t at(int64_t c) { return (c % PER) * NB + c / PER; }  // channel c in plane storage
  static inline float field(int x, int i) { return static_cast<float>((x >> (BITS * i)) & MASK); }
};

template <int BITS>
void score_row64(const float* qq, const Packed& k, int64_t n, float* o) {  // K per channel, groups of G tokens
  using R = Row64<BITS>;
  alignas(64) float qp[HS64];
  float ql = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    if (j % k.G == 0) {  // the group's scales folded into the query planes, its minimums into one constant
      const int64_t g = (j / k.G) * HS64;
      ql = 0.f;
      for (int64_t c = 0; c < HS64; ++c) {
        const float sc = h2f(k.scale[g + c]);
        qp[R::at(c)] = qq[c] * sc;
        ql += qq[c] * low(k, g + c, sc);
      }
    }
    const uint8_t* __restrict__ p = k.q + j * R::NB;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t b = 0; b < R::NB; ++b) {
      const int x = p[b];
      for (int i = 0; i < R::PER; ++i) acc += qp[i * R::NB + b] * R::field(x, i);
    }
    o[j] = acc + ql;
  }
}

template <int BITS>
void weighted_row64(const float* pp, const Packed& v, int64_t n, float* o) {  // V per token, groups of 32 channels
  using R = Row64<BITS>;
  alignas(64) float a[HS64] = {0.f};
  float u0 = 0.f, u1 = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* __restrict__ p = v.q + j * R::NB;
    const float s0 = h2f(v.scale[j * v.sw]), s1 = h2f(v.scale[j * v.sw + 1]);
    const float w0 = pp[j] * s0, w1 = pp[j] * s1;
    u0 += pp[j] * low(v, j * v.sw, s0);
    u1 += pp[j] * low(v, j * v.sw + 1, s1);
#pragma omp simd
    for (int64_t b = 0; b < R::GB; ++b) {
      const int x = p[b];
      for (int i = 0; i < R::PER; ++i) a[i * R::NB + b] += w0 * R::field(x, i);
    }
#pragma omp simd
    for (int64_t b = R::GB; b < R::NB; ++b) {
      const int x = p[b];
      for (int i = 0; i < R::PER; ++i) a[i * R::NB + b] += w1 * R::field(x, i);
    }
  }
  for (int64_t c = 0; c < HS64; ++c) o[c] += a[R::at(c)] + (c < G32 ? u0 : u1);
}

inline bool row64(int bits, const Packed& x, int64_t hs, bool want_channel) {
  return hs == HS64 && x.nb * (8 / bits) == HS64 && x.channel == want_channel && (want_channel || x.G == G32);
}

inline void score_any(int bits, const float* qq, const Packed& k, int64_t hs, int64_t n, float* o, Scratch& w) {
  if (bits != 8 && row64(bits, k, hs, true)) {  // 8-bit rows need no unpacking: the plain loop below is faster
    if (bits == 4) score_row64<4>(qq, k, n, o);
    if (bits == 2) score_row64<2>(qq, k, n, o);
    return;
  }
  if (bits == 8) score_row<8>(qq, k, hs, n, o, w);
  if (bits == 4) score_row<4>(qq, k, hs, n, o, w);
  if (bits == 2) score_row<2>(qq, k, hs, n, o, w);
}

inline void weighted_any(int bits, const float* pp, const Packed& v, int64_t hs, int64_t n, float* o, Scratch& w) {
  if (row64(bits, v, hs, false)) {
    if (bits == 8) weighted_row64<8>(pp, v, n, o);
    if (bits == 4) weighted_row64<4>(pp, v, n, o);
    if (bits == 2) weighted_row64<2>(pp, v, n, o);
    return;
  }
  if (bits == 8) weighted_row<8>(pp, v, hs, n, o, w);
  if (bits == 4) weighted_row<4>(pp, v, hs, n, o, w);
  if (bits == 2) weighted_row<2>(pp, v, hs, n, o, w);
}

// Row bh of a (BH, S, nb) packed tensor and its (BH, ns, sw) scales (and minimums; an empty lo: symmetric).
inline Packed row_of(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& lo, int64_t bh,
                     bool channel, int64_t G, int64_t bits) {
  const int64_t S = packed.size(1), nb = packed.size(2), ns = scale.size(1), sw = scale.size(2);
  const c10::Half* mins = lo.numel() ? lo.data_ptr<c10::Half>() + bh * ns * sw : nullptr;
  return Packed{packed.data_ptr<uint8_t>() + bh * S * nb, scale.data_ptr<c10::Half>() + bh * ns * sw, mins, nb, sw,
                channel, G, -static_cast<float>(int64_t{1} << (bits - 1))};
}

void check(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& lo) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3,
              "packed: contiguous uint8 (BH, S, bytes)");
  TORCH_CHECK(scale.dtype() == torch::kHalf && scale.is_contiguous() && scale.dim() == 3,
              "scale: contiguous float16 (BH, slots, per slot)");
  TORCH_CHECK(lo.numel() == 0 || (lo.dtype() == torch::kHalf && lo.is_contiguous() && lo.sizes() == scale.sizes()),
              "lo: contiguous float16 of the scales' shape, or empty (the symmetric scheme: no minimum stored)");
}

}  // namespace

torch::Tensor scores(torch::Tensor q, torch::Tensor packed, torch::Tensor scale, torch::Tensor lo, int64_t n,
                     int64_t bits, bool channel, int64_t G) {
  check(packed, scale, lo);
  TORCH_CHECK(q.dtype() == torch::kFloat && q.is_contiguous() && q.dim() == 2, "q: contiguous float32 (BH, hs)");
  const int64_t BH = packed.size(0), S = packed.size(1), nb = packed.size(2), hs = q.size(1);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  TORCH_CHECK(hs <= MAX_HS, "hs ", hs, " > ", MAX_HS, " channels a head may have here");
  TORCH_CHECK(nb * (8 / bits) >= hs && nb * (8 / bits) <= MAX_HS + 8 && n <= S && q.size(0) == BH,
              "packed rows too short (or long) for hs, or n > slots");
  auto out = torch::empty({BH, n}, q.options());
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    Scratch w(hs, G);
    for (int64_t bh = b0; bh < b1; ++bh)
      score_any(bits, q.data_ptr<float>() + bh * hs, row_of(packed, scale, lo, bh, channel, G, bits), hs, n,
                out.data_ptr<float>() + bh * n, w);
  });
  return out;
}

torch::Tensor weighted(torch::Tensor p, torch::Tensor packed, torch::Tensor scale, torch::Tensor lo, int64_t n,
                       int64_t hs, int64_t bits, bool channel, int64_t G) {
  check(packed, scale, lo);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  TORCH_CHECK(hs <= MAX_HS, "hs ", hs, " > ", MAX_HS, " channels a head may have here");
  const int64_t BH = packed.size(0), S = packed.size(1), nb = packed.size(2);
  TORCH_CHECK(p.dtype() == torch::kFloat && p.dim() == 2 && p.stride(1) == 1 && p.size(0) == BH && p.size(1) >= n,
              "p: float32 (BH, >= n), rows contiguous");
  TORCH_CHECK(nb * (8 / bits) >= hs && nb * (8 / bits) <= MAX_HS + 8 && n <= S,
              "packed rows too short (or long) for hs, or n > slots");
  auto out = torch::zeros({BH, hs}, p.options());
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    Scratch w(hs, G);
    for (int64_t bh = b0; bh < b1; ++bh)
      weighted_any(bits, p.data_ptr<float>() + bh * p.stride(0), row_of(packed, scale, lo, bh, channel, G, bits), hs,
                   n, out.data_ptr<float>() + bh * hs, w);
  });
  return out;
}

// (L, B, nh, ...) -> layer's (B * nh, ...); (B, nh, ...) -> (B * nh, ...); an empty stand-in as it is.
inline torch::Tensor at_layer(const torch::Tensor& t, int64_t layer) {
  if (t.dim() == 5) return t.select(0, layer).flatten(0, 1);
  return t.dim() == 4 ? t.flatten(0, 1) : t;
}

// The whole decode attention of the quant kind, one (sequence, head) row per task: scores over the first n_k
// tokens from packed K, then over K's full-precision tail (tokens n_k .. n - 1), a softmax, then p . V over the
// first n_v tokens from packed V and over V's tail. The arguments are the cache's tensors as it holds them, (L, B,
// nh, ...), of which layer `layer` is read (or one layer's, (B, nh, ...)): q (B, nh, 1, hs) in the compute dtype, scaled by qscale here; rot (hs, hs) or empty: K and V
// were rotated before quantising, so packed K is scored with q . rot and packed V's share rotated back once after
// its sum (the tails are not rotated); packed bytes uint8 (B, nh, slots, bytes), scales and minimums fp16 (B, nh,
// slots, per slot; a side's minimums empty: the symmetric scheme), tails (B, nh, >= n - n_k / n - n_v, hs) in the
// storage dtype. A side with nothing packed (its axis "none", or no group full yet) has n_k (n_v) = 0 and its packed
// arguments are not read. Returns q's shape and dtype. The same sums as quant.stored_attention, in one call: no
// per-layer torch glue around it.
torch::Tensor attention(int64_t layer, torch::Tensor q, torch::Tensor rot, torch::Tensor kq, torch::Tensor ks,
                        torch::Tensor kl, int64_t n_k, torch::Tensor kt, int64_t kbits, bool kchan, torch::Tensor vq,
                        torch::Tensor vs, torch::Tensor vl, int64_t n_v, torch::Tensor vt, int64_t vbits, bool vchan,
                        int64_t n, int64_t G, double qscale) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1, "q: (B, nh, 1, hs)");
  const int64_t hs = q.size(3);
  auto rows = [&](const torch::Tensor& t) { return at_layer(t, layer); };
  auto qf = (q.reshape({-1, hs}).to(torch::kFloat) * qscale).contiguous();
  const bool apart = rot.numel() > 0;
  auto qk = apart ? torch::matmul(qf, rot.to(torch::kFloat)).contiguous() : qf;
  kq = rows(kq), ks = rows(ks), kl = rows(kl), vq = rows(vq), vs = rows(vs), vl = rows(vl);
  kt = rows(kt).to(torch::kFloat), vt = rows(vt).to(torch::kFloat);
  const int64_t BH = qf.size(0);
  // grouped-query attention: consecutive query heads share a K/V head, so query row bh reads K/V row bh / groups
  const int64_t BKV = kt.size(0), groups = BKV > 0 ? BH / BKV : 0;
  TORCH_CHECK(BKV > 0 && groups * BKV == BH && vt.size(0) == BKV,
              "K/V heads must divide the query heads (tails: (B, n_kv_head, tokens, hs))");
  TORCH_CHECK(hs <= MAX_HS, "hs ", hs, " > ", MAX_HS, " channels a head may have here");
  TORCH_CHECK(n >= 1 && 0 <= n_k && n_k <= n && 0 <= n_v && n_v <= n, "token counts out of range");
  for (const auto& t : {kt, vt})
    TORCH_CHECK(t.dim() == 3 && t.size(2) == hs && t.stride(2) == 1,
                "tails: (B, n_kv_head, tokens, hs), rows contiguous");
  TORCH_CHECK(kt.size(1) >= n - n_k && vt.size(1) >= n - n_v, "a tail is shorter than its tokens");
  if (n_k) {
    check(kq, ks, kl);
    TORCH_CHECK(kq.size(0) == BKV && n_k <= kq.size(1) && kq.size(2) * (8 / kbits) >= hs &&
                kq.size(2) * (8 / kbits) <= MAX_HS + 8, "packed K disagrees");
  }
  if (n_v) {
    check(vq, vs, vl);
    TORCH_CHECK(vq.size(0) == BKV && n_v <= vq.size(1) && vq.size(2) * (8 / vbits) >= hs &&
                vq.size(2) * (8 / vbits) <= MAX_HS + 8, "packed V disagrees");
  }
  auto out = apart ? torch::zeros({2, BH, hs}, qf.options()) : torch::zeros({BH, hs}, qf.options());
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    Scratch wk(hs, G), wv(hs, G);
    std::vector<float> sc(n);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t kv = bh / groups;  // the K/V head this query head reads
      const float* qq = qf.data_ptr<float>() + bh * hs;
      if (n_k)
        score_any(kbits, qk.data_ptr<float>() + bh * hs, row_of(kq, ks, kl, kv, kchan, G, kbits), hs, n_k, sc.data(),
                  wk);
      const float* ktr = kt.data_ptr<float>() + kv * kt.stride(0);
      for (int64_t j = n_k; j < n; ++j) {
        const float* k = ktr + (j - n_k) * kt.stride(1);
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t c = 0; c < hs; ++c) d += qq[c] * k[c];
        sc[j] = d;
      }
      const float mx = *std::max_element(sc.begin(), sc.end());
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) { sc[j] = std::exp(sc[j] - mx); total += sc[j]; }
      for (int64_t j = 0; j < n; ++j) sc[j] /= total;
      float* o = out.data_ptr<float>() + bh * hs;
      if (n_v) weighted_any(vbits, sc.data(), row_of(vq, vs, vl, kv, vchan, G, vbits), hs, n_v, o, wv);
      if (apart) o += BH * hs;  // the tail's share apart
      const float* vtr = vt.data_ptr<float>() + kv * vt.stride(0);
      for (int64_t j = n_v; j < n; ++j) {
        const float* v = vtr + (j - n_v) * vt.stride(1);
        const float pj = sc[j];
#pragma omp simd
        for (int64_t c = 0; c < hs; ++c) o[c] += pj * v[c];
      }
    }
  });
  if (apart) out = torch::matmul(out[0], rot.to(torch::kFloat)) + out[1];
  return out.view(q.sizes()).to(q.scalar_type());
}

// One query per sequence and head over its first lens[b] tokens, each key and value row read through the block
// table: out[b, h] = softmax_t(q . k_t) . v, k_t = pool[h / groups, tab[b, t / bs] * bs + t % bs] (consecutive query
// heads share a K/V head: groups = nh / the pool's heads); q is pre-scaled. In a
// ragged batch every sequence has its own length (the keys a decode step's mask lets it see).
template <typename T>
void paged_impl(const float* q, const T* pk, const T* pv, const int64_t* tab, const int64_t* lens, float* out,
                int64_t B, int64_t nh, int64_t width, int64_t bs, int64_t hs, int64_t slots, int64_t groups) {
  const int64_t most = *std::max_element(lens, lens + B);
  at::parallel_for(0, B * nh, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sc(most), acc(hs);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t b = bh / nh, h = (bh % nh) / groups, n = lens[b];  // h: the K/V head query head bh % nh reads
      const float* qq = q + bh * hs;
      const int64_t* row = tab + b * width;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) {
        const T* k = pk + (h * slots + row[t / bs] * bs + t % bs) * hs;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t c = 0; c < hs; ++c) d += qq[c] * static_cast<float>(k[c]);
        sc[t] = d;
        mx = std::max(mx, d);
      }
      float total = 0.f;
      for (int64_t t = 0; t < n; ++t) { sc[t] = std::exp(sc[t] - mx); total += sc[t]; }
      for (int64_t c = 0; c < hs; ++c) acc[c] = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        const T* v = pv + (h * slots + row[t / bs] * bs + t % bs) * hs;
        const float w = sc[t] / total;
#pragma omp simd
        for (int64_t c = 0; c < hs; ++c) acc[c] += w * static_cast<float>(v[c]);
      }
      std::copy(acc.begin(), acc.end(), out + bh * hs);
    }
  });
}

torch::Tensor paged(torch::Tensor q, torch::Tensor pool_k, torch::Tensor pool_v, torch::Tensor tab, int64_t bs,
                    torch::Tensor lens) {
  TORCH_CHECK(q.dtype() == torch::kFloat && q.is_contiguous() && q.dim() == 3, "q: contiguous float32 (B, nh, hs)");
  TORCH_CHECK(pool_k.is_contiguous() && pool_v.is_contiguous() && pool_k.dim() == 3 && pool_k.sizes() == pool_v.sizes()
              && pool_k.dtype() == pool_v.dtype(), "pools: contiguous (nh, slots, hs), K and V alike");
  TORCH_CHECK(tab.dtype() == torch::kLong && tab.is_contiguous() && tab.dim() == 2 && tab.size(0) == q.size(0),
              "tab: contiguous int64 (B, width)");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2), slots = pool_k.size(1), width = tab.size(1);
  TORCH_CHECK(lens.dtype() == torch::kLong && lens.is_contiguous() && lens.dim() == 1 && lens.size(0) == B,
              "lens: contiguous int64 (B,)");
  TORCH_CHECK(pool_k.size(0) >= 1 && nh % pool_k.size(0) == 0 && pool_k.size(2) == hs,
              "shapes disagree (the pool's K/V heads must divide the query heads)");
  const int64_t groups = nh / pool_k.size(0);
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= width * bs, "lens[", b, "] = ", ln[b], ": out of 1 .. ", width * bs);
  auto out = torch::empty({B, nh, hs}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pool_k.scalar_type(), "paged", [&] {
    paged_impl<scalar_t>(q.data_ptr<float>(), pool_k.data_ptr<scalar_t>(), pool_v.data_ptr<scalar_t>(),
                         tab.data_ptr<int64_t>(), ln, out.data_ptr<float>(), B, nh, width, bs, hs, slots, groups);
  });
  return out;
}

// ---- quantising a step's tokens (the quant kind's per token): quant.quantize (or quantize_symmetric) + pack ----

// The fp16 value next to h towards +inf (up) or -inf, as torch.nextafter on fp16 (finite h, or +-inf towards 0).
inline c10::Half half_next(c10::Half h, bool up) {
  uint16_t b = h.x;
  if ((b & 0x7fff) == 0) b = up ? 0x0001 : 0x8001;
  else if ((b & 0x8000) != 0) b = up ? b - 1 : b + 1;
  else b = up ? b + 1 : b - 1;
  return c10::Half(b, c10::Half::from_bits());
}

// x as fp16, rounded towards +inf (up) or -inf instead of to nearest: quant._round_fp16.
inline c10::Half half_directed(float x, bool up) {
  const c10::Half h(x);
  const float f = static_cast<float>(h);
  return (up ? f < x : f > x) ? half_next(h, up) : h;
}

// One row of hs values quantised per group of G channels into nb packed bytes (overwritten) and fp16 scales and
// minimums, value for value what quant.quantize + pack store.
void quantize_row(const float* row, int64_t hs, int64_t bits, int64_t G, uint8_t* pk, c10::Half* sc, c10::Half* mn) {
  const int64_t per = 8 / bits, nb = (hs + per - 1) / per, ng = (hs + G - 1) / G;
  const int levels = (1 << bits) - 1;
  std::fill(pk, pk + nb, uint8_t{0});
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t c0 = g * G, c1 = std::min(hs, c0 + G);
    float a = row[c0], z = row[c0];
    bool nan = false;
    for (int64_t c = c0; c < c1; ++c) {
      nan |= std::isnan(row[c]);
      a = std::min(a, row[c]);
      z = std::max(z, row[c]);
    }
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    const c10::Half l = nan ? c10::Half(qnan) : half_directed(a, false);
    const c10::Half s = nan ? c10::Half(qnan) : half_directed((z - static_cast<float>(l)) / levels, true);
    sc[g] = s;
    mn[g] = l;
    const float sf = static_cast<float>(s), lf = static_cast<float>(l);
    for (int64_t c = c0; c < c1; ++c) {
      float v = sf > 0.f ? std::nearbyint((row[c] - lf) / sf) : 0.f;  // round half to even, as torch.round
      v = std::min(std::max(v, 0.f), static_cast<float>(levels));
      pk[c / per] |= static_cast<uint8_t>(static_cast<int>(v) << (bits * (c % per)));
    }
  }
}

// a * b rounded to float on its own, as torch computes it: never fused with an addition after it (a compiler may
// contract a * b + c into one fused multiply-add, which rounds once)
inline float product(float a, float b) {
  volatile float p = a * b;
  return p;
}

// One row of hs values quantised per group of G channels by the symmetric scheme into nb packed bytes (overwritten)
// and fp16 scales, value for value what quant.quantize_symmetric + pack store: llama.cpp's q8_0 at 8 bits (d =
// amax / 127, q = roundf(x * (1/d))), q4_0's rule at 4 and 2 (d = m / -N for m the first value of largest |x|,
// q = min(2N - 1, trunc(x * (1/d) + N + 1/2)) - N), the scale d rounded to the nearest fp16, codes stored as q + N.
void quantize_row_symmetric(const float* row, int64_t hs, int64_t bits, int64_t G, uint8_t* pk, c10::Half* sc) {
  const int64_t per = 8 / bits, nb = (hs + per - 1) / per, ng = (hs + G - 1) / G;
  const int N = 1 << (bits - 1);
  std::fill(pk, pk + nb, uint8_t{0});
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t c0 = g * G, c1 = std::min(hs, c0 + G);
    float amax = 0.f, m = 0.f;  // the largest |x|, and the first value that has it
    bool nan = false;
    for (int64_t c = c0; c < c1; ++c) {
      nan |= std::isnan(row[c]);
      if (amax < std::fabs(row[c])) amax = std::fabs(row[c]), m = row[c];
    }
    const float d = bits == 8 ? amax / 127.f : m / static_cast<float>(-N);
    const float inv = d != 0.f ? 1.f / d : 0.f;
    sc[g] = c10::Half(nan ? std::numeric_limits<float>::quiet_NaN() : d);
    for (int64_t c = c0; c < c1; ++c) {
      float v = static_cast<float>(N);  // a group holding a NaN: q = 0
      if (!nan) {
        float y = product(row[c], inv);
        if (std::isnan(y)) y = 0.f;  // inf * 0 (an infinite group) or 0 * inf (1/d past float32): q = 0
        v = bits == 8 ? std::min(std::max(std::round(y), -127.f), 127.f) + static_cast<float>(N)
                      : std::min(std::max(std::trunc(y + (static_cast<float>(N) + 0.5f)), 0.f),
                                 static_cast<float>(2 * N - 1));
      }
      pk[c / per] |= static_cast<uint8_t>(static_cast<int>(v) << (bits * (c % per)));
    }
  }
}

// Rows of hs values -> (packed, fp16 scale, fp16 minimum; the minimum empty where symmetric) per group of G.
std::vector<torch::Tensor> quantize_tokens(torch::Tensor x, int64_t bits, int64_t G, bool symmetric) {
  TORCH_CHECK(x.dtype() == torch::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 (rows, hs)");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  const int64_t R = x.size(0), hs = x.size(1), per = 8 / bits, nb = (hs + per - 1) / per, ng = (hs + G - 1) / G;
  auto packed = torch::zeros({R, nb}, x.options().dtype(torch::kUInt8));
  auto scale = torch::empty({R, ng}, x.options().dtype(torch::kHalf));
  auto lo = torch::empty({symmetric ? 0 : R, ng}, x.options().dtype(torch::kHalf));
  for (int64_t r = 0; r < R; ++r) {
    const float* row = x.data_ptr<float>() + r * hs;
    uint8_t* pk = packed.data_ptr<uint8_t>() + r * nb;
    c10::Half* sc = scale.data_ptr<c10::Half>() + r * ng;
    if (symmetric) quantize_row_symmetric(row, hs, bits, G, pk, sc);
    else quantize_row(row, hs, bits, G, pk, sc, lo.data_ptr<c10::Half>() + r * ng);
  }
  return {packed, scale, lo};
}

// The step's m tokens x (B, nh, m, hs), any float dtype, quantised per token into slots slot .. slot + m - 1 of
// layer `layer` of packed (L, B, nh, S, nb), scale and lo (L, B, nh, S, ng) fp16 (or of one layer's, 4-d; lo empty
// and unread where symmetric), where the cache holds them: the quant kind's write of V per token in a compiled decode
// step, in one call.
void quantize_into(torch::Tensor x, int64_t layer, torch::Tensor packed, torch::Tensor scale, torch::Tensor lo,
                   int64_t slot, int64_t bits, int64_t G, bool symmetric) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  if (packed.dim() == 5) {
    packed = packed.select(0, layer), scale = scale.select(0, layer);
    if (!symmetric) lo = lo.select(0, layer);
  }
  TORCH_CHECK(x.dim() == 4 && packed.dim() == 4 && scale.dim() == 4 && (symmetric || lo.sizes() == scale.sizes()),
              "4-d tensors");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && scale.dtype() == torch::kHalf && packed.is_contiguous() &&
              scale.is_contiguous() && (symmetric || (lo.dtype() == torch::kHalf && lo.is_contiguous())),
              "packed: contiguous uint8, scale and lo: contiguous float16");
  const int64_t B = x.size(0), nh = x.size(1), m = x.size(2), hs = x.size(3), S = packed.size(2);
  const int64_t per = 8 / bits, nb = (hs + per - 1) / per, ng = (hs + G - 1) / G;
  TORCH_CHECK(packed.size(0) == B && packed.size(1) == nh && packed.size(3) == nb && scale.size(0) == B &&
              scale.size(1) == nh && scale.size(2) == S && scale.size(3) == ng && 0 <= slot && slot + m <= S,
              "x, packed and scales disagree, or the slots lie outside");
  auto xf = x.to(torch::kFloat).contiguous();
  for (int64_t r = 0; r < B * nh; ++r)
    for (int64_t i = 0; i < m; ++i) {
      const int64_t at = r * S + slot + i;
      const float* row = xf.data_ptr<float>() + (r * m + i) * hs;
      uint8_t* pk = packed.data_ptr<uint8_t>() + at * nb;
      c10::Half* sc = scale.data_ptr<c10::Half>() + at * ng;
      if (symmetric) quantize_row_symmetric(row, hs, bits, G, pk, sc);
      else quantize_row(row, hs, bits, G, pk, sc, lo.data_ptr<c10::Half>() + at * ng);
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scores", &scores, "q . K^T over packed K (first n tokens)");
  m.def("weighted", &weighted, "p . V over packed V (first n tokens)");
  m.def("attention", &attention, "the quant kind's decode attention: packed K and its tail, softmax, packed V and its tail");
  m.def("quantize_tokens", &quantize_tokens,
        "rows of hs values -> (packed, fp16 scale, fp16 minimum: empty where symmetric) per group");
  m.def("quantize_into", &quantize_into, "a step's tokens quantised per token into one layer's slots, in place");
  m.def("paged", &paged, "one query's attention per sequence over its first lens[b] tokens, read through the block table");
}
