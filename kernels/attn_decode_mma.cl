// Decode attention on NVIDIA tensor cores (sm_80+): few query rows over a long KV cache.
//
// One work-group = (sequence, kv head, key split).  The query heads of the kv head are packed as
// rows m = i * group + gq (query row i, head hk * group + gq), at most 16 rows: one m16 tile,
// padded with zero rows.  Its Q fragments stay in registers for the whole walk.  K/V tiles of
// BLOCK_N keys stream through STAGES local-memory buffers by cp.async; warp w takes the KW =
// BLOCK_N / WARPS keys [w KW, (w+1) KW) of every tile and keeps its own online-softmax state:
//   S = Q K^T        mma.sync.m16n8k16 (f16/bf16 in, f32 accumulate), K fragments by ldmatrix
//   mask, scale      in the exp2 domain (scale * log2(e) folded into the exponent when it can)
//   online softmax   lazy rescaling of (l, O) when the running max grows by > RESCALE_THRESH
//   O += P V         P re-packed from the S accumulators as the A operand, V by ldmatrix.trans
// At the end the WARPS states are merged through local memory (max, weights 2^(m_w - M)).
// SPLIT=1: the state is written as a float32 partial (out / l, lse) in the layout merge.cl reads
// (part_o[(split * n_out_rows + orow) * HEAD_DIM + col], part_l[split * n_out_rows + orow]);
// SPLIT=0: out (storage dtype) and lse directly.
// FUSED_MERGE=1 (with SPLIT): no merge.cl launch; the last work-group of a (sequence, kv head) to
// finish (a counter per pair, atomic_inc after a GPU-scope fence; the last one resets it to 0)
// merges the n_splits partials itself (flash-decoding's reduction, CUDA's threadFenceReduction).
//
// PAGE_SIZE > 0: k and v are page pools (num_pages, PAGE_SIZE, Hkv, D) (batch stride = page
// stride) and logical key row r of sequence s lives in page block_table[s, r / PAGE_SIZE], slot
// r % PAGE_SIZE (vLLM / FlashInfer, as attn_fwd.cl).  The page indices of a tile travel one
// pipeline step ahead of its K/V: they are copied by 4-byte cp.async into sPg in the commit group
// of the tile STAGES - 1 before it, so the K/V loads never wait on a table read.  Page indices
// are clamped into [0, n_pages) and table columns into [0, tbl_w): no table, however wrong, makes
// the kernel read outside the pool (the staging macros: nv_warp.h, shared with attn_fwd_mma.cl).
//
// Compile-time sizes (-D): HEAD_DIM (= Dv, a multiple of 16), BLOCK_N, WARPS, STAGES (>= 2), IS_BF16,
// SOFTCAP, ALIBI, SCALE_POS (scale > 0), SPLIT, USE_PTX (0: the exact emulation of nv_warp.h),
// PAGE_SIZE (0: k, v are (batch, rows, Hkv, D) arrays).
//
// KV_FORMAT > 0 (kv_format.h: 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8; contract §10): k and v hold
// 8-bit codes with one float scale per (row or slot, kv head) in k_scl / v_scl (element offset,
// batch-or-page stride, row-or-slot stride; the head stride is 1).  Each staged element is
// scale * decode(code) rounded once to the compute dtype (the value an fp16/bf16 cache of the
// dequantized keys would hold): the MMA operands stay fp16/bf16, the global reads halve.  The
// codes are read by plain 8-byte loads and written converted into the same K/V buffers
// (cp.async copies bytes only), so the tile loop, masking and softmax are those of the other
// formats.

// the score transform (score.h) in the exp2 domain, as attn_fwd_mma.cl (no mask)
#define SCORE_LOG2 1
#define SCORE_SOFTCAP SOFTCAP
#define SCORE_ALIBI ALIBI
#include "score.h"
#include "epilogue.h"
#include "nv_warp.h"
#ifndef KV_FORMAT
#define KV_FORMAT 0
#endif
#if KV_FORMAT
#include "kv_format.h"
typedef uchar kv_code_t;
#define QUANT_PARAMS                                                                           \
  , __global const float *k_scl, const long ks_off, const long ks_sb, const long ks_sr,       \
      __global const float *v_scl, const long vs_off, const long vs_sb, const long vs_sr
// 8 codes (a uint2) times the scale SC, as 8 fp16/bf16 values into DST (16 bytes); a zero-filled
// key (codes 0, scale 0) stores zeros
#define STORE_DEQ8(DST, CODES, SC)                                                             \
  {                                                                                            \
    const uint2 c_ = (CODES);                                                                  \
    const float s_ = (SC);                                                                     \
    uint4 h_;                                                                                  \
    h_.x = pack2(kv_decode((uchar)c_.x) * s_, kv_decode((uchar)(c_.x >> 8)) * s_);           \
    h_.y = pack2(kv_decode((uchar)(c_.x >> 16)) * s_, kv_decode((uchar)(c_.x >> 24)) * s_);  \
    h_.z = pack2(kv_decode((uchar)c_.y) * s_, kv_decode((uchar)(c_.y >> 8)) * s_);           \
    h_.w = pack2(kv_decode((uchar)(c_.y >> 16)) * s_, kv_decode((uchar)(c_.y >> 24)) * s_);  \
    *(__local uint4 *)(DST) = h_;                                                              \
  }
