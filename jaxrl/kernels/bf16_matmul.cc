// y[M, N] (float32) = x[M, K] (bf16) @ W[K, N] (bf16) on Intel AMX tiles: bf16 products
// accumulated in float32, as XLA's dot with preferred_element_type=float32 computes them (up to
// summation order). W comes packed by `jaxrl.kernels.cpu.pack_kernel`: [P, K/2, 64, 2], P panels of
// 64 output columns, the two bf16 of a k pair side by side (the B-tile layout TDPBF16PS reads),
// K a multiple of 32. Panels are shared out over XLA's intra-op thread pool.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;  // output columns per panel: four 16-column C tiles
constexpr int64_t kTileRows = 16;
constexpr int64_t kPairs = 16;  // k pairs per B tile (32 values of K)

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (rows x 16 float32), 4: A (rows x 32 bf16), 5-6: B (16 pairs x 16 columns)
void configure(int64_t rows) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 5 ? rows : kPairs);
  }
  _tile_loadconfig(&cfg);
}

struct Job {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [P, K/2, 64, 2]
  float* y;           // [M, N]
  int64_t m, k, n, panels, blocks;  // blocks: row blocks of 16
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Rows [m0, m0 + rows) of panel p.
void block(const Job& j, int64_t p, int64_t m0, int64_t rows) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t k2 = j.k / 2;
  const uint16_t* panel = j.w + p * k2 * kPanel * 2;
  const uint16_t* x = j.x + m0 * j.k;
  constexpr int64_t wstride = kPanel * 4;  // bytes from one k pair to the next
  for (int64_t kk = 0; kk < k2; kk += kPairs) {
    const uint16_t* b = panel + kk * kPanel * 2;
    _tile_loadd(4, x + 2 * kk, j.k * 2);
    _tile_loadd(5, b, wstride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, wstride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 64, wstride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 96, wstride);
    _tile_dpbf16ps(3, 4, 6);
  }
  const int64_t n0 = p * kPanel;
  float* y = j.y + m0 * j.n + n0;
  if (n0 + kPanel <= j.n) {
    _tile_stored(0, y, j.n * 4);
    _tile_stored(1, y + 16, j.n * 4);
    _tile_stored(2, y + 32, j.n * 4);
    _tile_stored(3, y + 48, j.n * 4);
    return;
  }
  alignas(64) float tmp[kTileRows * kPanel];
  _tile_stored(0, tmp, kPanel * 4);
  _tile_stored(1, tmp + 16, kPanel * 4);
  _tile_stored(2, tmp + 32, kPanel * 4);
  _tile_stored(3, tmp + 48, kPanel * 4);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(y + r * j.n, tmp + r * kPanel, (j.n - n0) * sizeof(float));
}

void work(Job& j) {
  int64_t configured = 0;
  const int64_t tasks = j.panels * j.blocks;
  for (int64_t t; (t = j.next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
    const int64_t p = t / j.blocks, m0 = (t % j.blocks) * kTileRows;
    const int64_t rows = std::min(kTileRows, j.m - m0);
    if (rows != configured) configure(configured = rows);
    block(j, p, m0, rows);
    j.done.fetch_add(1, std::memory_order_release);
  }
  if (configured) _tile_release();
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (wd.size() != 4 || wd[2] != kPanel || wd[3] != 2 || wd[1] % kPairs || xd.size() == 0 ||
      yd.size() == 0)
    return ffi::Error::InvalidArgument("bf16_matmul: W must be packed [P, K/2, 64, 2]");
  const int64_t k = xd.back(), n = yd.back();
  if (k != 2 * wd[1] || n > wd[0] * kPanel || n <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument("bf16_matmul: x, W and y shapes disagree");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->m = static_cast<int64_t>(x.element_count()) / k;
  job->k = k;
  job->n = n;
  job->panels = wd[0];
  job->blocks = (job->m + kTileRows - 1) / kTileRows;
  const int64_t tasks = job->panels * job->blocks;
  if (tasks == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { work(*job); });
  work(*job);
  while (job->done.load(std::memory_order_acquire) < tasks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// 1 when this process may use AMX tiles (the CPU has them and Linux grants the tile state), 0
// otherwise; the kernel must not be called after a 0.
extern "C" int jaxrl_amx_ready() {
  constexpr int kReqPerm = 0x1023, kXtiledata = 18;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return 0;
  return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0 ? 1 : 0;
}
