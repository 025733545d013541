// FlashAttention forward on Hopper's warpgroup MMA (wgmma.mma_async, sm_90a), 16-bit storage.
//
// Built by _nvidia_wgmma.py: this OpenCL C carries wgmma *markers* (PTX comments that name the
// registers, macros WG_* prepended by the host), NVIDIA's compiler turns it into PTX, the host
// rewrites the markers into the instructions and builds that PTX for sm_90a.
//
// One work-group = BLOCK_M = 64 * WGS query rows of one sequence and one query head; warpgroup w
// (128 threads) owns rows 64 w .. 64 w + 63, its warp j rows 16 j .. 16 j + 15 of those (the
// accumulator layout of m64nNk16 is mma.sync's m16n8 layout per warp, repeated per 8 columns).
// For every key tile of BLOCK_N keys, shared by the warpgroups:
//   S = Q K^T    wgmma m64n{BLOCK_N}k16, Q and K from shared memory (descriptors), f32 accumulate
//   mask, scale, online softmax in the exp2 domain (as attn_fwd_mma.cl, lazy rescaling)
//   O += P V     wgmma m64n{HEAD_DIM}k16, P from registers (the S accumulators re-packed as the
//                A fragment), V from shared memory read N-major (imm-trans-b = 1)
// K/V tiles are double-buffered with cp.async; tiles no row can see are never visited.
//
// Shared-memory layout of Q, K and V tiles: the 128-byte swizzle (CUTLASS's default for wgmma;
// see SMEM_ALIGN below). The two warpgroups take turns to issue their products at D >= 128
// (WG_PINGPONG). bench/RESULTS.md has the measurements behind both choices.
//
// Compile-time sizes (-D): HEAD_DIM (64 or 128), WGS (1..3), BLOCK_N (multiple of 16, at most
// 256), IS_BF16, SOFTCAP, ALIBI, SCALE_POS, HEADS_INNER, USE_PTX.

#ifndef USE_PTX
#define USE_PTX 1
#endif
#define BLOCK_M (64 * WGS)
#define THREADS (128 * WGS)
#define ELEM ushort
#define CHUNKS (HEAD_DIM / 8)       // 16-byte chunks per row
#define NT_S (BLOCK_N / 8)          // 8-column n-tiles of S
#define NT_O (HEAD_DIM / 8)         // 8-column n-tiles of O
#define KSTEPS_QK (HEAD_DIM / 16)
#define KSTEPS_PV (BLOCK_N / 16)
#define TILE_BYTES(R) ((R) * HEAD_DIM * 2)
#if HEAD_DIM % 16 || BLOCK_N % 16 || BLOCK_N > 256 || HEAD_DIM > 256
#error "HEAD_DIM and BLOCK_N must be multiples of 16, at most 256"
#endif
#if (BLOCK_N * CHUNKS) % THREADS || (BLOCK_M * CHUNKS) % THREADS
#error "a tile's chunks must divide among the threads"
#endif
#if IS_BF16
#define WG_TYPE "bf16"
#else
#define WG_TYPE "f16"
#endif
#ifndef HEADS_INNER
#define HEADS_INNER 0
#endif
// The 128-byte-swizzle layouts: a tile of R rows is HEAD_DIM / 64 blocks of 64 columns, block b
// at bytes 128 R b, row r at 128 r, its 16-byte chunk c at 16 (c ^ r % 8) (the hardware XORs
// address bits 4-6 with bits 7-9: arrays 1024-byte aligned). As K-major operands (Q, K) the
// 8-row groups are SBO = 1024 bytes apart and a k-slice of 16 moves the start address by 32
// bytes (by 128 R at a new block); as the N-major V, the 64-column blocks are LBO = 128 R apart
// and the 8-key groups SBO = 1024. Loads are row-major (16 threads per 256-byte row).
// WG_PINGPONG (WGS=2, D >= 128): FA3's inter-warpgroup ping-pong. The two warpgroups take turns
// to issue their products (named barriers 1 and 2: a warpgroup waits for its turn, issues S or
// P V, then passes the turn), so one's softmax runs while the other's products occupy the
// tensor cores instead of both softmaxes coinciding. Only the issue order changes; the
// emulation (USE_PTX=0) ignores it. The work-group barrier of each tile (K/V buffer reuse)
// brings the two warpgroups back in step.
#define WG_PINGPONG (WGS == 2 && HEAD_DIM >= 128)
// the inf/NaN scan's zeroed values (nv_warp.h) must reach wgmma's reads of V
#define SCAN_FENCE() FENCE_ASYNC_SHARED();
// the score transform (score.h) in the exp2 domain, as attn_fwd_mma.cl (no mask)
#define SCORE_LOG2 1
#define SCORE_SOFTCAP SOFTCAP
#define SCORE_ALIBI ALIBI
#include "score.h"
#include "epilogue.h"
#include "nv_warp.h"

