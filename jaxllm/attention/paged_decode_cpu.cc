// Paged decode attention for the CPU, as an XLA FFI custom call (see paged_decode_cpu.py).
//
// The jnp reference gathers each window's whole context bucket of pages into a dense copy
// and runs batched einsums over all of it; XLA's CPU backend does the gather element by
// element and the tiny batched dots one by one, which made attention about a fifth of a
// single-stream decode step of the default model. This kernel reads each live K/V row once,
// straight from the page pool, and touches nothing past the window's cached length. With
// fewer windows than threads, a window's rows are split into parts run on XLA's intra-op pool
// and merged (flash-decoding's splits): inside a decode step the K/V rows come from memory
// after the weights went through the caches, and one core waiting on them was a sixth of the
// step (docs/lab/2026-12.md).
//
// Semantics are exactly `paged_decode_reference` (one query per window): every head of the
// window attends to cache positions [0, cached_len) of its slot plus its own fresh key, with
// float32 scores, softmax and accumulation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMinRowsPerPart = 64;  // cached rows below which a window is not split

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

// One window's H query heads over its cached rows [s_begin, s_end), plus its fresh key when
// `k_fresh` is given: the unnormalized softmax-weighted values acc [H, Dh] with each head's
// score maximum m [H] and weight sum l [H], to be merged with the window's other parts.
//
// A cached row holds every kv head ([K, Dh], contiguous), so both passes walk the pages row by
// row and serve all heads from each row: the K/V bytes are read once, in order.
void AttendRange(const float* q,        // [H, Dh], head h = kv head h / G
                 const float* k_fresh,  // [K, Dh] or nullptr
                 const float* v_fresh,  // [K, Dh]
                 const float* k_layer,  // [P, page, K, Dh] this layer's pool
                 const float* v_layer,
                 const int32_t* pages,  // [n_ctx_pages] page ids of the window's slot
                 int64_t s_begin, int64_t s_end, int64_t n_pool, int64_t page_size, int64_t K, int64_t G,
                 int64_t Dh, float* acc, float* m, float* l) {
  const int64_t H = K * G, n_rows = s_end - s_begin;
  const int64_t n = n_rows + (k_fresh != nullptr);  // the fresh key is each head's last score
  const int64_t row_stride = K * Dh;
  std::fill(acc, acc + H * Dh, 0.f);
  if (n == 0) {
    std::fill(m, m + H, 0.f);
    std::fill(l, l + H, 0.f);
    return;
  }
  thread_local std::vector<float> scores, q_scaled;
  scores.resize(static_cast<size_t>(H * n));
  q_scaled.resize(static_cast<size_t>(H * Dh));
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  for (int64_t i = 0; i < H * Dh; ++i) q_scaled[i] = q[i] * scale;
  const float* qs = q_scaled.data();

  // Calls f(j, row offset in the pool) for the range's rows j = 0.., a page at a time.
  auto for_rows = [&](auto&& f) {
    for (int64_t s = s_begin; s < s_end;) {
      const int64_t page = std::clamp<int64_t>(pages[s / page_size], 0, n_pool - 1);
      const int64_t off = s % page_size, rows = std::min(page_size - off, s_end - s);
      const int64_t base = (page * page_size + off) * row_stride;
      for (int64_t r = 0; r < rows; ++r) f(s - s_begin + r, base + r * row_stride);
      s += rows;
    }
  };
  // Pass 1: scores.
  for_rows([&](int64_t j, int64_t at) {
    const float* k = k_layer + at;
    for (int64_t h = 0; h < H; ++h) scores[h * n + j] = Dot(qs + h * Dh, k + (h / G) * Dh, Dh);
  });
  if (k_fresh != nullptr) {
    for (int64_t h = 0; h < H; ++h) scores[h * n + n_rows] = Dot(qs + h * Dh, k_fresh + (h / G) * Dh, Dh);
  }
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores.data() + h * n;
    float top = s[0];
    for (int64_t i = 1; i < n; ++i) top = std::max(top, s[i]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = ExpNonPositive(s[i] - top);
      sum += s[i];
    }
    m[h] = top;
    l[h] = sum;
  }
  // Pass 2: weights times values.
  for_rows([&](int64_t j, int64_t at) {
    const float* v = v_layer + at;
    for (int64_t h = 0; h < H; ++h) Axpy(scores[h * n + j], v + (h / G) * Dh, acc + h * Dh, Dh);
  });
  if (k_fresh != nullptr) {
    for (int64_t h = 0; h < H; ++h) Axpy(scores[h * n + n_rows], v_fresh + (h / G) * Dh, acc + h * Dh, Dh);
  }
}

ffi::Error PagedDecodeF32(ffi::ThreadPool pool,
                          ffi::Buffer<ffi::F32> q,          // [W, H, Dh]
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

  std::vector<int64_t> n_cached(W);
  int64_t longest = 0;
  for (int64_t w = 0; w < W; ++w) {
    n_cached[w] = std::clamp<int64_t>(cached_len.typed_data()[w], 0, n_ctx_pages * page_size);
    longest = std::max(longest, n_cached[w]);
  }
  // Fewer windows than threads: each window's rows are split into parts (whole pages) that run
  // side by side, then merged; a decode step's attention is memory-latency bound on one core.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t splits = W >= threads ? 1 : std::clamp<int64_t>(longest / kMinRowsPerPart, 1, threads);
  const int64_t part_rows = ((longest + splits - 1) / splits + page_size - 1) / page_size * page_size;
  std::vector<float> acc(W * splits * H * Dh), m(W * splits * H), l(W * splits * H);
  jaxllm::ParallelFor(pool, W * splits, [&](int64_t task) {
    const int64_t w = task / splits, part = task % splits;
    const int64_t s_begin = std::min(n_cached[w], part * part_rows);
    const int64_t s_end = std::min(n_cached[w], s_begin + part_rows);
    const int64_t fresh = w * K * Dh;
    AttendRange(q.typed_data() + w * H * Dh, part == 0 ? k_new.typed_data() + fresh : nullptr,
                v_new.typed_data() + fresh, k_layer, v_layer, pages.typed_data() + w * n_ctx_pages, s_begin,
                s_end, P, page_size, K, G, Dh, acc.data() + task * H * Dh, m.data() + task * H,
                l.data() + task * H);
  });
  // Merge each window's parts: rescale each to the largest maximum, then normalize.
  float* o = out->typed_data();
  for (int64_t w = 0; w < W; ++w) {
    for (int64_t h = 0; h < H; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < splits; ++p) {
        const int64_t t = w * splits + p;
        if (l[t * H + h] > 0.f) top = std::max(top, m[t * H + h]);
      }
      float* dst = o + (w * H + h) * Dh;
      std::fill(dst, dst + Dh, 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < splits; ++p) {
        const int64_t t = w * splits + p;
        if (l[t * H + h] == 0.f) continue;  // a part with no rows (its window is shorter)
        const float c = ExpNonPositive(m[t * H + h] - top);
        total += c * l[t * H + h];
        Axpy(c, acc.data() + (t * H + h) * Dh, dst, Dh);
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < Dh; ++d) dst[d] *= inv;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedDecodeF32, PagedDecodeF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
