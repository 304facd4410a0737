// jaxrl's CPU kernels for the sampler's decode loop (jaxrl/kernels/cpu.py).
//
// bf16 matmul: y[M, N] (float32) = x[M, K] (bf16) @ W[K, N] (bf16) on Intel AMX tiles: bf16 products
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
#include <cmath>
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

// A task computes one panel for up to 32 rows. Up to 16 rows ("single"): tiles 0-3 are the
// four C tiles (rows x 16 float32), 4 is A (rows x 32 bf16), 5-6 are B (16 pairs x 16 columns).
// 17-32 rows ("pair"): the panel in two halves of 32 columns; tiles 0-1 are C for rows 0-15 and
// 2-3 for the rest, 4-5 the two A tiles, 6-7 the B tiles, so the panel's weights are read once.
void configure(int64_t r0, int64_t r1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  if (r1 == 0) {
    for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(r0);
    cfg.rows[5] = cfg.rows[6] = kPairs;
    cfg.colsb[7] = 0;
  } else {
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(r0);
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(r1);
    cfg.rows[6] = cfg.rows[7] = kPairs;
  }
  _tile_loadconfig(&cfg);
}

// Runs work(*job) on the calling thread and on up to tasks - 1 threads of XLA's intra-op pool;
// each runner takes tasks from job->next until none are left and counts them in job->done.
// Returns once all tasks are done (tasks still queued on busy pool threads find none left; the
// shared_ptr keeps the job alive for them).
template <typename J, typename Work>
void share_out(ffi::ThreadPool& pool, const std::shared_ptr<J>& job, int64_t tasks, Work work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job, work] { work(*job); });
  work(*job);
  while (job->done.load(std::memory_order_acquire) < tasks) _mm_pause();
}

struct Job {
  const uint16_t* x;  // [M, K]
  const uint16_t* w;  // [P, K/2, 64, 2]
  float* y;           // [M, N]
  int64_t m, k, n, panels, blocks;  // blocks: row blocks of up to 32
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

constexpr int64_t kBlockRows = 2 * kTileRows;
constexpr int64_t kWStride = kPanel * 4;  // bytes from one k pair to the next in a panel

// Store C tile T (rows x 16) at column col of y's rows: straight into y when all 16 columns
// exist, through a buffer for the last panel's partial tile. (A macro: the tile intrinsics take
// the tile number as a literal.)
#define JAXRL_STORE_TILE(T, j, y, col, rows)                                            \
  do {                                                                                  \
    if ((col) + 16 <= (j).n) {                                                          \
      _tile_stored(T, (y) + (col), (j).n * 4);                                         \
    } else if ((col) < (j).n) {                                                         \
      alignas(64) float tmp[kTileRows * 16];                                            \
      _tile_stored(T, tmp, 64);                                                         \
      for (int64_t r = 0; r < (rows); ++r)                                              \
        std::memcpy((y) + r * (j).n + (col), tmp + r * 16, ((j).n - (col)) * sizeof(float)); \
    }                                                                                   \
  } while (0)

// Rows [m0, m0 + rows), rows <= 16, of panel p.
void single(const Job& j, const uint16_t* panel, int64_t p, int64_t m0, int64_t rows) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* x = j.x + m0 * j.k;
  for (int64_t kk = 0; kk < j.k / 2; kk += kPairs) {
    const uint16_t* b = panel + kk * kPanel * 2;
    _tile_loadd(4, x + 2 * kk, j.k * 2);
    _tile_loadd(5, b, kWStride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, kWStride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 64, kWStride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 96, kWStride);
    _tile_dpbf16ps(3, 4, 6);
  }
  float* y = j.y + m0 * j.n;
  const int64_t n0 = p * kPanel;
  JAXRL_STORE_TILE(0, j, y, n0, rows);
  JAXRL_STORE_TILE(1, j, y, n0 + 16, rows);
  JAXRL_STORE_TILE(2, j, y, n0 + 32, rows);
  JAXRL_STORE_TILE(3, j, y, n0 + 48, rows);
}

