// Decode attention where a cache kind stores K and V, on the CPU, parallel over batch rows x heads, float32 math:
// - quant: the two reductions that read the quantised history (q . K^T and p . V), each reading the packed bytes and
//   their scales where they lie, one token row at a time, with no dequantised copy (scores, weighted);
// - paged: the whole attention of one query, reading each key and value row through the block table (paged).
// Built on first use by models/kv_cache/kernels.py (torch.utils.cpp_extension).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

// scores[bh, j] = sum_c q[bh, c] * (lo + value * scale) for the first n tokens; the rest left 0.
template <int BITS>
void scores_impl(const float* q, const uint8_t* packed, const float* scale, const float* lo, float* out, int64_t BH,
                 int64_t S, int64_t nb, int64_t hs, int64_t n, bool channel, int64_t G, int64_t ns, int64_t sw,
                 int64_t os) {
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> vals(nb * (8 / BITS)), qs(hs), qg((hs + G - 1) / G);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const float* qq = q + bh * hs;
      const uint8_t* pk = packed + bh * S * nb;
      const float* sc = scale + bh * ns * sw;
      const float* mn = lo + bh * ns * sw;
      float* o = out + bh * os;
      if (channel) {  // a scale and minimum per channel for each group of G tokens
        float ql = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          if (j % G == 0) {  // a new group: fold its scales into the query
            const float* s = sc + (j / G) * hs;
            const float* m = mn + (j / G) * hs;
            ql = 0.f;
            for (int64_t c = 0; c < hs; ++c) { qs[c] = qq[c] * s[c]; ql += qq[c] * m[c]; }
          }
          unpack_row<BITS>(pk + j * nb, nb, vals.data());
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < hs; ++c) acc += qs[c] * vals[c];
          o[j] = acc + ql;
        }
      } else {  // a scale and minimum per token for each group of G channels
        const int64_t ng = (hs + G - 1) / G;
        for (int64_t g = 0; g < ng; ++g) {
          qg[g] = 0.f;
          for (int64_t c = g * G; c < std::min(hs, (g + 1) * G); ++c) qg[g] += qq[c];
        }
        for (int64_t j = 0; j < n; ++j) {
          unpack_row<BITS>(pk + j * nb, nb, vals.data());
          float acc = 0.f;
          for (int64_t g = 0; g < ng; ++g) {
            float part = 0.f;
            const int64_t c1 = std::min(hs, (g + 1) * G);
#pragma omp simd reduction(+ : part)
            for (int64_t c = g * G; c < c1; ++c) part += qq[c] * vals[c];
            acc += part * sc[j * sw + g] + qg[g] * mn[j * sw + g];
          }
          o[j] = acc;
        }
      }
    }
  });
}

// out[bh, c] = sum_j p[bh, j] * (lo + value * scale) over the first n tokens.
template <int BITS>
void weighted_impl(const float* p, int64_t P, const uint8_t* packed, const float* scale, const float* lo, float* out,
                   int64_t BH, int64_t S, int64_t nb, int64_t hs, int64_t n, bool channel, int64_t G, int64_t ns,
                   int64_t sw) {
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> vals(nb * (8 / BITS)), acc(hs), w((hs + G - 1) / G), u((hs + G - 1) / G);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const float* pp = p + bh * P;
      const uint8_t* pk = packed + bh * S * nb;
      const float* sc = scale + bh * ns * sw;
      const float* mn = lo + bh * ns * sw;
      float* o = out + bh * hs;
      for (int64_t c = 0; c < hs; ++c) o[c] = 0.f;
      if (channel) {  // per group of G tokens: sum p * value, then one scale and minimum per channel
        for (int64_t g0 = 0; g0 < n; g0 += G) {
          float psum = 0.f;
          for (int64_t c = 0; c < hs; ++c) acc[c] = 0.f;
          for (int64_t j = g0; j < std::min(n, g0 + G); ++j) {
            unpack_row<BITS>(pk + j * nb, nb, vals.data());
            const float pj = pp[j];
            psum += pj;
#pragma omp simd
            for (int64_t c = 0; c < hs; ++c) acc[c] += pj * vals[c];
          }
          const float* s = sc + (g0 / G) * hs;
          const float* m = mn + (g0 / G) * hs;
          for (int64_t c = 0; c < hs; ++c) o[c] += acc[c] * s[c] + psum * m[c];
        }
      } else {  // per token: its own scale and minimum per group of G channels
        const int64_t ng = (hs + G - 1) / G;
        for (int64_t j = 0; j < n; ++j) {
          unpack_row<BITS>(pk + j * nb, nb, vals.data());
          const float pj = pp[j];
          for (int64_t g = 0; g < ng; ++g) {
            const float wg = pj * sc[j * sw + g], ug = pj * mn[j * sw + g];
            const int64_t c1 = std::min(hs, (g + 1) * G);
#pragma omp simd
            for (int64_t c = g * G; c < c1; ++c) o[c] += wg * vals[c] + ug;
          }
        }
      }
    }
  });
}