#if USE_PTX
// make the generic-proxy writes to shared memory (cp.async, stores) visible to wgmma's reads
#define FENCE_ASYNC_SHARED() asm volatile("fence.proxy.async.shared::cta;" ::: "memory")
#if WG_PINGPONG
// the ping-pong turn: wait at this warpgroup's barrier (1 + wgi) for the other's arrival; pass
// the turn by arriving at the other's (2 - wgi); 256 threads each
#define PP_SYNC() asm volatile("bar.sync %0, 256;" ::"r"(1 + wgi) : "memory")
#define PP_ARRIVE() asm volatile("bar.arrive %0, 256;" ::"r"(2 - wgi) : "memory")
#else
#define PP_SYNC()
#define PP_ARRIVE()
#endif
#define SBASE(P) ((uint)(size_t)(P))  // shared-window byte address of local array P
#define WAIT_S() WG_WAIT_S(sacc)
#define WAIT_O() WG_WAIT_O(o)
#else
// USE_PTX=0 (any OpenCL device; layout checks on PoCL, never for speed): each wgmma is done by
// the warps' emulated m16n8k16 products (nv_warp.h), their operands read from local memory
// through the descriptors exactly as the hardware reads them (start address, LBO, SBO; the same
// descriptor values as the PTX build, addresses relative to the array). The waits are no-ops
// (the emulated product is done when it returns).
#define FENCE_ASYNC_SHARED()
#define PP_SYNC()
#define PP_ARRIVE()
#define SBASE(P) 0u
#define WAIT_S()
#define WAIT_O()
#endif
// X (a product's issue) in this warpgroup's turn; the turns' start (warpgroup 0 goes first) and
// end (warpgroup 0 takes warpgroup 1's last arrival, so every barrier phase completes)
#define IN_TURN(X) PP_SYNC(); X PP_ARRIVE();
#define TURNS_BEGIN() if (WG_PINGPONG && wgi == 1) PP_ARRIVE();
#define TURNS_END() if (WG_PINGPONG && wgi == 0) PP_SYNC();

