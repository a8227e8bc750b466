// Products of a few activation rows with a weight matrix, for the CPU, as XLA FFI custom
// calls (see matvec_cpu.py).
//
// A decode step of a small model on a CPU is a chain of matrix-vector products: it can go no
// faster than one pass over the weights. XLA's CPU dot for one row is slower than a plain
// reduction over the same bytes (docs/lab/2026-12.md); these kernels stream each weight row once,
// in memory order, several rows at a time, accumulating in float32, and split the weight
// into contiguous runs of rows across XLA's intra-op thread pool. Up to 8 activation rows
// (decode rounds); past that XLA's dot is faster.
//
//   JaxllmMatmulF32:           y[M, N] = x[M, Din] @ w[Din, N]   (projections, [in, out])
//   JaxllmMatmulTransposedF32: y[M, N] = x[M, Din] @ w[N, Din]^T (a tied lm_head: embed [V, D])
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;  // beyond this XLA's dot is faster (matvec_cpu.MAX_ROWS)
constexpr int64_t kRowAlign = 16;  // parts of the transposed product start on a cache line
constexpr int64_t kMinRowsPerPart = 256;
constexpr int64_t kMinDinPerPart = 64;

// partial[M, N] = x[:, d0:d1] @ w[d0:d1, :] for w of shape [Din, N]: a contiguous run of
// weight rows, streamed in order, into accumulators the size of the output (L1/L2).
void MatmulRowRange(const float* x, const float* w, float* partial, int64_t M, int64_t Din, int64_t N,
                    int64_t d0, int64_t d1) {
  std::fill(partial, partial + M * N, 0.f);
  int64_t d = d0;
  for (; d + 4 <= d1; d += 4) {  // four rows per pass: a quarter of the accumulator traffic
    const float* r0 = w + d * N;
    const float* r1 = r0 + N;
    const float* r2 = r1 + N;
    const float* r3 = r2 + N;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * Din + d;
      const float a0 = xm[0], a1 = xm[1], a2 = xm[2], a3 = xm[3];
      float* out = partial + m * N;
#pragma omp simd
      for (int64_t c = 0; c < N; ++c) out[c] += a0 * r0[c] + a1 * r1[c] + a2 * r2[c] + a3 * r3[c];
    }
  }
  for (; d < d1; ++d) {
    const float* row = w + d * N;
    for (int64_t m = 0; m < M; ++m) {
      const float a = x[m * Din + d];
      float* out = partial + m * N;
#pragma omp simd
      for (int64_t c = 0; c < N; ++c) out[c] += a * row[c];
    }
  }
}

// y[:, n0:n1] for w of shape [N, Din] (each output is a dot of x with one row of w).
void MatmulTransposedRows(const float* x, const float* w, float* y, int64_t M, int64_t Din, int64_t N,
                          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {  // four weight rows at once: independent sums, in flight together
    const float* r0 = w + n * Din;
    const float* r1 = r0 + Din;
    const float* r2 = r1 + Din;
    const float* r3 = r2 + Din;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * Din;
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t d = 0; d < Din; ++d) {
        a0 += xm[d] * r0[d];
        a1 += xm[d] * r1[d];
        a2 += xm[d] * r2[d];
        a3 += xm[d] * r3[d];
      }
      float* ym = y + m * N + n;
      ym[0] = a0, ym[1] = a1, ym[2] = a2, ym[3] = a3;
    }
  }
  for (; n < n1; ++n) {
    const float* row = w + n * Din;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * Din;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < Din; ++d) acc += xm[d] * row[d];
      y[m * N + n] = acc;
    }
  }
}

int64_t PartsFor(ffi::ThreadPool& pool, int64_t work, int64_t min_per_part) {
  return std::clamp<int64_t>(work / min_per_part, 1, std::max<int64_t>(1, pool.num_threads()));
}

// Range of part p of n_parts over [0, n), cache-line aligned.
std::pair<int64_t, int64_t> PartRange(int64_t p, int64_t n_parts, int64_t n) {
  const int64_t per = (n / n_parts + kRowAlign - 1) / kRowAlign * kRowAlign;
  return {std::min(n, p * per), p + 1 == n_parts ? n : std::min(n, (p + 1) * per)};
}

// w is one matrix, or a stack [L, ...] of which `layer` is used: a layer loop (lax.scan)
// passes the stack whole, since slicing it would copy the layer's weights before each call.
template <bool transposed>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3)) {
    return ffi::Error::InvalidArgument("matmul_cpu: want x [M, Din] and w [(L,) Din, N] or [(L,) N, Din]");
  }
  const size_t r = wd.size() - 2;  // the matrix's first axis
  const int64_t M = xd[0], Din = xd[1];
  const int64_t N = transposed ? wd[r] : wd[r + 1];
  if ((transposed ? wd[r + 1] : wd[r]) != Din) return ffi::Error::InvalidArgument("matmul_cpu: x and w disagree");
  if (M < 1 || M > kMaxRows) return ffi::Error::InvalidArgument("matmul_cpu: x has too many rows");
  const int64_t n_layers = r ? wd[0] : 1;
  const int64_t layer_index = std::clamp<int64_t>(layer.typed_data()[0], 0, n_layers - 1);
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + layer_index * Din * N;
  float* yp = y->typed_data();
  if constexpr (transposed) {  // parts take runs of output rows (contiguous weight rows)
    const int64_t n_parts = PartsFor(pool, N, kMinRowsPerPart);
    jaxllm::ParallelFor(pool, n_parts, [&](int64_t p) {
      const auto [n0, n1] = PartRange(p, n_parts, N);
      MatmulTransposedRows(xp, wp, yp, M, Din, N, n0, n1);
    });
    return ffi::Error::Success();
  }
  // Parts take runs of weight rows (contiguous memory); their partial sums are added last.
  const int64_t n_parts = PartsFor(pool, Din, kMinDinPerPart);
  std::vector<float> partials(static_cast<size_t>((n_parts - 1) * M * N));
  jaxllm::ParallelFor(pool, n_parts, [&](int64_t p) {
    const int64_t d0 = Din * p / n_parts, d1 = Din * (p + 1) / n_parts;
    MatmulRowRange(xp, wp, p == 0 ? yp : partials.data() + (p - 1) * M * N, M, Din, N, d0, d1);
  });
  for (int64_t p = 1; p < n_parts; ++p) {
    const float* part = partials.data() + (p - 1) * M * N;
#pragma omp simd
    for (int64_t i = 0; i < M * N; ++i) yp[i] += part[i];
  }
  return ffi::Error::Success();
}

// (pool, x, w, layer) -> y, for both products.
auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulF32, Matmul<false>, MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulTransposedF32, Matmul<true>, MatmulBinding());