#else
typedef ushort kv_code_t;
#define QUANT_PARAMS
#endif

#define THREADS (32 * WARPS)
#define KW (BLOCK_N / WARPS)        // keys of a tile per warp
#define LDS (HEAD_DIM + 8)          // padded row (halves): 8 rows of one ldmatrix hit 8 bank groups
#define TILE (BLOCK_N * LDS)        // halves of one K (or V) tile
#define KSTEPS_QK (HEAD_DIM / 16)   // k-steps of S = Q K^T
#define NT_S (KW / 8)               // 8-key n-tiles of a warp's S
#define KSTEPS_PV (KW / 16)         // k-steps of O = P V
#define NT_O (HEAD_DIM / 8)         // 8-column n-tiles of O
#define CHUNKS (HEAD_DIM / 8)       // 16-byte chunks per row
#define ROW_STEP (THREADS / CHUNKS)
#if KW % 16 || HEAD_DIM % 16 || THREADS % CHUNKS || BLOCK_N % ROW_STEP || STAGES < 2
#error "need BLOCK_N / WARPS % 16 == 0, HEAD_DIM % 16 == 0, 32*WARPS % (HEAD_DIM/8) == 0, STAGES>=2"
#endif
// the final merge of the warps' O (WARPS x 16 x HEAD_DIM floats) reuses the K/V buffers
#if WARPS * 16 * HEAD_DIM * 4 > STAGES * 2 * TILE * 2
#error "K/V buffers too small for the warps' merge"
#endif
// cp.async groups left in flight at the top of a tile (wait_group takes a literal)
#if STAGES == 2
#define CP_PENDING 0
#elif STAGES == 3
#define CP_PENDING 1
#elif STAGES == 4
#define CP_PENDING 2
#elif STAGES == 5
#define CP_PENDING 3
#else
#error "STAGES must be 2..5"
#endif
#ifndef FUSED_MERGE
#define FUSED_MERGE 0
#endif
#if FUSED_MERGE && !SPLIT
#error "FUSED_MERGE needs SPLIT"
#endif
#define FUSED_UNROLL 16
#define EMPTY_W (-1.f) /* the fused merge's weight of an empty split state */