// 64-bit wgmma matrix descriptor: start address, LBO, SBO (bytes, each >> 4), swizzle mode
// (bits 62-63: 1, the 128-byte swizzle)
inline ulong wg_desc(uint addr, uint lbo, uint sbo) {
  return (ulong)((addr & 0x3FFFFu) >> 4) | ((ulong)(lbo >> 4) << 16) | ((ulong)(sbo >> 4) << 32) |
         ((ulong)1 << 62);
}
#define SMEM_ALIGN 1024
// byte offset of chunk CH (16 bytes) of row R_ in a tile of ROWS rows
#define CHUNK_BYTES(ROWS, R_, CH) (((CH) >> 3) * (ROWS) * 128 + (R_) * 128 + ((((CH) & 7) ^ ((R_) & 7)) << 4))
// chunk c of a tile, in load order: row-major
#define CH_ROW(C) ((C) / CHUNKS)
#define CH_COL(C) ((C) % CHUNKS)
#define ROW_STEP (THREADS / CHUNKS)
#define DST_STEP (ROW_STEP * 128)       // bytes from one of a thread's chunks to the next
// descriptor field steps (16-byte units) of k-slice KK of a K-major tile of ROWS rows, and of
// k-slice T2 (16 keys) of V
#define KSTEP_DESC(KK, ROWS) ((ulong)(((KK) >> 2) * (ROWS) * 8 + ((KK) & 3) * 2))
#define VSTEP_DESC(T2) ((ulong)((T2) * 128))
#define DESC_KMAJ(A) wg_desc((A), 16, 1024)
#define Q_WG_BYTES (64 * 128)           // a warpgroup's first row, in every 64-column block
#if HEAD_DIM % 64 || ROW_STEP % 8
#error "the swizzled layout needs HEAD_DIM a multiple of 64 and THREADS / CHUNKS a multiple of 8"
#endif
#define DESC_NMAJ(A) wg_desc((A), BLOCK_N * 128, 1024)
#if !USE_PTX
// byte offset of element (r, k) of a K-major operand (r along M/N) and of element (k, n) of an
// N-major one, from a descriptor (no swizzle): core matrices of 8 rows x 16 bytes
// (the 128-byte swizzle: rows of 128 bytes, 8-row groups SBO apart, K-major k-chunks 16 bytes
// apart within the row, N-major 64-column blocks LBO apart; then address bits 4-6 ^= bits 7-9)
inline int swz128(int a) { return a ^ (((a >> 7) & 7) << 4); }
inline int desc_kmaj(ulong d, int r, int k) {
  const int start = (int)((d & 0x3FFFu) << 4), lbo = (int)(((d >> 16) & 0x3FFFu) << 4);
  const int sbo = (int)(((d >> 32) & 0x3FFFu) << 4);
  if (d >> 62)
    return swz128(start + (r >> 3) * sbo + (r & 7) * 128 + (k >> 3) * 16 + (k & 7) * 2);
  return start + (r >> 3) * sbo + (k >> 3) * lbo + (r & 7) * 16 + (k & 7) * 2;
}
inline int desc_nmaj(ulong d, int k, int n) {
  const int start = (int)((d & 0x3FFFu) << 4), lbo = (int)(((d >> 16) & 0x3FFFu) << 4);
  const int sbo = (int)(((d >> 32) & 0x3FFFu) << 4);
  if (d >> 62)
    return swz128(start + (n >> 6) * lbo + ((n >> 3) & 7) * 16 + (n & 7) * 2 + (k >> 3) * sbo +
                  (k & 7) * 128);
  return start + (n >> 3) * sbo + (k >> 3) * lbo + (k & 7) * 16 + (n & 7) * 2;
}
#define H16(P, BYTES) ((uint)(P)[(BYTES) >> 1])
#define PAIR(P, B0, B1) (H16(P, B0) | (H16(P, B1) << 16))
// D (m64 n8*NT, this warp's 16 rows) = [D +] A B^T over one k-slice of 16, A and B K-major
inline void emu_wg_ss(float (*d)[4], int nt_count, __local const ushort *a_arr, ulong da,
                      __local const ushort *b_arr, ulong db, int acc, __local uint *scr) {
  const int lane = get_local_id(0) & 31, w = (get_local_id(0) >> 5) & 3;
  const int g = lane >> 2, tg = lane & 3, r0 = 16 * w;
  uint a[4];
  a[0] = PAIR(a_arr, desc_kmaj(da, r0 + g, 2 * tg), desc_kmaj(da, r0 + g, 2 * tg + 1));
  a[1] = PAIR(a_arr, desc_kmaj(da, r0 + g + 8, 2 * tg), desc_kmaj(da, r0 + g + 8, 2 * tg + 1));
  a[2] = PAIR(a_arr, desc_kmaj(da, r0 + g, 2 * tg + 8), desc_kmaj(da, r0 + g, 2 * tg + 9));
  a[3] = PAIR(a_arr, desc_kmaj(da, r0 + g + 8, 2 * tg + 8),
              desc_kmaj(da, r0 + g + 8, 2 * tg + 9));
  for (int nt = 0; nt < nt_count; nt++) {
    const int n = nt * 8 + g;
    const uint b0 = PAIR(b_arr, desc_kmaj(db, n, 2 * tg), desc_kmaj(db, n, 2 * tg + 1));
    const uint b1 = PAIR(b_arr, desc_kmaj(db, n, 2 * tg + 8), desc_kmaj(db, n, 2 * tg + 9));
    if (!acc) {
      for (int c = 0; c < 4; c++) d[nt][c] = 0.f;
    }
    emu_mma(d[nt], a, b0, b1, scr);
  }
}
// D += A B over one k-slice of 16, A = this warp's registers (m16n8k16 A layout), B N-major
inline void emu_wg_rs(float (*d)[4], int nt_count, const uint *a, __local const ushort *b_arr,
                      ulong db, __local uint *scr) {
  const int lane = get_local_id(0) & 31, g = lane >> 2, tg = lane & 3;
  for (int nt = 0; nt < nt_count; nt++) {
    const int n = nt * 8 + g;
    const uint b0 = PAIR(b_arr, desc_nmaj(db, 2 * tg, n), desc_nmaj(db, 2 * tg + 1, n));
    const uint b1 = PAIR(b_arr, desc_nmaj(db, 2 * tg + 8, n), desc_nmaj(db, 2 * tg + 9, n));
    emu_mma(d[nt], a, b0, b1, scr);
  }
}
#endif