void check(const torch::Tensor& packed, const torch::Tensor& scale, const torch::Tensor& lo) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 3,
              "packed: contiguous uint8 (BH, S, bytes)");
  TORCH_CHECK(scale.dtype() == torch::kFloat && lo.dtype() == torch::kFloat && scale.is_contiguous() &&
              lo.is_contiguous() && scale.dim() == 3 && lo.sizes() == scale.sizes(),
              "scale, lo: contiguous float32 (BH, slots, per slot) of one shape");
}

}  // namespace

torch::Tensor scores(torch::Tensor q, torch::Tensor packed, torch::Tensor scale, torch::Tensor lo, int64_t n,
                     int64_t bits, bool channel, int64_t G) {
  check(packed, scale, lo);
  TORCH_CHECK(q.dtype() == torch::kFloat && q.is_contiguous() && q.dim() == 2, "q: contiguous float32 (BH, hs)");
  const int64_t BH = packed.size(0), S = packed.size(1), nb = packed.size(2), hs = q.size(1);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  TORCH_CHECK(nb * (8 / bits) >= hs && n <= S && q.size(0) == BH, "packed rows too short for hs, or n > slots");
  auto out = torch::empty({BH, n}, q.options());
  const float *qq = q.data_ptr<float>(), *sc = scale.data_ptr<float>(), *mn = lo.data_ptr<float>();
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t ns = scale.size(1), sw = scale.size(2);
  if (bits == 8) scores_impl<8>(qq, pk, sc, mn, o, BH, S, nb, hs, n, channel, G, ns, sw, n);
  if (bits == 4) scores_impl<4>(qq, pk, sc, mn, o, BH, S, nb, hs, n, channel, G, ns, sw, n);
  if (bits == 2) scores_impl<2>(qq, pk, sc, mn, o, BH, S, nb, hs, n, channel, G, ns, sw, n);
  return out;
}

torch::Tensor weighted(torch::Tensor p, torch::Tensor packed, torch::Tensor scale, torch::Tensor lo, int64_t n,
                       int64_t hs, int64_t bits, bool channel, int64_t G) {
  check(packed, scale, lo);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  const int64_t BH = packed.size(0), S = packed.size(1), nb = packed.size(2);
  TORCH_CHECK(p.dtype() == torch::kFloat && p.dim() == 2 && p.stride(1) == 1 && p.size(0) == BH && p.size(1) >= n,
              "p: float32 (BH, >= n), rows contiguous");
  TORCH_CHECK(nb * (8 / bits) >= hs && n <= S, "packed rows too short for hs, or n > slots");
  auto out = torch::empty({BH, hs}, p.options());
  const float *pp = p.data_ptr<float>(), *sc = scale.data_ptr<float>(), *mn = lo.data_ptr<float>();
  const uint8_t* pk = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t ns = scale.size(1), sw = scale.size(2), P = p.stride(0);
  if (bits == 8) weighted_impl<8>(pp, P, pk, sc, mn, o, BH, S, nb, hs, n, channel, G, ns, sw);
  if (bits == 4) weighted_impl<4>(pp, P, pk, sc, mn, o, BH, S, nb, hs, n, channel, G, ns, sw);
  if (bits == 2) weighted_impl<2>(pp, P, pk, sc, mn, o, BH, S, nb, hs, n, channel, G, ns, sw);
  return out;
}

