// Paged decode attention for the CPU, as an XLA FFI custom call (see paged_decode_cpu.py).
//
// The jnp reference gathers each window's whole context bucket of pages into a dense copy
// and runs batched einsums over all of it; XLA's CPU backend does the gather element by
// element and the tiny batched dots one by one, which made attention about a fifth of a
// single-stream decode step of the default model. This kernel reads each live K/V row once,
// straight from the page pool, and touches nothing past the window's cached length.
//
// Semantics are exactly `paged_decode_reference` (one query per window): every head of the
// window attends to cache positions [0, cached_len) of its slot plus its own fresh key, with
// float32 scores, softmax and accumulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void Axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// exp(x) for x <= 0 in plain arithmetic, so the softmax loop vectorizes (libm's expf does
// not without -ffast-math). Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, a degree-5
// polynomial for e^r, 2^k built in the exponent bits; relative error ~1e-7. Below -87 the
// result (< 1.7e-38) is flushed to 0, far under a softmax weight float32 can hold.
inline float ExpNonPositive(float x) {
  const float clamped = std::max(x, -87.f);
  const float k = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return x < -87.f ? 0.f : e_r * two_k;
}

// Softmax of each row of scores [rows, n] in place (max-subtracted, as jax.nn.softmax);
// leaves each row unnormalized and 1 / its sum in inv_sum.
void SoftmaxRows(float* scores, int64_t rows, int64_t n, float* inv_sum) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * n;
    float top = s[0];
    for (int64_t i = 1; i < n; ++i) top = std::max(top, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = ExpNonPositive(s[i] - top);
      sum += s[i];
    }
    inv_sum[h] = 1.f / sum;
  }
}

// One window: its H query heads over its cached rows and its fresh key/value.
//
// A cached row holds every kv head ([K, Dh], contiguous), so both passes walk the window's
// pages row by row and serve all heads from each row: the K/V bytes are read once, in order.
void AttendWindow(const float* q,        // [H, Dh], head h = kv head h / G
                  const float* k_fresh,  // [K, Dh]
                  const float* v_fresh,  // [K, Dh]
                  const float* k_layer,  // [P, page, K, Dh] this layer's pool
                  const float* v_layer,
                  const int32_t* pages,  // [n_ctx_pages] page ids of the window's slot
                  int64_t n_cached, int64_t n_pool, int64_t page_size, int64_t K, int64_t G,
                  int64_t Dh, std::vector<float>& scores, std::vector<float>& q_scaled,
                  std::vector<float>& inv_sum, float* out) {  // out: [H, Dh]
  const int64_t H = K * G, n = n_cached + 1;  // the fresh key is each head's last score
  const int64_t row_stride = K * Dh;
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  scores.resize(static_cast<size_t>(H * n));
  q_scaled.resize(static_cast<size_t>(H * Dh));
  inv_sum.resize(static_cast<size_t>(H));
  for (int64_t i = 0; i < H * Dh; ++i) q_scaled[i] = q[i] * scale;
  const float* qs = q_scaled.data();

  auto rows_of = [&](const float* layer, int64_t s0) {
    const int64_t page = std::clamp<int64_t>(pages[s0 / page_size], 0, n_pool - 1);
    return layer + page * page_size * row_stride;
  };
  // Pass 1: scores.
  for (int64_t s0 = 0; s0 < n_cached; s0 += page_size) {
    const float* rows = rows_of(k_layer, s0);
    const int64_t n_rows = std::min(page_size, n_cached - s0);
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* k = rows + r * row_stride;
      for (int64_t h = 0; h < H; ++h) scores[h * n + s0 + r] = Dot(qs + h * Dh, k + (h / G) * Dh, Dh);
    }
  }
  for (int64_t h = 0; h < H; ++h) scores[h * n + n_cached] = Dot(qs + h * Dh, k_fresh + (h / G) * Dh, Dh);
  SoftmaxRows(scores.data(), H, n, inv_sum.data());

  // Pass 2: probabilities times values.
  std::fill(out, out + H * Dh, 0.f);
  for (int64_t s0 = 0; s0 < n_cached; s0 += page_size) {
    const float* rows = rows_of(v_layer, s0);
    const int64_t n_rows = std::min(page_size, n_cached - s0);
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* v = rows + r * row_stride;
      for (int64_t h = 0; h < H; ++h) Axpy(scores[h * n + s0 + r], v + (h / G) * Dh, out + h * Dh, Dh);
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    Axpy(scores[h * n + n_cached], v_fresh + (h / G) * Dh, out + h * Dh, Dh);
    for (int64_t d = 0; d < Dh; ++d) out[h * Dh + d] *= inv_sum[h];
  }
}

ffi::Error PagedDecodeF32(ffi::Buffer<ffi::F32> q,          // [W, H, Dh]
                          ffi::Buffer<ffi::F32> k_new,      // [W, K, Dh]
                          ffi::Buffer<ffi::F32> v_new,      // [W, K, Dh]
                          ffi::Buffer<ffi::F32> k_pages,    // [L, P, page, K, Dh]
                          ffi::Buffer<ffi::F32> v_pages,    // [L, P, page, K, Dh]
                          ffi::Buffer<ffi::S32> pages,      // [W, n_ctx_pages]
                          ffi::Buffer<ffi::S32> cached_len, // [W]
                          ffi::Buffer<ffi::S32> layer,      // [] (scalar)
                          ffi::ResultBuffer<ffi::F32> out)  // [W, H, Dh]
{
  const auto qd = q.dimensions();
  const auto kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pages.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode_cpu: want q [W,H,Dh], pool [L,P,page,K,Dh], pages [W,n]");
  }
  const int64_t W = qd[0], H = qd[1], Dh = qd[2];
  const int64_t L = kd[0], P = kd[1], page_size = kd[2], K = kd[3];
  const int64_t n_ctx_pages = pages.dimensions()[1];
  if (kd[4] != Dh || H % K != 0) {
    return ffi::Error::InvalidArgument("paged_decode_cpu: head sizes of q and the pool disagree");
  }
  const int64_t G = H / K;
  const int64_t layer_index = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const int64_t layer_stride = P * page_size * K * Dh;
  const float* k_layer = k_pages.typed_data() + layer_index * layer_stride;
  const float* v_layer = v_pages.typed_data() + layer_index * layer_stride;
  std::vector<float> scores, q_scaled, inv_sum;
  for (int64_t w = 0; w < W; ++w) {
    const int64_t n_cached =
        std::clamp<int64_t>(cached_len.typed_data()[w], 0, n_ctx_pages * page_size);
    AttendWindow(q.typed_data() + w * H * Dh, k_new.typed_data() + w * K * Dh,
                 v_new.typed_data() + w * K * Dh, k_layer, v_layer,
                 pages.typed_data() + w * n_ctx_pages, n_cached, P, page_size, K, G, Dh, scores,
                 q_scaled, inv_sum, out->typed_data() + w * H * Dh);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedDecodeF32, PagedDecodeF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