// Rows [m0, m0 + 16 + r1), 0 < r1 <= 16, of panel p.
void pair(const Job& j, const uint16_t* panel, int64_t p, int64_t m0, int64_t r1) {
  const uint16_t* x0 = j.x + m0 * j.k;
  const uint16_t* x1 = x0 + kTileRows * j.k;
  float* y0 = j.y + m0 * j.n;
  float* y1 = y0 + kTileRows * j.n;
  for (int64_t half = 0; half < 2; ++half) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kk = 0; kk < j.k / 2; kk += kPairs) {
      const uint16_t* b = panel + kk * kPanel * 2 + 64 * half;
      _tile_loadd(4, x0 + 2 * kk, j.k * 2);
      _tile_loadd(6, b, kWStride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + 32, kWStride);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, x1 + 2 * kk, j.k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const int64_t col = p * kPanel + 32 * half;
    JAXRL_STORE_TILE(0, j, y0, col, kTileRows);
    JAXRL_STORE_TILE(1, j, y0, col + 16, kTileRows);
    JAXRL_STORE_TILE(2, j, y1, col, r1);
    JAXRL_STORE_TILE(3, j, y1, col + 16, r1);
  }
}

void work(Job& j) {
  int64_t configured = -1;  // r0 * 64 + r1 of the loaded tile configuration
  const int64_t tasks = j.panels * j.blocks;
  for (int64_t t; (t = j.next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
    const int64_t p = t / j.blocks, m0 = (t % j.blocks) * kBlockRows;
    const int64_t rows = std::min(kBlockRows, j.m - m0);
    const int64_t r0 = std::min(kTileRows, rows), r1 = rows - r0;
    if (r0 * 64 + r1 != configured) {
      configure(r0, r1);
      configured = r0 * 64 + r1;
    }
    const uint16_t* panel = j.w + p * (j.k / 2) * kPanel * 2;
    if (r1 == 0)
      single(j, panel, p, m0, r0);
    else
      pair(j, panel, p, m0, r1);
    j.done.fetch_add(1, std::memory_order_release);
  }
  if (configured >= 0) _tile_release();
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
  job->blocks = (job->m + kBlockRows - 1) / kBlockRows;
  const int64_t tasks = job->panels * job->blocks;
  if (tasks > 0) share_out(pool, job, tasks, work);
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

// ---------------------------------------------------------------------------------------------
// Decode attention: one new token per row. Writes the token's key and value into the cache
// layer at slot pos (in place: the cache outputs alias the cache inputs), then attends over
// slots [0, pos] of the cache, keys stored transposed:
//   q [B, H, D] float32, k, v [B, K, D] (cache dtype), cache kt [B, K, D, S] and cv [B, K, S, D]
//   (float32 or bf16), mask [B, S] (true = may attend), pos [] int32;
//   out [B, H, D] float32, then the updated kt and cv.
// softmax(q.k / sqrt(D)) over the allowed slots in float32, then the weighted sum of values; a
// (b, kv head) pair is one task. D is 64 or 128, S a multiple of 16. Masked slots get
// probability 0, as in jaxrl.model.attention; each row must be allowed its own slot pos.
namespace {

// e^x for x <= 0 (float32, ~1 ulp): 2^n * e^r with |r| <= ln2 / 2, a degree-6 polynomial for e^r.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> float32 (exact)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
struct AttnJob {
  const float* q;
  const T *k, *v;
  T *kt, *cv;
  const bool* mask;
  float* out;
  int64_t b, h, kv, d, s, pos;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <int DB, typename T>  // DB = D / 16
void attend_pair(const AttnJob<T>& j, int64_t bi, int64_t ki, float* scores) {
  constexpr int64_t D = DB * 16;
  const int64_t g = j.h / j.kv, s = j.s, limit = j.pos + 1, blocks = (limit + 15) / 16;
  const int64_t pair = bi * j.kv + ki;
  T* kt = j.kt + pair * D * s;
  T* v = j.cv + pair * s * D;
  for (int64_t di = 0; di < D; ++di) kt[di * s + j.pos] = j.k[pair * D + di];  // the new slot
  std::memcpy(v + j.pos * D, j.v + pair * D, D * sizeof(T));
  const bool* mask = j.mask + bi * s;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t gi = 0; gi < g; ++gi) {
    const int64_t head = ki * g + gi;
    const float* q = j.q + (bi * j.h + head) * D;
    __m512 top = _mm512_set1_ps(-1e30f);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t s0 = blk * 16;
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      for (int64_t di = 0; di < D; di += 2) {
        acc0 = _mm512_fmadd_ps(_mm512_set1_ps(q[di]), load16(kt + di * s + s0), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_set1_ps(q[di + 1]), load16(kt + (di + 1) * s + s0), acc1);
      }
      __mmask16 allowed = 0;
      for (int i = 0; i < 16; ++i)
        if (s0 + i < limit && mask[s0 + i]) allowed |= static_cast<__mmask16>(1u << i);
      const __m512 sc = _mm512_mask_blend_ps(allowed, _mm512_set1_ps(-1e30f),
                                             _mm512_mul_ps(_mm512_add_ps(acc0, acc1),
                                                           _mm512_set1_ps(scale)));
      _mm512_storeu_ps(scores + s0, sc);
      top = _mm512_max_ps(top, sc);
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + 16 * blk), m));
      _mm512_storeu_ps(scores + 16 * blk, p);
      total = _mm512_add_ps(total, p);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(total);
    __m512 acc[DB];
    for (int c = 0; c < DB; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t si = 0; si < limit; ++si) {
      if (!mask[si]) continue;
      const __m512 p = _mm512_set1_ps(scores[si]);
      for (int c = 0; c < DB; ++c) acc[c] = _mm512_fmadd_ps(p, load16(v + si * D + 16 * c), acc[c]);
    }
    float* out = j.out + (bi * j.h + head) * D;
    for (int c = 0; c < DB; ++c)
      _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
  }
}