// One query per sequence and head over its first lens[b] tokens, each key and value row read through the block
// table: out[b, h] = softmax_t(q . k_t) . v, k_t = pool[h, tab[b, t / bs] * bs + t % bs]; q is pre-scaled. In a
// ragged batch every sequence has its own length (the keys a decode step's mask lets it see).
template <typename T>
void paged_impl(const float* q, const T* pk, const T* pv, const int64_t* tab, const int64_t* lens, float* out,
                int64_t B, int64_t nh, int64_t width, int64_t bs, int64_t hs, int64_t slots) {
  const int64_t most = *std::max_element(lens, lens + B);
  at::parallel_for(0, B * nh, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sc(most), acc(hs);
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t b = bh / nh, h = bh % nh, n = lens[b];
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
  TORCH_CHECK(pool_k.size(0) == nh && pool_k.size(2) == hs, "shapes disagree");
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(ln[b] >= 1 && ln[b] <= width * bs, "lens[", b, "] = ", ln[b], ": out of 1 .. ", width * bs);
  auto out = torch::empty({B, nh, hs}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, pool_k.scalar_type(), "paged", [&] {
    paged_impl<scalar_t>(q.data_ptr<float>(), pool_k.data_ptr<scalar_t>(), pool_v.data_ptr<scalar_t>(),
                         tab.data_ptr<int64_t>(), ln, out.data_ptr<float>(), B, nh, width, bs, hs, slots);
  });
  return out;
}

// ---- quantising a step's tokens (the quant kind's V per token): quant.quantize + pack, value for value --------

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

std::vector<torch::Tensor> quantize_tokens(torch::Tensor x, int64_t bits, int64_t G) {
  TORCH_CHECK(x.dtype() == torch::kFloat && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 (rows, hs)");
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2");
  const int64_t R = x.size(0), hs = x.size(1), per = 8 / bits, nb = (hs + per - 1) / per, ng = (hs + G - 1) / G;
  const int levels = (1 << bits) - 1;
  auto packed = torch::zeros({R, nb}, x.options().dtype(torch::kUInt8));
  auto scale = torch::empty({R, ng}, x.options().dtype(torch::kHalf));
  auto lo = torch::empty({R, ng}, x.options().dtype(torch::kHalf));
  const float* xs = x.data_ptr<float>();
  uint8_t* pk = packed.data_ptr<uint8_t>();
  c10::Half* sc = scale.data_ptr<c10::Half>();
  c10::Half* mn = lo.data_ptr<c10::Half>();
  for (int64_t r = 0; r < R; ++r) {
    const float* row = xs + r * hs;
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
      sc[r * ng + g] = s;
      mn[r * ng + g] = l;
      const float sf = static_cast<float>(s), lf = static_cast<float>(l);
      for (int64_t c = c0; c < c1; ++c) {
        float v = sf > 0.f ? std::nearbyint((row[c] - lf) / sf) : 0.f;  // round half to even, as torch.round
        v = std::min(std::max(v, 0.f), static_cast<float>(levels));
        pk[r * nb + c / per] |= static_cast<uint8_t>(static_cast<int>(v) << (bits * (c % per)));
      }
    }
  }
  return {packed, scale, lo};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scores", &scores, "q . K^T over packed K (first n tokens)");
  m.def("weighted", &weighted, "p . V over packed V (first n tokens)");
  m.def("quantize_tokens", &quantize_tokens, "rows of hs values -> (packed, fp16 scale, fp16 minimum) per group");
  m.def("paged", &paged, "one query's attention per sequence over its first lens[b] tokens, read through the block table");
}