__kernel __attribute__((reqd_work_group_size(THREADS, 1, 1)))
void attn_decode_mma(__global const ushort *q, __global const kv_code_t *k,
                     __global const kv_code_t *v,
                     __global uint *out, __global float *lse,      // SPLIT=0
                     __global float *part_o, __global float *part_l,  // SPLIT=1
                     __global const float *sinks,  // (Hq,) when n_sinks (not into partials)
                     __global const int *tiles,    // (n_seq', 2): sequence, 0 (see the module)
                     __global const long *seqs,    // (n_seq, SEQ_FIELDS)
                     __global const float *alibi,  // (n_seq, Hq) slopes * log2(e), when ALIBI
                     __global uint *counters,      // (n_cols, n_kv_heads) zeros, FUSED_MERGE
                     const long q_off, const long q_sb, const long q_sr, const long q_sh,
                     const long k_off, const long k_sb, const long k_sr, const long k_sh,
                     const long v_off, const long v_sb, const long v_sr, const long v_sh,
                     const int sq_arr, const int n_heads, const int group, const int ring,
                     const long n_out_rows, const float qk_scale, const float cap,
                     const int n_sinks QUANT_PARAMS PAGED_PARAMS) {
  __local uint4 smem[STAGES * 2 * TILE / 8];   // STAGES x (K tile, V tile)
  __local ushort sQ[16 * LDS] __attribute__((aligned(16)));
  __local float sM[WARPS * 16], sL[WARPS * 16];
#if !USE_PTX
  __local uint scr_all[WARPS * 256];
  __local uint *scr = scr_all + (get_local_id(0) >> 5) * 256;
#endif
#if FUSED_MERGE
  __local int last_wg;
#endif
#if PAGE_SIZE
  __local int sPg[STAGES * NPG];  // the table entries of STAGES tiles (slot = the tile's buffer)
#endif
  __local int v_flag;  // = t + 1 when tile t's V held inf/NaN (a new value per tile: no reset)
  __local ushort *sKV = (__local ushort *)smem;
  const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tg = lane & 3;
  if (tid == 0) v_flag = 0;
  const int hk = get_group_id(1), split = get_group_id(2), n_splits = get_num_groups(2);
  const int s = tiles[2 * get_group_id(0)];
  __global const long *sp = seqs + (long)s * SEQ_FIELDS;
  LOAD_SEQ(sp)
  const int nrows = qlen * group;  // <= 16

  // keys some row sees: [lo_blk, hi_blk]; keys every row sees: [lo_all, hi_all]
  const int lo_blk = row_lo(0, base, dlo, klen), hi_blk = row_hi(qlen - 1, base, dhi, klen);
  const int lo_all = row_lo(qlen - 1, base, dlo, klen), hi_all = row_hi(0, base, dhi, klen);
  // this lane's rows g and g + 8 (padding rows behave as the last real row; never written)
  int rlo[2], rhi[2];
  long ri[2];
#if ALIBI
  float slope[2];
#endif
  UNROLL for (int hf = 0; hf < 2; hf++) {
    const int m = min(g + 8 * hf, nrows - 1);
    ri[hf] = m / group;
    rlo[hf] = row_lo(ri[hf], base, dlo, klen);
    rhi[hf] = row_hi(ri[hf], base, dhi, klen);
#if ALIBI
    slope[hf] = alibi[(long)s * n_heads + hk * group + m % group];
#endif
  }
  // this split's key tiles (flash-decoding: the block's tiles cut into n_splits runs)
  int t_first = 0, t_last = -1;
  if (hi_blk >= lo_blk) {
    const int t0 = lo_blk / BLOCK_N, n_t = hi_blk / BLOCK_N - t0 + 1;
    const int per = (n_t + n_splits - 1) / n_splits;
    t_first = t0 + split * per;
    t_last = min(t0 + n_t - 1, t_first + per - 1);
  }

  __global const kv_code_t *kh = k + k_off + kb * k_sb + hk * k_sh;
  __global const kv_code_t *vh = v + v_off + kb * v_sb + hk * v_sh;
#if KV_FORMAT
  __global const float *ksh = k_scl + ks_off + kb * ks_sb + hk;
  __global const float *vsh = v_scl + vs_off + kb * vs_sb + hk;
#endif
#if PAGE_SIZE
  // The table row of this sequence; entries of tile TL: columns (krow0 + TL BLOCK_N) / PAGE_SIZE
  // + [0, NPG), clamped to the row, copied into slot SLOT of sPg.
  __global const int *tbl = block_table + tbl_off + (long)s * tbl_s0;
// the pool element offsets (K, V) of logical key row ROW of tile TL, whose entries are in SLOT
#define PAGED_OFF(ROW, TL, SLOT, KO, VO)                                                       \
  {                                                                                            \
    const long pg_ = clamp(sPg[(SLOT) * NPG + (int)((ROW) / PAGE_SIZE - PG_FIRST(TL))], 0,     \
                           n_pages - 1);                                                       \
    const long sl_ = (ROW) % PAGE_SIZE;                                                        \
    KO = pg_ * k_sb + sl_ * k_sr;                                                              \
    VO = pg_ * v_sb + sl_ * v_sr;                                                              \
  }
#endif
// Checked tile load: keys outside [lo_blk, hi_blk] are zero-filled (never read), ring rows wrap.
#if PAGE_SIZE
#define LOAD_KV_CHECKED(TL, BUF)                                                               \
  for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {                                      \
    const int r = c / CHUNKS, ch = c % CHUNKS, j = (TL) * BLOCK_N + r;                         \
    __local ushort *dk = sKV + (BUF) * 2 * TILE + r * LDS + ch * 8;                            \
    if (j >= lo_blk && j <= hi_blk) {                                                          \
      long ko, vo;                                                                             \
      PAGED_OFF(krow0 + j, TL, BUF, ko, vo)                                                    \
      CP_ASYNC16(dk, kh + ko + ch * 8);                                                        \
      CP_ASYNC16(dk + TILE, vh + vo + ch * 8);                                                 \
    } else {                                                                                   \
      ZERO16(dk);                                                                              \
      ZERO16(dk + TILE);                                                                       \
    }                                                                                          \
  }
#else
#define LOAD_KV_CHECKED(TL, BUF)                                                               \
  for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {                                      \
    const int r = c / CHUNKS, ch = c % CHUNKS, j = (TL) * BLOCK_N + r;                         \
    __local ushort *dk = sKV + (BUF) * 2 * TILE + r * LDS + ch * 8;                            \
    if (j >= lo_blk && j <= hi_blk) {                                                          \
      long row = krow0 + j;                                                                    \
      if (ring > 0 && row >= ring) row -= ring;                                                \
      CP_ASYNC16(dk, kh + row * k_sr + ch * 8);                                                \
      CP_ASYNC16(dk + TILE, vh + row * v_sr + ch * 8);                                         \
    } else {                                                                                   \
      ZERO16(dk);                                                                              \
      ZERO16(dk + TILE);                                                                       \
    }                                                                                          \
  }
#endif
// Fast path (tile inside the range, no wrap): each thread copies one 16-byte column chunk of
// rows r0, r0 + ROW_STEP, ... from pointers hoisted out of the loop (paged: through the tile's
// table entries in sPg).
#if PAGE_SIZE
#define LOAD_KV(TL, BUF)                                                                       \
  {                                                                                            \
    const int n0_ = (TL) * BLOCK_N;                                                            \
    if (n0_ >= lo_blk && n0_ + BLOCK_N - 1 <= hi_blk) {                                        \
      __local ushort *st = sKV + (BUF) * 2 * TILE + so0;                                       \
      /* row r0 + i ROW_STEP: entry e0 + (s0 + i ROW_STEP) / PAGE_SIZE, 32-bit from here on */  \
      const long rb_ = krow0 + n0_ + r0_;                                                      \
      const int e0_ = (int)(rb_ / PAGE_SIZE - PG_FIRST(TL)), s0_ = (int)(rb_ % PAGE_SIZE);     \
      __local const int *pgs_ = sPg + (BUF) * NPG + e0_;                                       \
      UNROLL for (int i = 0; i < BLOCK_N / ROW_STEP; i++) {                                    \
        const int o_ = s0_ + i * ROW_STEP;                                                     \
        const long pg_ = clamp(pgs_[o_ / PAGE_SIZE], 0, n_pages - 1);                          \
        const long sl_ = o_ % PAGE_SIZE;                                                       \
        CP_ASYNC16(st + i * ROW_STEP * LDS, kc0 + pg_ * k_sb + sl_ * k_sr);                    \
        CP_ASYNC16(st + TILE + i * ROW_STEP * LDS, vc0 + pg_ * v_sb + sl_ * v_sr);             \
      }                                                                                        \
    } else {                                                                                   \
      LOAD_KV_CHECKED(TL, BUF)                                                                 \
    }                                                                                          \
  }
#else
#define LOAD_KV(TL, BUF)                                                                       \
  {                                                                                            \
    const int n0_ = (TL) * BLOCK_N;                                                            \
    if (n0_ >= lo_blk && n0_ + BLOCK_N - 1 <= hi_blk &&                                        \
        (ring == 0 || krow0 + n0_ + BLOCK_N <= ring)) {                                        \
      __global const ushort *kt = kp0 + n0_ * k_sr, *vt = vp0 + n0_ * v_sr;                    \
      __local ushort *st = sKV + (BUF) * 2 * TILE + so0;                                       \
      UNROLL for (int i = 0; i < BLOCK_N / ROW_STEP; i++) {                                    \
        CP_ASYNC16(st + i * ROW_STEP * LDS, kt + i * k_step);                                  \
        CP_ASYNC16(st + TILE + i * ROW_STEP * LDS, vt + i * v_step);                           \
      }                                                                                        \
    } else {                                                                                   \
      LOAD_KV_CHECKED(TL, BUF)                                                                 \
    }                                                                                          \
  }
#endif
#if KV_FORMAT
// 8-bit K/V: every tile by one checked loop, each chunk's 8 codes decoded and scaled on the way
// (plain loads: cp.async copies bytes, the conversion needs registers)
#if PAGE_SIZE
#define QROW_OFF(ROW, TL, SLOT, KO, VO, KS, VS)                                                \
  {                                                                                            \
    const long pg_ = clamp(sPg[(SLOT) * NPG + (int)((ROW) / PAGE_SIZE - PG_FIRST(TL))], 0,     \
                           n_pages - 1);                                                       \
    const long sl_ = (ROW) % PAGE_SIZE;                                                        \
    KO = pg_ * k_sb + sl_ * k_sr;                                                              \
    VO = pg_ * v_sb + sl_ * v_sr;                                                              \
    KS = pg_ * ks_sb + sl_ * ks_sr;                                                            \
    VS = pg_ * vs_sb + sl_ * vs_sr;                                                            \
  }
#else
#define QROW_OFF(ROW, TL, SLOT, KO, VO, KS, VS)                                                \
  {                                                                                            \
    long row_ = (ROW);                                                                         \
    if (ring > 0 && row_ >= ring) row_ -= ring;                                                \
    KO = row_ * k_sr;                                                                          \
    VO = row_ * v_sr;                                                                          \
    KS = row_ * ks_sr;                                                                         \
    VS = row_ * vs_sr;                                                                         \
  }
#endif
#undef LOAD_KV
// QB chunks per thread at a time: their codes and scales loaded first, then decoded and stored
// (QB loads in flight per thread instead of one)
#define QB 4
#if (BLOCK_N * CHUNKS) % (QB * THREADS)
#error "KV_FORMAT needs BLOCK_N * HEAD_DIM / 8 to be a multiple of 4 * 32 * WARPS"
#endif
#define LOAD_KV(TL, BUF)                                                                       \
  for (int c0 = tid; c0 < BLOCK_N * CHUNKS; c0 += QB * THREADS) {                              \
    uint2 kq_[QB], vq_[QB];                                                                    \
    float kf_[QB], vf_[QB];                                                                    \
    UNROLL for (int u = 0; u < QB; u++) {                                                      \
      const int c = c0 + u * THREADS, r = c / CHUNKS, ch = c % CHUNKS, j = (TL) * BLOCK_N + r;  \
      kq_[u] = vq_[u] = (uint2)(0u, 0u);                                                       \
      kf_[u] = vf_[u] = 0.f;                                                                   \
      if (j >= lo_blk && j <= hi_blk) {                                                        \
        long ko, vo, kso, vso;                                                                 \
        QROW_OFF(krow0 + j, TL, BUF, ko, vo, kso, vso)                                         \
        kq_[u] = *(__global const uint2 *)(kh + ko + ch * 8);                                  \
        vq_[u] = *(__global const uint2 *)(vh + vo + ch * 8);                                  \
        kf_[u] = ksh[kso];                                                                     \
        vf_[u] = vsh[vso];                                                                     \
      }                                                                                        \
    }                                                                                          \
    UNROLL for (int u = 0; u < QB; u++) {                                                      \
      const int c = c0 + u * THREADS, r = c / CHUNKS, ch = c % CHUNKS;                         \
      __local ushort *dk = sKV + (BUF) * 2 * TILE + r * LDS + ch * 8;                          \
      STORE_DEQ8(dk, kq_[u], kf_[u]);                                                          \
      STORE_DEQ8(dk + TILE, vq_[u], vf_[u]);                                                   \
    }                                                                                          \
  }
#endif
  const int r0_ = tid / CHUNKS, ch0_ = tid % CHUNKS, so0 = r0_ * LDS + ch0_ * 8;
#if PAGE_SIZE && !KV_FORMAT
  __global const ushort *kc0 = kh + ch0_ * 8, *vc0 = vh + ch0_ * 8;
#endif
#if PAGE_SIZE
  // the entries of the prologue's tiles, before any K/V load (once per work-group)
  for (int st = 0; st < STAGES - 1; st++) {
    if (t_first + st <= t_last) FETCH_PAGES(t_first + st, st)
  }
  CP_COMMIT();
  CP_WAIT(0);
  barrier(CLK_LOCAL_MEM_FENCE);
#elif !KV_FORMAT
  __global const ushort *kp0 = kh + (krow0 + r0_) * k_sr + ch0_ * 8;
  __global const ushort *vp0 = vh + (krow0 + r0_) * v_sr + ch0_ * 8;
  const long k_step = ROW_STEP * k_sr, v_step = ROW_STEP * v_sr;
#endif

  // -- prologue: the first STAGES - 1 tiles in flight (one commit group per tile, empty or not)
  int ld_t = t_first, ld_buf = 0;
  for (int st = 0; st < STAGES - 1; st++) {
#if PAGE_SIZE
    // the entries of tile ld_t + STAGES - 1 ride with tile ld_t (slot (ld_buf - 1) mod STAGES,
    // read by the previous step: a barrier first)
    if (st > 0) barrier(CLK_LOCAL_MEM_FENCE);
    if (ld_t <= t_last) LOAD_KV(ld_t, ld_buf)
    if (ld_t + STAGES - 1 <= t_last)
      FETCH_PAGES(ld_t + STAGES - 1, ld_buf == 0 ? STAGES - 1 : ld_buf - 1)
#else
    if (ld_t <= t_last) LOAD_KV(ld_t, ld_buf)
#endif
    CP_COMMIT();
    ld_t++;
    ld_buf = ld_buf + 1 == STAGES ? 0 : ld_buf + 1;
  }

  // -- Q rows (plain 16-byte loads, zero padding rows), after the K/V loads are in flight:
  // a load's latency before the first cp.async would delay the whole stream
  __global const ushort *qh = q + q_off + qb * q_sb + (long)hk * group * q_sh;
  for (int c = tid; c < 16 * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, ch = c % CHUNKS;
    __local ushort *dst = sQ + r * LDS + ch * 8;
    if (r < nrows) {
      *(__local uint4 *)dst =
          *(__global const uint4 *)(qh + (qrow0 + r / group) * q_sr + (r % group) * q_sh + ch * 8);
    } else {
      ZERO16(dst);
    }
  }

  barrier(CLK_LOCAL_MEM_FENCE);  // sQ written
  uint qa[KSTEPS_QK][4];
  UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
    const int row = (lane & 7) + ((lane >> 3) & 1) * 8;
    LDSM_X4(qa[kk], sQ, row * LDS + kk * 16 + (lane >> 4) * 8);
  }

  float o[NT_O][4], m_i[2], l_i[2];
  UNROLL for (int nd = 0; nd < NT_O; nd++) {
    UNROLL for (int c = 0; c < 4; c++) o[nd][c] = 0.f;
  }
  UNROLL for (int hf = 0; hf < 2; hf++) { m_i[hf] = -INFINITY; l_i[hf] = 0.f; }
  const int kw0 = warp * KW;  // this warp's first key in a tile

  int buf = 0;
  for (int t = t_first; t <= t_last; t++) {
    // -- tile t has landed; after the barrier nobody reads tile t-1's buffer any more, so the
    // load of tile t + STAGES - 1 goes there (one barrier per tile)
    CP_WAIT(CP_PENDING);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (ld_t <= t_last) LOAD_KV(ld_t, ld_buf)
#if PAGE_SIZE
    // slot (ld_buf - 1) mod STAGES held the entries of tile ld_t - 1, read before the barrier
    if (ld_t + STAGES - 1 <= t_last)
      FETCH_PAGES(ld_t + STAGES - 1, ld_buf == 0 ? STAGES - 1 : ld_buf - 1)
#endif
    CP_COMMIT();
    ld_t++;
    ld_buf = ld_buf + 1 == STAGES ? 0 : ld_buf + 1;
    __local ushort *sK = sKV + buf * 2 * TILE;
    __local ushort *sV = sK + TILE;
    buf = buf + 1 == STAGES ? 0 : buf + 1;
    const int n0 = t * BLOCK_N;
    const bool need_mask = !(n0 >= lo_all && n0 + BLOCK_N - 1 <= hi_all);

    // -- hidden keys must contribute nothing even when their v holds inf/NaN, but the mma
    // multiplies P = 0 by it.  Only keys in [lo_blk, hi_blk] hidden from some row can (others
    // are zero-filled): in such tiles the non-finite v values are zeroed for the mma and added
    // back after PV, from global memory, to the rows that see them (rare: q_len > 1 or window).
    int v_bad = 0;
    if ((n0 < lo_all && n0 + BLOCK_N - 1 >= lo_blk) || (n0 + BLOCK_N - 1 > hi_all && n0 <= hi_blk))
      SCAN_HIDDEN_V16(sV, LDS)

    // -- S = Q K^T over this warp's KW keys
    float sacc[NT_S][4];
    UNROLL for (int nt = 0; nt < NT_S; nt++) {
      UNROLL for (int c = 0; c < 4; c++) sacc[nt][c] = 0.f;
    }
    UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
      UNROLL for (int n2 = 0; n2 < NT_S / 2; n2++) {
        uint kf[4];
        const int key = kw0 + n2 * 16 + (lane & 7) + (lane >> 4) * 8;
        LDSM_X4(kf, sK, key * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
        MMA(sacc[2 * n2], qa[kk], kf[0], kf[1]);
        MMA(sacc[2 * n2 + 1], qa[kk], kf[2], kf[3]);
      }
    }

    // -- scores in the exp2 domain (score.h; slope[hf]: with ALIBI only)
    UNROLL for (int nt = 0; nt < NT_S; nt++) {
      UNROLL for (int c = 0; c < 4; c++) {
        const int j = n0 + kw0 + nt * 8 + 2 * tg + (c & 1), hf = c >> 1;
        SCORE_VARIANT(sacc[nt][c], qk_scale, cap, slope[hf], ri[hf] + base - j, j, rlo[hf],
                      rhi[hf], 0, need_mask)
      }
    }

    // -- online softmax (lazy rescaling, exact: P = 2^(S - m) with m at most RESCALE_THRESH
    // below the true running max, l and O rescaled only when some row's max grew more)
    float m_new[2];
    int grow = 0;
    UNROLL for (int hf = 0; hf < 2; hf++) {
      float mx = -INFINITY;
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        mx = fmax(mx, fmax(sacc[nt][2 * hf], sacc[nt][2 * hf + 1]));
      }
      mx = fmax(mx, SHFL_XOR(mx, 1));
      mx = fmax(mx, SHFL_XOR(mx, 2));
      m_new[hf] = fmax(m_i[hf], SCORE_MAX(mx, qk_scale));
      grow |= m_new[hf] - m_i[hf] > RESCALE_THRESH;  // false while both are -inf
    }
    if (WARP_ANY(grow)) {
      UNROLL for (int hf = 0; hf < 2; hf++) {
        const float m_use = m_new[hf] == -INFINITY ? 0.f : m_new[hf];
        const float alpha = ex2(m_i[hf] - m_use);
        m_i[hf] = m_new[hf];
        l_i[hf] *= alpha;
        UNROLL for (int nd = 0; nd < NT_O; nd++) {
          o[nd][2 * hf] *= alpha;
          o[nd][2 * hf + 1] *= alpha;
        }
      }
    }
    UNROLL for (int hf = 0; hf < 2; hf++) {
      const float m_use = m_i[hf] == -INFINITY ? 0.f : m_i[hf];  // a row seeing nothing yet
      float rs = 0.f;
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        UNROLL for (int c = 0; c < 2; c++) {
          const float p = ex2(SCORE_P_ARG(sacc[nt][2 * hf + c], m_use, qk_scale));
          sacc[nt][2 * hf + c] = p;
          rs += p;
        }
      }
      l_i[hf] += rs;
    }

    // -- O += P V: the S accumulators of n-tiles 2 t2, 2 t2 + 1 are the A fragment of k-step t2
    UNROLL for (int t2 = 0; t2 < KSTEPS_PV; t2++) {
      uint pa[4];
      pa[0] = pack2(sacc[2 * t2][0], sacc[2 * t2][1]);
      pa[1] = pack2(sacc[2 * t2][2], sacc[2 * t2][3]);
      pa[2] = pack2(sacc[2 * t2 + 1][0], sacc[2 * t2 + 1][1]);
      pa[3] = pack2(sacc[2 * t2 + 1][2], sacc[2 * t2 + 1][3]);
      UNROLL for (int n2 = 0; n2 < NT_O / 2; n2++) {
        uint vf[4];
        const int key = kw0 + t2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        LDSM_X4_T(vf, sV, key * LDS + n2 * 16 + (lane >> 4) * 8);
        MMA(o[2 * n2], pa, vf[0], vf[1]);
        MMA(o[2 * n2 + 1], pa, vf[2], vf[3]);
      }
    }

    // -- the inf/NaN zeroed above, for this warp's keys and the rows that see them
    if (v_bad) {
      UNROLL for (int hf = 0; hf < 2; hf++) {
        const int j_hi = min(rhi[hf], n0 + kw0 + KW - 1);
        for (int j = max(rlo[hf], n0 + kw0); j <= j_hi; j++) {
#if PAGE_SIZE
          const long row = krow0 + j;
          const long pg = clamp((long)tbl[min(row / PAGE_SIZE, (long)(tbl_w - 1)) * tbl_s1], 0L,
                                (long)(n_pages - 1));
          __global const kv_code_t *vr = vh + pg * v_sb + (row % PAGE_SIZE) * v_sr + 2 * tg;
#if KV_FORMAT
          const float vsc = vsh[pg * vs_sb + (row % PAGE_SIZE) * vs_sr];
#endif
#else
          long row = krow0 + j;
          if (ring > 0 && row >= ring) row -= ring;
          __global const kv_code_t *vr = vh + row * v_sr + 2 * tg;
#if KV_FORMAT
          const float vsc = vsh[row * vs_sr];
#endif
#endif
          UNROLL for (int nd = 0; nd < NT_O; nd++) {
            UNROLL for (int e = 0; e < 2; e++) {
#if KV_FORMAT  // the staged value's bits (as STORE_DEQ8 rounds it)
              const uint b = pack2(kv_decode(vr[nd * 8 + e]) * vsc, 0.f) & 0xffffu;
#else
              const uint b = vr[nd * 8 + e];
#endif
              if (NONFINITE16(b)) o[nd][2 * hf + e] += nonfinite_value(b);
            }
          }
        }
      }
    }
  }
  CP_WAIT(0);

  // -- merge the warps' states: M = max m_w, L = sum l_w 2^(m_w - M), O = sum O_w 2^(m_w - M)
  UNROLL for (int hf = 0; hf < 2; hf++) {
    l_i[hf] += SHFL_XOR(l_i[hf], 1);
    l_i[hf] += SHFL_XOR(l_i[hf], 2);
  }
  barrier(CLK_LOCAL_MEM_FENCE);  // every warp is done with the K/V buffers
  __local float *sO = (__local float *)smem;
  UNROLL for (int hf = 0; hf < 2; hf++) {
    const int r = g + 8 * hf;
    if (tg == 0) {
      sM[warp * 16 + r] = m_i[hf];
      sL[warp * 16 + r] = l_i[hf];
    }
    if (r < nrows) {  // padding rows are never read
      UNROLL for (int nd = 0; nd < NT_O; nd++) {
        *(__local float2 *)(sO + (warp * 16 + r) * HEAD_DIM + nd * 8 + 2 * tg) =
            (float2)(o[nd][2 * hf], o[nd][2 * hf + 1]);
      }
    }
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int idx = tid; idx < nrows * (HEAD_DIM / 2); idx += THREADS) {
    const int r = idx / (HEAD_DIM / 2), col = 2 * (idx % (HEAD_DIM / 2));
    float mm = -INFINITY;
    for (int w = 0; w < WARPS; w++) mm = fmax(mm, sM[w * 16 + r]);
    float l = 0.f, o0 = 0.f, o1 = 0.f;
    for (int w = 0; w < WARPS; w++) {
      const float mw = sM[w * 16 + r];
      if (mw != -INFINITY) {  // a warp that saw no key of this row adds nothing
        const float wt = ex2(mw - mm);
        const float2 ow = *(__local const float2 *)(sO + (w * 16 + r) * HEAD_DIM + col);
        l += sL[w * 16 + r] * wt;
        o0 += ow.x * wt;
        o1 += ow.y * wt;
      }
    }
    const long row = qrow0 + r / group;
    const int h = hk * group + r % group;
    const long orow = (qb * sq_arr + row) * n_heads + h;
    // the epilogue (epilogue.h); a split's partial state takes no sink
    float inv, lse_r;
    EPI_FINISH(1, float, mm, l, !SPLIT && n_sinks, sinks[h], inv, lse_r)
#if SPLIT
    *(__global float2 *)(part_o + (split * n_out_rows + orow) * HEAD_DIM + col) =
        (float2)(o0 * inv, o1 * inv);
    if (col == 0) part_l[split * n_out_rows + orow] = lse_r;
#if FUSED_MERGE
    GLOBAL_FENCE();  // this thread's partial writes before the counter (threadFenceReduction)
#endif
#else
    out[(orow * HEAD_DIM + col) / 2] = pack2(o0 * inv, o1 * inv);
    if (col == 0) lse[(qb * n_heads + h) * sq_arr + row] = lse_r;
#endif
  }