// The hidden keys' inf/NaN v values zeroed for the tensor cores, added back from global memory
// to the rows that see them (p > 0: inf or NaN stays), as attn_fwd_mma.cl does
#define ADD_BACK_HIDDEN_V()                                                                     \
  if (v_bad) {                                                                                  \
    UNROLL for (int hf = 0; hf < 2; hf++) {                                                     \
      const int j_hi = min(rhi[hf], n0 + BLOCK_N - 1);                                          \
      for (int j = max(rlo[hf], n0); j <= j_hi; j++) {                                          \
        long row = krow0 + j;                                                                   \
        if (ring > 0 && row >= ring) row -= ring;                                               \
        __global const ELEM *vr = vh + row * v_sr + 2 * tg;                                     \
        UNROLL for (int nd = 0; nd < NT_O; nd++) {                                              \
          UNROLL for (int e = 0; e < 2; e++) {                                                  \
            const uint b_ = vr[nd * 8 + e];                                                     \
            if (NONFINITE16(b_)) o[nd][2 * hf + e] += nonfinite_value(b_);                      \
          }                                                                                     \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

__kernel __attribute__((reqd_work_group_size(THREADS, 1, 1)))
void attn_fwd_wgmma(PREFILL_PARAMS) {
  __local ELEM sQ[BLOCK_M * HEAD_DIM] __attribute__((aligned(SMEM_ALIGN)));
  __local ELEM sK[2 * BLOCK_N * HEAD_DIM] __attribute__((aligned(SMEM_ALIGN)));
  __local ELEM sV[2 * BLOCK_N * HEAD_DIM] __attribute__((aligned(SMEM_ALIGN)));
  __local int v_flag;  // = t + 1 when tile t's V held inf/NaN under hidden keys
#if !USE_PTX
  __local uint scr_all[(THREADS / 32) * 256];
  __local uint *scr = scr_all + (get_local_id(0) >> 5) * 256;
#endif
  const int tid = get_local_id(0), lane = tid & 31;
  const int wgi = tid >> 7, warp = (tid >> 5) & 3;
  const int g = lane >> 2, tg = lane & 3;
  if (tid == 0) v_flag = 0;
  PREFILL_BLOCK_ID
  PREFILL_ROWS
  PREFILL_KEY_RANGE
  const int wrow0 = wgi * 64 + warp * 16;  // this warp's first row in the block
  int rlo[2], rhi[2];
  UNROLL for (int hf = 0; hf < 2; hf++) {
    long i = m0 + wrow0 + g + 8 * hf;
    rlo[hf] = row_lo(i, base, dlo, klen);
    rhi[hf] = row_hi(i, base, dhi, klen);
  }
#if ALIBI
  const float slope = alibi[(long)s * n_heads + h];
#endif

  // -- chunk c of a tile (load order CH_ROW, CH_COL) at CHUNK_BYTES (see the layouts above)
  __global const ELEM *qh = q + q_off + qb * q_sb + h * q_sh;
  for (int c = tid; c < BLOCK_M * CHUNKS; c += THREADS) {
    const int r = CH_ROW(c), ch = CH_COL(c);
    __local ELEM *dst = sQ + (CHUNK_BYTES(BLOCK_M, r, ch) >> 1);
    if (r < nrows) CP_ASYNC16(dst, qh + (qrow0 + m0 + r) * q_sr + ch * 8);
    else ZERO16(dst);
  }
  CP_COMMIT();
  __global const ELEM *kh = k + k_off + kb * k_sb + hk * k_sh;
  __global const ELEM *vh = v + v_off + kb * v_sb + hk * v_sh;
  // this thread's chunks of a K/V tile: c = tid + i THREADS, i < KV_PER: the same column chunk,
  // rows r0_ + i ROW_STEP, local bytes DST_STEP apart
#define KV_PER (BLOCK_N * CHUNKS / THREADS)
  const int r0_ = CH_ROW(tid), ch0_ = CH_COL(tid);
  const int kv_dst0 = CHUNK_BYTES(BLOCK_N, r0_, ch0_) >> 1;  // halves
  __global const ELEM *kp0 = kh + (krow0 + r0_) * k_sr + ch0_ * 8;
  __global const ELEM *vp0 = vh + (krow0 + r0_) * v_sr + ch0_ * 8;
  // one tensor (K or V) of key tile TILE into the buffer at SX: keys outside the block's range
  // zero-filled (never read), ring-buffer rows wrapped; a tile inside the range that does not
  // wrap copies from pointers hoisted out of the loop
#define LOAD_X1(TILE, SX, XP0, XH, X_SR)                                                       \
  {                                                                                            \
    const int n0_ = (TILE) * BLOCK_N;                                                          \
    __local ELEM *xd_ = (SX) + kv_dst0;                                                        \
    if (n0_ >= lo_blk && n0_ + BLOCK_N - 1 <= hi_blk &&                                        \
        (ring == 0 || krow0 + n0_ + BLOCK_N <= ring)) {                                        \
      __global const ELEM *xt = (XP0) + n0_ * (X_SR);                                          \
      UNROLL for (int i = 0; i < KV_PER; i++) {                                                \
        CP_ASYNC16(xd_ + i * (DST_STEP / 2), xt + i * ROW_STEP * (X_SR));                      \
      }                                                                                        \
    } else {                                                                                   \
      UNROLL for (int i = 0; i < KV_PER; i++) {                                                \
        const int j = n0_ + r0_ + i * ROW_STEP;                                                \
        if (j >= lo_blk && j <= hi_blk) {                                                      \
          long row = krow0 + j;                                                                \
          if (ring > 0 && row >= ring) row -= ring;                                            \
          CP_ASYNC16(xd_ + i * (DST_STEP / 2), (XH) + row * (X_SR) + ch0_ * 8);                \
        } else {                                                                               \
          ZERO16(xd_ + i * (DST_STEP / 2));                                                    \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
  }
#define LOAD_K1(TILE, BUF) LOAD_X1(TILE, sK + (BUF) * BLOCK_N * HEAD_DIM, kp0, kh, k_sr)
#define LOAD_V1(TILE, BUF) LOAD_X1(TILE, sV + (BUF) * BLOCK_N * HEAD_DIM, vp0, vh, v_sr)
#define LOAD_KV(TILE, BUF) { LOAD_K1(TILE, BUF) LOAD_V1(TILE, BUF) }
  if (t_first <= t_last) { LOAD_KV(t_first, 0) }
  CP_COMMIT();

  const uint q_addr = SBASE(sQ) + wgi * Q_WG_BYTES;  // this warpgroup's 64 rows
  const uint k_addr = SBASE(sK), v_addr = SBASE(sV);
  const ulong dq0 = DESC_KMAJ(q_addr);

  float o[NT_O][4];
  float m_i[2], l_i[2];
  UNROLL for (int nd = 0; nd < NT_O; nd++) {
    UNROLL for (int c = 0; c < 4; c++) o[nd][c] = 0.f;
  }
  UNROLL for (int hf = 0; hf < 2; hf++) { m_i[hf] = -INFINITY; l_i[hf] = 0.f; }
  float sacc[NT_S][4];
  UNROLL for (int nt = 0; nt < NT_S; nt++) {
    UNROLL for (int c = 0; c < 4; c++) sacc[nt][c] = 0.f;
  }

  // ---- one key tile's steps
  // S = Q K^T issued: KSTEPS_QK k-slices of 16 (descriptor steps KSTEP_DESC)
#if USE_PTX
#define WG_SS_STEP(KK, DK)                                                                     \
  WG_SS_S(sacc, dq0 + KSTEP_DESC(KK, BLOCK_M), (DK) + KSTEP_DESC(KK, BLOCK_N), KK)
#define WG_RS_STEP(T2, DV) WG_RS_O(o, pa[T2], (DV) + VSTEP_DESC(T2), 1)
#else
#define WG_FENCE_S(ACC)
#define WG_FENCE_O(ACC)
#define WG_COMMIT()
#define WG_SS_STEP(KK, DK)                                                                     \
  emu_wg_ss(sacc, NT_S, sQ, dq0 + KSTEP_DESC(KK, BLOCK_M), sK, (DK) + KSTEP_DESC(KK, BLOCK_N),    \
            KK, scr)
#define WG_RS_STEP(T2, DV)                                                                     \
  emu_wg_rs(o, NT_O, pa[T2], sV, (DV) + VSTEP_DESC(T2), scr)
#endif
#define ISSUE_S(KBUF)                                                                          \
  {                                                                                            \
    const ulong dk0 = DESC_KMAJ(k_addr + (KBUF) * TILE_BYTES(BLOCK_N));                        \
    WG_FENCE_S(sacc);                                                                          \
    UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) { WG_SS_STEP(kk, dk0); }                     \
    WG_COMMIT();                                                                               \
  }
  // O += P V issued: k-slice t2 = keys 16 t2 .. 16 t2 + 15 (descriptor steps VSTEP_DESC)
#define ISSUE_PV(VBUF)                                                                         \
  {                                                                                            \
    const ulong dv0 = DESC_NMAJ(v_addr + (VBUF) * TILE_BYTES(BLOCK_N));                        \
    WG_FENCE_O(o);                                                                             \
    UNROLL for (int t2 = 0; t2 < KSTEPS_PV; t2++) { WG_RS_STEP(t2, dv0); }                     \
    WG_COMMIT();                                                                               \
  }
  // scores of key tile N0 in the exp2 domain (score.h); with the scale folded into the softmax
  // only the hiding is left, and tiles that hide nothing (!NEED) skip the pass
#define SCORES(N0, NEED)                                                                       \
  if (!SCORE_FOLD || (NEED)) {                                                                 \
    UNROLL for (int nt = 0; nt < NT_S; nt++) {                                                 \
      UNROLL for (int c = 0; c < 4; c++) {                                                     \
        const int j = (N0) + nt * 8 + 2 * tg + (c & 1);                                        \
        SCORE_VARIANT(sacc[nt][c], qk_scale, cap, slope, m0 + wrow0 + g + 8 * (c >> 1) + base - j, \
                      j, rlo[c >> 1], rhi[c >> 1], 0, SCORE_FOLD || (NEED))                    \
      }                                                                                        \
    }                                                                                          \
  }
  // online softmax of the scores in sacc (lazy rescaling, exact; see attn_fwd_mma.cl): the new
  // running max, l rescaled and summed, P = 2^(S - m) in sacc; O's rescale by alpha is left to
  // RESCALE_O (resc = 1 when some row of the warp moved its max)
#define P_OF(X, M) ex2(SCORE_P_ARG(X, M, qk_scale))
#define SOFTMAX_P()                                                                            \
  {                                                                                            \
    float m_new[2];                                                                            \
    int grow = 0;                                                                              \
    UNROLL for (int hf = 0; hf < 2; hf++) {                                                    \
      float mx = -INFINITY;                                                                    \
      UNROLL for (int nt = 0; nt < NT_S; nt++) {                                               \
        mx = fmax(mx, fmax(sacc[nt][2 * hf], sacc[nt][2 * hf + 1]));                           \
      }                                                                                        \
      mx = fmax(mx, SHFL_XOR(mx, 1));                                                          \
      mx = fmax(mx, SHFL_XOR(mx, 2));                                                          \
      m_new[hf] = fmax(m_i[hf], SCORE_MAX(mx, qk_scale));                                     \
      grow |= m_new[hf] - m_i[hf] > RESCALE_THRESH;                                            \
    }                                                                                          \
    resc = WARP_ANY(grow);                                                                     \
    UNROLL for (int hf = 0; hf < 2; hf++) {                                                    \
      alpha[hf] = 1.f;                                                                         \
      if (resc) {                                                                              \
        const float m_use = m_new[hf] == -INFINITY ? 0.f : m_new[hf];                          \
        alpha[hf] = ex2(m_i[hf] - m_use);                                                      \
        m_i[hf] = m_new[hf];                                                                   \
        l_i[hf] *= alpha[hf];                                                                  \
      }                                                                                        \
      const float m_use = m_i[hf] == -INFINITY ? 0.f : m_i[hf];                                \
      float rs = 0.f;                                                                          \
      UNROLL for (int nt = 0; nt < NT_S; nt++) {                                               \
        UNROLL for (int c = 0; c < 2; c++) {                                                   \
          const float p = P_OF(sacc[nt][2 * hf + c], m_use);                                   \
          sacc[nt][2 * hf + c] = p;                                                            \
          rs += p;                                                                             \
        }                                                                                      \
      }                                                                                        \
      l_i[hf] += rs;                                                                           \
    }                                                                                          \
  }
#define RESCALE_O()                                                                            \
  if (resc) {                                                                                  \
    UNROLL for (int nd = 0; nd < NT_O; nd++) {                                                 \
      UNROLL for (int c = 0; c < 4; c++) o[nd][c] *= alpha[c >> 1];                            \
    }                                                                                          \
  }
  // the S accumulators of n-tiles 2 t2, 2 t2 + 1 are the A fragment of k-slice t2
#define PACK_P()                                                                               \
  UNROLL for (int t2 = 0; t2 < KSTEPS_PV; t2++) {                                              \
    pa[t2][0] = pack2(sacc[2 * t2][0], sacc[2 * t2][1]);                                       \
    pa[t2][1] = pack2(sacc[2 * t2][2], sacc[2 * t2][3]);                                       \
    pa[t2][2] = pack2(sacc[2 * t2 + 1][0], sacc[2 * t2 + 1][1]);                               \
    pa[t2][3] = pack2(sacc[2 * t2 + 1][2], sacc[2 * t2 + 1][3]);                               \
  }
#define NEED_MASK(N0) (!((N0) >= lo_all && (N0) + BLOCK_N - 1 <= hi_all))
  uint pa[KSTEPS_PV][4];
  float alpha[2];
  int resc = 0;

  // ---- the key-tile loop: per tile S, wait, softmax, P V, wait; one K/V buffer pair per tile,
  // the next tile's pair loaded under this tile's math
  TURNS_BEGIN()
  for (int t = t_first; t <= t_last; t++) {
    const int buf = (t - t_first) & 1;
    // -- tile t (and Q) landed; after the barrier no thread still reads tile t-1's buffer, so
    // the prefetch of tile t+1 into it overlaps this tile's math
    CP_WAIT(0);
    FENCE_ASYNC_SHARED();
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t < t_last) {
      LOAD_KV(t + 1, buf ^ 1)
      CP_COMMIT();
    }
    const int n0 = t * BLOCK_N;
    const bool need_mask = NEED_MASK(n0);
    // hidden keys' inf/NaN v zeroed for the tensor cores (tiles that hide keys only)
    int v_bad = 0;
    if (need_mask) SCAN_HIDDEN_V16(sV + buf * BLOCK_N * HEAD_DIM, HEAD_DIM)
    IN_TURN(ISSUE_S(buf))
    WAIT_S();
    SCORES(n0, need_mask)
    SOFTMAX_P()
    RESCALE_O()
    PACK_P()
    IN_TURN(ISSUE_PV(buf))
    WAIT_O();
    ADD_BACK_HIDDEN_V()
  }
  TURNS_END()
  CP_WAIT(0);

  // -- epilogue (epilogue.h): O / l, lse = (m + log2 l) ln 2, the sink; empty rows
  UNROLL for (int hf = 0; hf < 2; hf++) {
    float l = l_i[hf];
    l += SHFL_XOR(l, 1);
    l += SHFL_XOR(l, 2);
    float inv, lse_r;
    EPI_FINISH(1, float, m_i[hf], l, n_sinks, sinks[h], inv, lse_r)
    const int r = wrow0 + g + 8 * hf;
    if (r < nrows) {
      const long row = qrow0 + m0 + r;
      __global uint *orow = (__global uint *)(out + ((qb * sq_arr + row) * n_heads + h) * HEAD_DIM);
      UNROLL for (int nd = 0; nd < NT_O; nd++) {
        orow[nd * 4 + tg] = pack2(o[nd][2 * hf] * inv, o[nd][2 * hf + 1] * inv);
      }
      if (tg == 0) lse[(qb * n_heads + h) * sq_arr + row] = lse_r;
    }
  }
}