template <typename T>
void attn_work(AttnJob<T>& j) {
  const int64_t tasks = j.b * j.kv;
  std::unique_ptr<float[]> scores(new float[j.s]);
  for (int64_t t; (t = j.next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
    if (j.d == 64)
      attend_pair<4>(j, t / j.kv, t % j.kv, scores.get());
    else
      attend_pair<8>(j, t / j.kv, t % j.kv, scores.get());
    j.done.fetch_add(1, std::memory_order_release);
  }
}

template <ffi::DataType DT, typename T>
ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<DT> k,
                           ffi::Buffer<DT> v, ffi::Buffer<DT> kt_in, ffi::Buffer<DT> cv_in,
                           ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> pos,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<DT> kt,
                           ffi::ResultBuffer<DT> cv) {
  auto qd = q.dimensions(), kd = kt_in.dimensions(), vd = cv_in.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("decode_attention: q [B, H, D], kt [B, K, D, S], v [B, K, S, D]");
  auto job = std::make_shared<AttnJob<T>>();
  job->b = qd[0], job->h = qd[1], job->d = qd[2], job->kv = kd[1], job->s = kd[3];
  if (kd[0] != job->b || kd[2] != job->d || vd[0] != job->b || vd[1] != job->kv ||
      vd[2] != job->s || vd[3] != job->d || job->h % job->kv || (job->d != 64 && job->d != 128) ||
      job->s % 16 || k.element_count() != static_cast<size_t>(job->b * job->kv * job->d) ||
      v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("decode_attention: shapes disagree or unsupported");
  job->pos = *pos.typed_data();
  if (job->pos < 0 || job->pos >= job->s)
    return ffi::Error::InvalidArgument("decode_attention: pos outside the cache");
  if (kt->typed_data() != kt_in.typed_data() || cv->typed_data() != cv_in.typed_data())
    return ffi::Error::Internal("decode_attention: the cache outputs must alias the inputs");
  job->q = q.typed_data(), job->k = k.typed_data(), job->v = v.typed_data();
  job->kt = kt->typed_data(), job->cv = cv->typed_data();
  job->mask = mask.typed_data(), job->out = out->typed_data();
  share_out(pool, job, job->b * job->kv, attn_work<T>);
  return ffi::Error::Success();
}

}  // namespace

#define JAXRL_ATTENTION_BINDING(DT)          \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<ffi::PRED>>()         \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Ret<ffi::Buffer<ffi::F32>>()          \
      .Ret<ffi::Buffer<DT>>()                \
      .Ret<ffi::Buffer<DT>>()

static constexpr auto DecodeAttentionF32 = DecodeAttention<ffi::F32, float>;
static constexpr auto DecodeAttentionBF16 = DecodeAttention<ffi::BF16, uint16_t>;
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDecodeAttentionF32, DecodeAttentionF32,
                              JAXRL_ATTENTION_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDecodeAttentionBF16, DecodeAttentionBF16,
                              JAXRL_ATTENTION_BINDING(ffi::BF16));