#if FUSED_MERGE
  // -- the last split of this (sequence, kv head) merges all partials (merge.cl's rule:
  // lse = M + log sum_s e^(lse_s - M), out = sum_s e^(lse_s - M) out_s / sum; empty states
  // (lse_s = -inf) weigh 0, NaN propagates)
  barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);  // every thread fenced; sO/sM reads done
  if (tid == 0) {
    __global uint *cnt = counters + get_group_id(0) * get_num_groups(1) + hk;
    const uint done = atomic_inc(cnt);
    last_wg = done == (uint)(n_splits - 1);
    if (last_wg) *cnt = 0u;  // every split has counted: ready for the next launch
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (!last_wg) return;  // uniform in the work-group
  GLOBAL_FENCE();
  // weights in __local (the K/V buffers: the host keeps n_splits * 16 floats within them)
  __local float *sW = (__local float *)smem;
  volatile __global const float *vl = part_l, *vo = part_o;  // other SMs' writes: no L1
  for (int idx = tid; idx < n_splits * nrows; idx += THREADS) {
    const int sp_ = idx / nrows, r = idx % nrows;
    const long orow = (qb * sq_arr + qrow0 + r / group) * n_heads + hk * group + r % group;
    sW[sp_ * 16 + r] = vl[sp_ * n_out_rows + orow];
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (tid < nrows) {
    float mm = -INFINITY;
    for (int j = 0; j < n_splits; j++) {
      const float x = sW[j * 16 + tid];
      mm = (x > mm || isnan(x)) ? x : mm;
    }
    sM[tid] = mm;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int idx = tid; idx < n_splits * nrows; idx += THREADS) {
    const int sp_ = idx / nrows, r = idx % nrows;
    const float x = sW[sp_ * 16 + r], mm = sM[r];
    // an empty split state gets the weight EMPTY_W and is left out by the selects below; any
    // other weight, 0 or NaN included, multiplies its output, so NaN from a seen key survives
    sW[sp_ * 16 + r] = (x == -INFINITY || mm == -INFINITY) ? EMPTY_W : exp(x - mm);
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  if (tid < nrows) {
    float sum = 0.f;
    for (int j = 0; j < n_splits; j++) {
      const float w = sW[j * 16 + tid];
      sum += w == EMPTY_W ? 0.f : w;
    }
    sL[tid] = sum;
  }
  barrier(CLK_LOCAL_MEM_FENCE);
  // 4 columns per item, FUSED_UNROLL 16-byte loads in flight per thread (32 splits x 4 rows:
  // 2 round trips to L2 with 128 threads)
  for (int idx = tid; idx < nrows * (HEAD_DIM / 4); idx += THREADS) {
    const int r = idx / (HEAD_DIM / 4), col = 4 * (idx % (HEAD_DIM / 4));
    const long row = qrow0 + r / group;
    const int h = hk * group + r % group;
    const long orow = (qb * sq_arr + row) * n_heads + h;
    float4 o4 = (float4)(0.f);
    int j = 0;
    for (; j + FUSED_UNROLL <= n_splits; j += FUSED_UNROLL) {  // loads before their FMAs
      float4 x[FUSED_UNROLL];
      UNROLL for (int u = 0; u < FUSED_UNROLL; u++) {
        x[u] = *(volatile __global const float4 *)(vo + ((j + u) * n_out_rows + orow) * HEAD_DIM
                                                   + col);
      }
      UNROLL for (int u = 0; u < FUSED_UNROLL; u++) {
        const float wt = sW[(j + u) * 16 + r];
        o4 += wt != EMPTY_W ? wt * x[u] : (float4)(0.f);  // a select: empty states never leak
      }
    }
    for (; j < n_splits; j++) {
      const float wt = sW[j * 16 + r];
      const float4 x = *(volatile __global const float4 *)(vo + (j * n_out_rows + orow) * HEAD_DIM
                                                           + col);
      o4 += wt != EMPTY_W ? wt * x : (float4)(0.f);
    }
    // the merged state (natural log; empty: every split empty, sum 0) through the epilogue
    // (epilogue.h), the sink folded in once
    const float mm = sM[r], sum = sL[r];
    float inv, lse_r;
    EPI_FINISH(0, float, mm, sum, n_sinks, sinks[h], inv, lse_r)
    o4 *= inv;
    *(__global uint2 *)(out + (orow * HEAD_DIM + col) / 2) =
        (uint2)(pack2(o4.x, o4.y), pack2(o4.z, o4.w));
    if (col == 0) lse[(qb * n_heads + h) * sq_arr + row] = lse_r;
  }
#endif
}
