// FlashAttention-2 style forward pass on NVIDIA tensor cores (sm_80+), OpenCL C + inline PTX.
//
// One work-group = BLOCK_M query rows of one sequence and one query head; WARPS warps split the
// rows (16 * M_TILES rows each).  For every key tile of BLOCK_N keys:
//   S = Q K^T      mma.sync.m16n8k16 (f16/bf16 in, f32 accumulate), fragments from ldmatrix
//   mask, scale    in the exp2 domain (scores are multiplied by log2(e) once)
//   online softmax m_new = max(m, rowmax S), alpha = 2^(m - m_new), l = alpha l + sum 2^(S - m_new)
//   O = alpha O + P V   P re-packed from the S accumulators as the A operand (no shared memory)
// K/V tiles are double-buffered in local memory with cp.async; tiles that no row of the block can
// see (causal, window, sequence end) are never visited, tiles every row sees fully skip masking.
//
// Compile-time sizes (-D): HEAD_DIM (D), HEAD_DIM_V (Dv; both any size up to 256, padded to 16
// inside), BLOCK_M, BLOCK_N (multiple of 16), WARPS, IS_BF16, IS_TF32, Q_IN_REGS, SOFTCAP, ALIBI,
// SCALE_POS (scale > 0), VEC_LOADS, MASK_KIND, PAGE_SIZE, USE_PTX.  USE_PTX=0
// replaces every warp-level PTX instruction (nv_warp.h, shared with attn_decode_mma.cl) by an
// exact emulation through local memory and barriers (for checking the fragment layouts with PoCL
// on a CPU; slow, never used for speed).
//
// IS_TF32=1: float32 storage, "3xTF32" products (attn_fwd_mma_tf32.h): each operand split as
// hi + lo in tf32, three mma.sync.m16n8k8 tf32 per product, float32 accumulators: float32-class
// accuracy.  Fragments are read from local memory with plain 32/64-bit loads (no ldmatrix) and
// Q_IN_REGS means 0: Q kept in local memory as float32 and split every tile, 1: hi and lo in
// registers, 2: hi in registers and lo in local memory.  The tile walk, masking and online
// softmax are shared with the 16-bit kernel.
//
// PAGE_SIZE > 0: k and v are page pools (nv_warp.h) read through the block table (six more
// arguments, PAGED_PARAMS).  The table entries of key tile T are staged in slot T & 1 of sPg by
// cp.async in the commit group of the first load of tile T - 1 (LOAD_KV, LOAD_K, LOAD_K_B:
// NEXT_PAGES), so every schedule (plain, KV_SPLIT_STAGES, SOFTMAX_PIPE) has them in local memory
// before it issues a load of tile T, and a slot is rewritten only after every load of the tile
// it held was issued; the first tile's entries are read before the loop.  Each K/V row's
// address: page * page stride + slot * row stride (the fast loader: one entry per row of its
// chunk column).  The hidden-v add-back (rare) reads the table in global memory.  PAGE_SIZE=0
// preprocesses to the unpaged kernel token for token.

#ifndef IS_TF32
#define IS_TF32 0
#endif
#ifndef HEAD_DIM_V
#define HEAD_DIM_V HEAD_DIM
#endif
// VEC_LOADS=1: every row of q, k and v starts 16-byte aligned (the host checks offsets and
// strides): whole 16-byte chunks of a row are copied with cp.async.  0: rows are read element
// by element (e.g. D = 59 in 16 bits: rows 118 bytes apart), synchronously, into the same tiles.
#ifndef VEC_LOADS
#define VEC_LOADS 1
#endif
// Padded head dims: D and Dv rounded up to the mma granularity (16).  Local tiles are DQK / DV
// columns wide; columns past D (Dv) are zero-filled on load (zero products, zero outputs that
// are never stored), so the tile walk and the fragments only see padded sizes.
#define DQK (((HEAD_DIM + 15) / 16) * 16)
#define DV (((HEAD_DIM_V + 15) / 16) * 16)
#define DMAX (DQK > DV ? DQK : DV)
#define M_TILES (BLOCK_M / (16 * WARPS))
#define THREADS (32 * WARPS)
#if IS_TF32
#define ELEM float
#define EPC 4                       // elements per 16-byte chunk
// padded rows (floats).  Q and K fragments are float2 loads at row g, column 2t of a k-step:
// rows 8 floats apart in banks serve a half-warp without conflict; V fragments are scalar loads
// of rows 2t, 2t + 1 at column g: rows 4 floats apart do.
#define LDSQ (DQK + 8)
#define LDSK (DQK + 8)
#define LDSV (DV + 4)
#define KSTEPS_QK (DQK / 8)         // k-steps (m16n8k8) of S = Q K^T
#define KSTEPS_PV (BLOCK_N / 8)     // k-steps of O = P V: one per n-tile of S
// V's local offset of chunk ch of row r in buffer B (K and V rows are padded differently)
#define SO_V(B) ((B) * BLOCK_N * LDSV + r * LDSV + ch * EPC)
#define SO0_V (r0_ * LDSV + ch0_ * EPC)
#else
#define ELEM ushort
#define EPC 8
#define LDS (DMAX + 8)              // padded row (halves): 8 rows of one ldmatrix hit 8 bank groups
#define LDSQ LDS
#define LDSK LDS
#define LDSV LDS
#define KSTEPS_QK (DQK / 16)        // k-steps of S = Q K^T
#define KSTEPS_PV (BLOCK_N / 16)    // k-steps of O = P V
#define SO_V(B) so
#define SO0_V so0
#endif
#define NT_S (BLOCK_N / 8)          // 8-column n-tiles of S
#define NT_O (DV / 8)               // 8-column n-tiles of O
#define QK_CHUNKS (DQK / EPC)       // 16-byte chunks per local row of Q and K
#define V_CHUNKS (DV / EPC)         // ... of V
// chunk slots per row of a load loop: a power of two (a fixed chunk column per thread in the
// fast loader); slots past a tensor's chunks load nothing
#define CHUNKS_NEED (DMAX / EPC)
#if CHUNKS_NEED > 32  // float32 rows past 128 columns
#define CHUNKS 64
#else
#define CHUNKS (CHUNKS_NEED <= 4 ? 4 : CHUNKS_NEED <= 8 ? 8 : CHUNKS_NEED <= 16 ? 16 : 32)
#endif
#define SCAN_CHUNKS V_CHUNKS        // SCAN_HIDDEN_V16 (nv_warp.h) scans V's chunks
#if BLOCK_M % (16 * WARPS) || BLOCK_N % 16 || THREADS % CHUNKS || HEAD_DIM > 256 || HEAD_DIM_V > 256
#error "BLOCK_M must be a multiple of 16*WARPS, BLOCK_N of 16, 32*WARPS of the chunk slots; D, Dv <= 256"
#endif
#if BLOCK_N % (THREADS / CHUNKS)
#error "BLOCK_N must be a multiple of 32 * WARPS / (chunk slots per row)"
#endif
// One 16-byte chunk CH of a row of N columns (SRC: the chunk's first element in global memory,
// DST: in local memory): a cp.async when the chunk is whole and rows are aligned, zeros past N,
// else element by element (the tail chunk of D % EPC != 0, or VEC_LOADS=0).  WHOLE (compile
// time): every chunk slot of the loop is a whole chunk of an aligned row.
#define CHUNK_WHOLE(N) (VEC_LOADS && (N) % EPC == 0 && (N) == CHUNKS * EPC)
#define LOAD_CHUNK(DST, SRC, CH, N)                                                             \
  if (CHUNK_WHOLE(N)) {                                                                         \
    CP_ASYNC16(DST, SRC);                                                                       \
  } else if (VEC_LOADS && (N) % EPC == 0 && ((CH) + 1) * EPC <= (N)) {                          \
    CP_ASYNC16(DST, SRC);                                                                       \
  } else {                                                                                      \
    const int n_ = (N) - (CH) * EPC;                                                            \
    UNROLL for (int e_ = 0; e_ < EPC; e_++) (DST)[e_] = e_ < n_ ? (SRC)[e_] : (ELEM)0;          \
  }
// masks (-DMASK_KIND, 0: none; the kinds: score.h) per (sequence, head, row, key) with the
// host's strides
#ifndef MASK_KIND
#define MASK_KIND 0
#endif
// Causal scheduling options (0 = off; the 16-bit build is unchanged with both off):
// HEADS_INNER=1: grid (n_tiles * n_heads, 1), work-group id = tile * n_heads + head, so every
// head of the heaviest tile (the table is sorted by key tiles) starts first: a global
// longest-first order (with heads on dimension 1, only each head's row of the grid is sorted
// and the heaviest blocks of the last heads start late, leaving a tail wave).  The host sets
// the grid to match (_nvidia_mma.run(heads_inner=True)).
#ifndef HEADS_INNER
#define HEADS_INNER 0
#endif
// WARP_SKIP=1: a warp skips the key tiles that none of its own rows can see (on the causal
// diagonal, warp w of BLOCK_M / BLOCK_N tiles needs only those up to its rows), leaving the
// tensor cores of its SM sub-partition to the warps that do.  Exact: such a tile would leave
// m, l and O unchanged.  The emulated build computes the tile and restores m, l and O instead
// (so the tests catch a skip that drops a visible key).
#ifndef WARP_SKIP
#define WARP_SKIP 0
#endif
// Options of the 16-bit kernel (0 = off; DEFAULT_OPTIONS_16 in _nvidia_mma.py picks them):
// LDSM_BYTES=1: each thread's byte addresses of its Q, K and V ldmatrix rows (and of its fast
// cp.async destinations) are formed once before the tile loop; every ldmatrix then reads at
// that address plus a compile-time byte constant (ptxas: [R+imm]) instead of recomputing the
// lane terms, element index and window base per instruction.
#ifndef LDSM_BYTES
#define LDSM_BYTES 0
#endif
// KV_SPLIT_STAGES=1: one K and one V buffer, FlashAttention-2's schedule: wait K(t), barrier,
// issue V(t), S = Q K(t)^T; wait V(t), barrier, issue K(t+1); softmax, O += P V(t).  V's load
// hides under Q K^T and K's under softmax and P V; half the K/V local memory.
#ifndef KV_SPLIT_STAGES
#define KV_SPLIT_STAGES 0
#endif
// SOFTMAX_PIPE=1: the tile loop software-pipelined over half tiles, S of the next half issued
// in the basic block of this half's softmax and P V (attn_fwd_mma_pipe.h).
#ifndef SOFTMAX_PIPE
#define SOFTMAX_PIPE 0
#endif
#if LDSM_BYTES && IS_TF32
#error "LDSM_BYTES=1 is for the 16-bit kernel (float32 reads its fragments without ldmatrix)"
#endif
#if KV_SPLIT_STAGES && IS_TF32
#error "KV_SPLIT_STAGES=1 is for the 16-bit kernel"
#endif
// the score transform (score.h) in the exp2 domain: the host passes qk_scale = scale log2(e)
// (scale / softcap with a softcap), cap = softcap log2(e) and slopes times log2(e)
#define SCORE_LOG2 1
#define SCORE_SOFTCAP SOFTCAP
#define SCORE_ALIBI ALIBI
#include "score.h"
#include "epilogue.h"
#include "nv_warp.h"
#if USE_PTX
#define SCR_DECL
#define SCR_ARG
#else  // the emulation's per-warp scratch area, passed to the helpers that need it
#define SCR_DECL , __local uint *scr
#define SCR_ARG , scr
#endif

// With a mask, key tiles it hides from every row of the block are not visited: the host's
// range [first, last] of the key tiles in which some row of the row block sees some key
// (_nvidia_tables.mask_tile_args: bool masks; additive ones pass one unbounded range; int32
// pairs per sequence, head and row block, strides 0 where the mask broadcasts; last < first:
// none) narrows the block's tiles t_first..t_last.  Exact: such a tile would leave m, l and O
// unchanged.
#if MASK_KIND
#define MASK_TILE_PARAMS                                                                       \
  , __global const int *mtiles, const long mt_s0, const long mt_s1, const long mt_s2
#undef PREFILL_KEY_RANGE
#define PREFILL_KEY_RANGE                                                                      \
  PREFILL_KEY_BOUNDS                                                                           \
  __global const int *mt_ = mtiles + s * mt_s0 + h * mt_s1 + (m0 / BLOCK_M) * mt_s2;          \
  const int t_first = max(lo_blk / BLOCK_N, mt_[0]);                                           \
  const int t_last = hi_blk >= lo_blk ? min(hi_blk / BLOCK_N, mt_[1]) : t_first - 1;
#else
#define MASK_TILE_PARAMS
#endif
// The mask element of row (MT, HF) and key J (mrow: with MASK_KIND only; read only then)
#define MASK_PTR(MT, HF, J) (mask + mrow[MT][HF] + (long)(J) * m_s3)
// Score X (in place) of this lane's row (MT, HF) and key J: score.h's transform, the keys of
// tiles that hide some (NM) hidden outside the row's range [rlo, rhi] or by the mask.  Every
// tile is such a tile when there is a mask.
#define ROW_SCORE(X, MT, HF, J, NM)                                                             \
  SCORE_VARIANT(X, qk_scale, cap, slope, m0 + wrow0 + (MT) * 16 + g + 8 * (HF) + base - (J), J,  \
                rlo[MT][HF], rhi[MT][HF], MASK_PTR(MT, HF, J), NM)

#if IS_TF32
#include "attn_fwd_mma_tf32.h"
#define OUT2 float2
#define OUT_PACK(A, B) (float2)(A, B)
#define OUT_ONE(A) (A)
#else
#define OUT2 uint
#define OUT_PACK(A, B) pack2(A, B)
#define OUT_ONE(A) ((ushort)pack2(A, 0.f))
#endif

// The hidden keys' inf/NaN v values the scan zeroed for the mma (SCAN_HIDDEN_V16 or the float32
// scan), added back from global memory to the rows that see them (p > 0: inf or NaN stays); uses
// the kernel's tile state (v_bad, rlo, rhi, n0, o, krow0, ring, vh, v_sr, tg).
#if IS_TF32
#define ADD_BACK_VALUE(ACC, P)                                                                  \
  {                                                                                             \
    const float b_ = *(P);                                                                      \
    if (NONFINITE32(as_uint(b_))) ACC += b_;                                                    \
  }
#else
#define ADD_BACK_VALUE(ACC, P)                                                                  \
  {                                                                                             \
    const uint b_ = *(P);                                                                       \
    if (NONFINITE16(b_)) ACC += nonfinite_value(b_);                                            \
  }
#endif
// The online-softmax state (m, l, O) of this lane's rows, copied whole: the emulated WARP_SKIP
// builds compute a tile the warp skips, then restore the state kept before it (so a skip that
// drops a visible key shows as an error).
#define COPY_STATE(MD, LD, OD, MS, LS, OS)                                                      \
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                                 \
    UNROLL for (int hf = 0; hf < 2; hf++) {                                                     \
      MD[mt][hf] = MS[mt][hf];                                                                  \
      LD[mt][hf] = LS[mt][hf];                                                                  \
    }                                                                                           \
    UNROLL for (int nd = 0; nd < NT_O; nd++) {                                                  \
      UNROLL for (int c = 0; c < 4; c++) OD[mt][nd][c] = OS[mt][nd][c];                         \
    }                                                                                           \
  }
#define KEEP_STATE COPY_STATE(m_keep, l_keep, o_keep, m_i, l_i, o)
#define RESTORE_STATE COPY_STATE(m_i, l_i, o, m_keep, l_keep, o_keep)
#define ADD_BACK_HIDDEN_V()                                                                     \
  if (v_bad) {                                                                                  \
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                               \
      UNROLL for (int hf = 0; hf < 2; hf++) {                                                   \
        const int j_hi = min(rhi[mt][hf], n0 + BLOCK_N - 1);                                    \
        for (int j = max(rlo[mt][hf], n0); j <= j_hi; j++) {                                    \
          KV_ROW_G(j)                                                                           \
          __global const ELEM *vr = vh + ROW_OFF(v_sb, v_sr) + 2 * tg;                          \
          if (!MASK_SEES(MASK_PTR(mt, hf, j))) continue;                                        \
          UNROLL for (int nd = 0; nd < NT_O; nd++) {                                            \
            UNROLL for (int e = 0; e < 2; e++) {                                                \
              if (DV == HEAD_DIM_V || nd * 8 + 2 * tg + e < HEAD_DIM_V)                         \
                ADD_BACK_VALUE(o[mt][nd][2 * hf + e], vr + nd * 8 + e)                          \
            }                                                                                   \
          }                                                                                     \
        }                                                                                       \
      }                                                                                         \
    }                                                                                           \
  }

__kernel __attribute__((reqd_work_group_size(THREADS, 1, 1)))
void attn_fwd_mma(PREFILL_PARAMS MASK_TILE_PARAMS PAGED_PARAMS) {
  __local ELEM sQ[BLOCK_M * LDSQ] __attribute__((aligned(16)));
#if KV_SPLIT_STAGES
  __local ELEM sK[BLOCK_N * LDSK] __attribute__((aligned(16)));
  __local ELEM sV[BLOCK_N * LDSV] __attribute__((aligned(16)));
#else
  __local ELEM sK[2 * BLOCK_N * LDSK] __attribute__((aligned(16)));
  __local ELEM sV[2 * BLOCK_N * LDSV] __attribute__((aligned(16)));
#endif
#if !USE_PTX
  __local uint scr_all[WARPS * 256];
  __local uint *scr = scr_all + (get_local_id(0) >> 5) * 256;
#endif
#if PAGE_SIZE
  __local int sPg[2 * NPG];  // the table entries of two key tiles (tile T: slot T & 1)
#endif
  __local int v_flag;  // = t + 1 when tile t's V held inf/NaN (a new value per tile: no reset)
  const int tid = get_local_id(0), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tg = lane & 3;
  if (tid == 0) v_flag = 0;
  PREFILL_BLOCK_ID
  PREFILL_ROWS
  const int wrow0 = warp * 16 * M_TILES;  // this warp's first row in the block
  PREFILL_KEY_RANGE

  int rlo[M_TILES][2], rhi[M_TILES][2];
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {
    UNROLL for (int hf = 0; hf < 2; hf++) {
      long i = m0 + wrow0 + mt * 16 + g + 8 * hf;
      rlo[mt][hf] = row_lo(i, base, dlo, klen);
      rhi[mt][hf] = row_hi(i, base, dhi, klen);
    }
  }
#if MASK_KIND
  // the mask's element offset of each of this lane's rows (a row past the sequence reads its
  // last row: never stored)
  long mrow[M_TILES][2];
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {
    UNROLL for (int hf = 0; hf < 2; hf++) {
      const long i = min((long)(m0 + wrow0 + mt * 16 + g + 8 * hf), (long)qlen - 1);
      mrow[mt][hf] = m_off + s * m_s0 + h * m_s1 + i * m_s2;
    }
  }
#endif
#if WARP_SKIP
  // keys this warp's rows can see lie in [w_lo, w_hi] (row ranges move with the row; rows past
  // nrows are never stored and see nothing here)
  const int w_last = min(wrow0 + 16 * M_TILES, nrows) - 1;
  const int w_lo = row_lo(m0 + wrow0, base, dlo, klen);
  const int w_hi = w_last >= wrow0 ? row_hi(m0 + w_last, base, dhi, klen) : -1;
#endif
#if ALIBI
  const float slope = alibi[(long)s * n_heads + h];
#endif

  // -- prologue: Q tile (own group), then the first K/V tile
  {
    __global const ELEM *qh = q + q_off + qb * q_sb + h * q_sh;
    for (int c = tid; c < BLOCK_M * CHUNKS; c += THREADS) {
      int r = c / CHUNKS, ch = c % CHUNKS;
      __local ELEM *dst = sQ + r * LDSQ + ch * EPC;
      if (QK_CHUNKS != CHUNKS && ch >= QK_CHUNKS) continue;
      if (r < nrows) {
        LOAD_CHUNK(dst, qh + (qrow0 + m0 + r) * q_sr + ch * EPC, ch, HEAD_DIM)
      } else {
        ZERO16(dst);
      }
    }
    CP_COMMIT();
  }
  __global const ELEM *kh = k + k_off + kb * k_sb + hk * k_sh;
  __global const ELEM *vh = v + v_off + kb * v_sb + hk * v_sh;
// The row of key J (of tile TILE): KV_ROW declares what ROW_OFF(batch-or-page stride, row
// stride) needs, the element offset from kh (vh); KV_ROW_G reads a paged table in global memory.
// FAST_ROW(I): the same for row r0_ + I ROW_STEP of the fast loader, FAST_OFF its offset from the
// tile's base pointers (DENSE: the unpaged one).  NEXT_PAGES(TILE): the entries of tile TILE + 1.
#if PAGE_SIZE
  __global const int *tbl = block_table + tbl_off + (long)s * tbl_s0;
  __global const ELEM *kc0 = kh + (tid % CHUNKS) * EPC, *vc0 = vh + (tid % CHUNKS) * EPC;
#define KV_ROW(J, TILE)                                                                        \
  const long lr_ = krow0 + (J);                                                                \
  const long pg_ = clamp(sPg[((TILE) & 1) * NPG + (int)(lr_ / PAGE_SIZE - PG_FIRST(TILE))], 0,  \
                         n_pages - 1);                                                         \
  const long sl_ = lr_ % PAGE_SIZE;
#define KV_ROW_G(J)                                                                            \
  const long lr_ = krow0 + (J);                                                                \
  const long pg_ = clamp((long)tbl[min(lr_ / PAGE_SIZE, (long)(tbl_w - 1)) * tbl_s1], 0L,      \
                         (long)(n_pages - 1));                                                 \
  const long sl_ = lr_ % PAGE_SIZE;
#define ROW_OFF(SB, SR) (pg_ * (SB) + sl_ * (SR))
// the fast loader of tile TILE: rows r0_ + I ROW_STEP, entry e0_ + (s0_ + I ROW_STEP) / PAGE_SIZE
#define FAST_PAGES(TILE)                                                                       \
  const long rb_ = krow0 + n0_ + r0_;                                                          \
  const int e0_ = (int)(rb_ / PAGE_SIZE - PG_FIRST(TILE)), s0_ = (int)(rb_ % PAGE_SIZE);       \
  __local const int *pgs_ = sPg + ((TILE) & 1) * NPG + e0_;
#define FAST_BASE(XP0, XC0, X_SR) (XC0)
#define FAST_ROW(I)                                                                            \
  const int o_ = s0_ + (I) * ROW_STEP;                                                         \
  const long pg_ = clamp(pgs_[o_ / PAGE_SIZE], 0, n_pages - 1), sl_ = o_ % PAGE_SIZE;
#define FAST_OFF(DENSE, SB, SR) (pg_ * (SB) + sl_ * (SR))
#define NEXT_PAGES(TILE)                                                                       \
  if ((TILE) < t_last) { FETCH_PAGES((TILE) + 1, ((TILE) + 1) & 1) }
  if (t_first <= t_last) {
    for (int e = tid; e < NPG; e += THREADS)
      sPg[(t_first & 1) * NPG + e] = tbl[min(PG_FIRST(t_first) + e, (long)(tbl_w - 1)) * tbl_s1];
  }
  barrier(CLK_LOCAL_MEM_FENCE);
#else
#define KV_ROW(J, TILE)                                                                        \
  long row = krow0 + J;                                                                        \
  if (ring > 0 && row >= ring) row -= ring;
#define KV_ROW_G(J) KV_ROW(J, 0)
#define ROW_OFF(SB, SR) row * SR
#define FAST_PAGES(TILE)
#define FAST_BASE(XP0, XC0, X_SR) XP0 + n0_ * X_SR
#define FAST_ROW(I)
#define FAST_OFF(DENSE, SB, SR) DENSE
#define NEXT_PAGES(TILE)
#endif
// chunk slot CH holds a chunk of K's (V's) local rows
#define K_SLOT(CH) (QK_CHUNKS == CHUNKS || (CH) < QK_CHUNKS)
#define V_SLOT(CH) (V_CHUNKS == CHUNKS || (CH) < V_CHUNKS)
// Generic K/V tile load: keys outside the block's visible range are zero-filled (never read),
// ring-buffer rows wrap.
#define LOAD_KV_CHECKED(TILE, BUF)                                                             \
  for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {                                      \
    int r = c / CHUNKS, ch = c % CHUNKS, j = (TILE) * BLOCK_N + r;                             \
    int so = (BUF) * BLOCK_N * LDSK + r * LDSK + ch * EPC;                                     \
    if (j >= lo_blk && j <= hi_blk) {                                                          \
      KV_ROW(j, TILE)                                                                          \
      if (K_SLOT(ch)) { LOAD_CHUNK(sK + so, kh + ROW_OFF(k_sb, k_sr) + ch * EPC, ch, HEAD_DIM) } \
      if (V_SLOT(ch)) { LOAD_CHUNK(sV + SO_V(BUF), vh + ROW_OFF(v_sb, v_sr) + ch * EPC, ch, HEAD_DIM_V) } \
    } else {                                                                                   \
      if (K_SLOT(ch)) ZERO16(sK + so);                                                         \
      if (V_SLOT(ch)) ZERO16(sV + SO_V(BUF));                                                  \
    }                                                                                          \
  }
// Fast path for a tile inside the block's range that does not wrap: each thread copies the same
// 16-byte column chunk of rows r0, r0 + ROW_STEP, ... from pointers hoisted out of the loop.
#define ROW_STEP (THREADS / CHUNKS)
#define FAST_N (BLOCK_N / ROW_STEP)
#define FAST_STEP (ROW_STEP * LDS)
#define FAST_SRC(I, STEP) ((I) * (STEP))
#if LDSM_BYTES
#define KV_BUF_BYTES (BLOCK_N * LDS * 2)
#if USE_PTX
#define SBASE(P) ((uint)(size_t)(P))  // shared-window byte address of local array P
#define LDSM_B(R, P, A) LDSM_X4_ADDR(R, A)
#define LDSM_B_T(R, P, A) LDSM_X4_T_ADDR(R, A)
#define CP_ASYNC16_B(P, A, SRC) CP_ASYNC16_ADDR(A, SRC)
#else  // emulated: byte offsets from the array P itself
#define SBASE(P) 0u
#define LDSM_B(R, P, A) emu_ldsm((R), (P), (int)(A) >> 1, 0, scr)
#define LDSM_B_T(R, P, A) emu_ldsm((R), (P), (int)(A) >> 1, 1, scr)
#define CP_ASYNC16_B(P, A, SRC) CP_ASYNC16((P) + ((A) >> 1), SRC)
#endif
// chunk I of the fast loader: row r0_ + I ROW_STEP of the buffer SX (in the array ARR) whose
// chunk 0 is at DST0 (LDSM_BYTES: a byte address of ARR's window; else SX + so0)
#define CP_ROW_CHUNK(SX, ARR, DST0, I, SRC)                                                    \
  CP_ASYNC16_B(ARR, (DST0) + (I) * (FAST_STEP * 2), SRC)
#define LOAD_KV_FAST(BUF)                                                                      \
      UNROLL for (int i = 0; i < FAST_N; i++) {                                                \
        FAST_ROW(i)                                                                            \
        FAST_CHUNK(sK + (BUF) * BLOCK_N * LDS, sK, kdst0 + (BUF) * KV_BUF_BYTES, i,            \
                   kt + FAST_OFF(FAST_SRC(i, k_step), k_sb, k_sr), HEAD_DIM, QK_CHUNKS)        \
        FAST_CHUNK(sV + (BUF) * BLOCK_N * LDS, sV, vdst0 + (BUF) * KV_BUF_BYTES, i,            \
                   vt + FAST_OFF(FAST_SRC(i, v_step), v_sb, v_sr), HEAD_DIM_V, V_CHUNKS)       \
      }
#else
#define CP_ROW_CHUNK(SX, ARR, DST0, I, SRC) CP_ASYNC16((SX) + so0 + (I) * ROW_STEP * LDS, SRC)
#define LOAD_KV_FAST(BUF)                                                                      \
      __local ELEM *skt = sK + (BUF) * BLOCK_N * LDSK + so0;                                   \
      __local ELEM *svt = sV + (BUF) * BLOCK_N * LDSV + SO0_V;                                 \
      UNROLL for (int i = 0; i < BLOCK_N / ROW_STEP; i++) {                                    \
        FAST_ROW(i)                                                                            \
        FAST_CHUNK_AT(skt + i * ROW_STEP * LDSK, kt + FAST_OFF(i * k_step, k_sb, k_sr), HEAD_DIM, \
                      QK_CHUNKS)                                                               \
        FAST_CHUNK_AT(svt + i * ROW_STEP * LDSV, vt + FAST_OFF(i * v_step, v_sb, v_sr),        \
                      HEAD_DIM_V, V_CHUNKS)                                                    \
      }
#endif
// the fast loader's chunk (this thread's chunk column ch0_) of a tensor of N columns, NCH local
// chunks: at the element pointer DST, or (FAST_CHUNK) row I of the 16-bit buffer SX through
// CP_ROW_CHUNK when every slot is a whole chunk
#define FAST_CHUNK_AT(DST, SRC, N, NCH)                                                        \
  if (CHUNK_WHOLE(N)) {                                                                        \
    CP_ASYNC16(DST, SRC);                                                                      \
  } else if (ch0_ < (NCH)) {                                                                   \
    LOAD_CHUNK(DST, SRC, ch0_, N)                                                              \
  }
#define FAST_CHUNK(SX, ARR, DST0, I, SRC, N, NCH)                                              \
  if (CHUNK_WHOLE(N)) {                                                                        \
    CP_ROW_CHUNK(SX, ARR, DST0, I, SRC);                                                       \
  } else if (ch0_ < (NCH)) {                                                                   \
    LOAD_CHUNK((SX) + so0 + (I) * ROW_STEP * LDS, SRC, ch0_, N)                                \
  }
#define LOAD_KV(TILE, BUF)                                                                     \
  {                                                                                            \
    const int n0_ = (TILE) * BLOCK_N;                                                          \
    NEXT_PAGES(TILE)                                                                           \
    if (n0_ >= lo_blk && n0_ + BLOCK_N - 1 <= hi_blk &&                                        \
        (ring == 0 || krow0 + n0_ + BLOCK_N <= ring)) {                                        \
      FAST_PAGES(TILE)                                                                         \
      __global const ELEM *kt = FAST_BASE(kp0, kc0, k_sr), *vt = FAST_BASE(vp0, vc0, v_sr);    \
      LOAD_KV_FAST(BUF)                                                                        \
    } else {                                                                                   \
      LOAD_KV_CHECKED(TILE, BUF)                                                               \
    }                                                                                          \
  }
  const int r0_ = tid / CHUNKS, ch0_ = tid % CHUNKS, so0 = r0_ * LDSK + ch0_ * EPC;
  __global const ELEM *kp0 = kh + (krow0 + r0_) * k_sr + ch0_ * EPC;
  __global const ELEM *vp0 = vh + (krow0 + r0_) * v_sr + ch0_ * EPC;
  const long k_step = ROW_STEP * k_sr, v_step = ROW_STEP * v_sr;
#if LDSM_BYTES
  // ldmatrix row addresses (lanes 8i..8i+7 give matrix i's rows): A-type (Q, and V read
  // transposed) rows (lane & 7) + 8 ((lane >> 3) & 1), column 8 (lane >> 4); B-type (K) rows
  // (lane & 7) + 8 (lane >> 4), column 8 ((lane >> 3) & 1); K and V in buffer 0
  const int ra_ = (lane & 7) + ((lane >> 3) & 1) * 8, ca_ = (lane >> 4) * 8;
  const int rb_ = (lane & 7) + (lane >> 4) * 8, cb_ = ((lane >> 3) & 1) * 8;
  const uint qaddr = SBASE(sQ) + ((wrow0 + ra_) * LDS + ca_) * 2;
  const uint kaddr = SBASE(sK) + (rb_ * LDS + cb_) * 2;
  const uint vaddr = SBASE(sV) + (ra_ * LDS + ca_) * 2;
  const uint kdst0 = SBASE(sK) + so0 * 2, vdst0 = SBASE(sV) + so0 * 2;
#endif
#if KV_SPLIT_STAGES || SOFTMAX_PIPE
// one tensor (K or V) of a tile into the buffer at SX, as LOAD_KV_CHECKED / LOAD_KV do
#define LOAD_X_CHECKED(TILE, SX, XH, X_SB, X_SR, N, NCH)                                       \
  for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {                                      \
    int r = c / CHUNKS, ch = c % CHUNKS, j = (TILE) * BLOCK_N + r;                             \
    if ((NCH) != CHUNKS && ch >= (NCH)) continue;                                              \
    if (j >= lo_blk && j <= hi_blk) {                                                          \
      KV_ROW(j, TILE)                                                                          \
      LOAD_CHUNK((SX) + r * LDS + ch * EPC, (XH) + ROW_OFF(X_SB, (X_SR)) + ch * EPC, ch, N)    \
    } else {                                                                                   \
      ZERO16((SX) + r * LDS + ch * EPC);                                                       \
    }                                                                                          \
  }
#define LOAD_X(TILE, SX, ARR, XP0, XC0, X_STEP, XH, X_SB, X_SR, DST0, N, NCH)                  \
  {                                                                                            \
    const int n0_ = (TILE) * BLOCK_N;                                                          \
    if (n0_ >= lo_blk && n0_ + BLOCK_N - 1 <= hi_blk &&                                        \
        (ring == 0 || krow0 + n0_ + BLOCK_N <= ring)) {                                        \
      FAST_PAGES(TILE)                                                                         \
      __global const ELEM *xt = FAST_BASE((XP0), XC0, (X_SR));                                 \
      UNROLL for (int i = 0; i < FAST_N; i++) {                                                \
        FAST_ROW(i)                                                                            \
        FAST_CHUNK(SX, ARR, DST0, i, xt + FAST_OFF(FAST_SRC(i, X_STEP), X_SB, X_SR), N, NCH)   \
      }                                                                                        \
    } else {                                                                                   \
      LOAD_X_CHECKED(TILE, SX, XH, X_SB, X_SR, N, NCH)                                         \
    }                                                                                          \
  }
// K's loads are each tile's first: they stage the next tile's table entries (NEXT_PAGES)
#define LOAD_K(TILE)                                                                           \
  NEXT_PAGES(TILE)                                                                             \
  LOAD_X(TILE, sK, sK, kp0, kc0, k_step, kh, k_sb, k_sr, kdst0, HEAD_DIM, QK_CHUNKS)
#define LOAD_V(TILE)                                                                           \
  LOAD_X(TILE, sV, sV, vp0, vc0, v_step, vh, v_sb, v_sr, vdst0, HEAD_DIM_V, V_CHUNKS)
#if SOFTMAX_PIPE  // K and V in separate groups (K is waited for first)
  if (t_first <= t_last) { LOAD_K(t_first) }
  CP_COMMIT();
  if (t_first <= t_last) { LOAD_V(t_first) }
#else
  if (t_first <= t_last) { LOAD_K(t_first) }
#endif
#else
  if (t_first <= t_last) { LOAD_KV(t_first, 0) }
#endif
  CP_COMMIT();

#if IS_TF32
  // Q fragments of k-step kk: rows g, g + 8 of the m-tile, columns 8 kk + 2t, 8 kk + 2t + 1 as
  // k = t, t + 4 (a product's k order is free: both values are one float2, in Q and in K)
  CP_WAIT(1);
  barrier(CLK_LOCAL_MEM_FENCE);
#define Q_PTR(KK, MT) (sQ + (wrow0 + (MT) * 16 + g) * LDSQ + (KK) * 8 + 2 * tg)
#if Q_IN_REGS
  uint qh[KSTEPS_QK][M_TILES][4];
#if Q_IN_REGS == 1
  uint ql[KSTEPS_QK][M_TILES][4];
#endif
  UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {
      __local float *p0 = Q_PTR(kk, mt);
      const float2 x0 = *(__local float2 *)p0, x1 = *(__local float2 *)(p0 + 8 * LDSQ);
      uint lo[4];
      SPLIT_TF32(x0.x, qh[kk][mt][0], lo[0]);
      SPLIT_TF32(x1.x, qh[kk][mt][1], lo[1]);
      SPLIT_TF32(x0.y, qh[kk][mt][2], lo[2]);
      SPLIT_TF32(x1.y, qh[kk][mt][3], lo[3]);
#if Q_IN_REGS == 1
      UNROLL for (int r = 0; r < 4; r++) ql[kk][mt][r] = lo[r];
#else
      // lo back in place: each lane later rereads only the values it wrote itself
      *(__local float2 *)p0 = (float2)(as_float(lo[0]), as_float(lo[2]));
      *(__local float2 *)(p0 + 8 * LDSQ) = (float2)(as_float(lo[1]), as_float(lo[3]));
#endif
    }
  }
#endif
#elif Q_IN_REGS
  uint qa[KSTEPS_QK][M_TILES][4];
  CP_WAIT(1);
  barrier(CLK_LOCAL_MEM_FENCE);
  UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {
      int row = wrow0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      LDSM_X4(qa[kk][mt], sQ, row * LDS + kk * 16 + (lane >> 4) * 8);
    }
  }
#endif

  float o[M_TILES][NT_O][4];
  float m_i[M_TILES][2], l_i[M_TILES][2];
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {
    UNROLL for (int nd = 0; nd < NT_O; nd++) {
      UNROLL for (int c = 0; c < 4; c++) o[mt][nd][c] = 0.f;
    }
    UNROLL for (int hf = 0; hf < 2; hf++) { m_i[mt][hf] = -INFINITY; l_i[mt][hf] = 0.f; }
  }

#if SOFTMAX_PIPE
#include "attn_fwd_mma_pipe.h"
#else
  for (int t = t_first; t <= t_last; t++) {
#if KV_SPLIT_STAGES
    // -- K(t) has landed (the only group in flight); after the barrier no warp still reads
    // V(t-1), so V(t) loads under S = Q K^T
    const int buf = 0;
    CP_WAIT(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    LOAD_V(t)
    CP_COMMIT();
#else
    const int buf = (t - t_first) & 1;
    // -- tile t has landed; after the barrier no warp still reads tile t-1's buffer, so the
    // prefetch of tile t+1 into it overlaps this tile's math (one barrier per tile)
    CP_WAIT(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t < t_last) {
      LOAD_KV(t + 1, buf ^ 1)
      CP_COMMIT();
    }
#endif
    __local const ELEM *sKb = sK + buf * BLOCK_N * LDSK;
    __local const ELEM *sVb = sV + buf * BLOCK_N * LDSV;
#if LDSM_BYTES
    const uint kb_ = kaddr + buf * KV_BUF_BYTES, vb_ = vaddr + buf * KV_BUF_BYTES;
#endif
    const int n0 = t * BLOCK_N;
    const bool need_mask = MASK_KIND || !(n0 >= lo_all && n0 + BLOCK_N - 1 <= hi_all);

    // -- a hidden key must contribute nothing even when its v holds inf/NaN, but the mma would
    // multiply P = 0 by it.  Only tiles that hide keys from some rows (need_mask) can: there the
    // non-finite v values are zeroed in local memory for the mma, and added back after PV, read
    // from global memory, to the rows that see them (rare; costs one scan and one barrier).
    // float32 scans every tile: then the 3xTF32 split of V needs no inf test per value per warp
    // (the scan is one pass of the work-group over the tile and a barrier)
    int v_bad = 0;
#if !KV_SPLIT_STAGES
#if IS_TF32
    {
      int mine = 0;
      for (int c = tid; c < BLOCK_N * V_CHUNKS; c += THREADS) {
        __local ELEM *pv = sV + buf * BLOCK_N * LDSV + (c / V_CHUNKS) * LDSV + (c % V_CHUNKS) * EPC;
        const uint4 w = *(__local const uint4 *)pv;
        if (NONFINITE32(w.x) || NONFINITE32(w.y) || NONFINITE32(w.z) || NONFINITE32(w.w)) {
          for (int e = 0; e < 4; e++) {
            if (NONFINITE32(as_uint(pv[e]))) pv[e] = 0.f;
          }
          mine = 1;
        }
      }
      if (mine) v_flag = t + 1;
      barrier(CLK_LOCAL_MEM_FENCE);
      v_bad = v_flag == t + 1;
    }
#else
    if (need_mask) SCAN_HIDDEN_V16(sV + buf * BLOCK_N * LDSV, LDSV)
#endif
#endif

#if KV_SPLIT_STAGES  // S lives across the mid-tile sync (outside the WARP_SKIP blocks)
    float sacc[M_TILES][NT_S][4];
#endif
#if WARP_SKIP
    const bool w_skip = n0 > w_hi || n0 + BLOCK_N - 1 < w_lo;
#if USE_PTX
    if (!w_skip) {  // (the tile's math below, up to the K/V reload, is not re-indented)
#else
    float o_keep[M_TILES][NT_O][4], m_keep[M_TILES][2], l_keep[M_TILES][2];
    KEEP_STATE
#endif
#endif
    // -- S = Q K^T
#if !KV_SPLIT_STAGES
    float sacc[M_TILES][NT_S][4];
#endif
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        UNROLL for (int c = 0; c < 4; c++) sacc[mt][nt][c] = 0.f;
      }
    }
#if IS_TF32
    // 3xTF32 per k-step: part = Q_lo K_hi + Q_hi K_lo + Q_hi K_hi, summed from zero over
    // one k-step, then S += part in float32 (round to nearest): S takes KSTEPS_QK roundings,
    // not one per product (the tensor core's own accumulation truncates, and 3 HEAD_DIM terms
    // would round S ~sqrt(3 HEAD_DIM) times, several times the one rounding of the float32
    // reference's S; large logits showed it).
    UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
#if Q_IN_REGS != 1
      uint ql1[M_TILES][4];
#if Q_IN_REGS == 0
      uint qh1[M_TILES][4];
#endif
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
        __local const float *p0 = Q_PTR(kk, mt);
        const float2 x0 = *(__local const float2 *)p0;
        const float2 x1 = *(__local const float2 *)(p0 + 8 * LDSQ);
#if Q_IN_REGS == 0
        SPLIT_TF32(x0.x, qh1[mt][0], ql1[mt][0]);
        SPLIT_TF32(x1.x, qh1[mt][1], ql1[mt][1]);
        SPLIT_TF32(x0.y, qh1[mt][2], ql1[mt][2]);
        SPLIT_TF32(x1.y, qh1[mt][3], ql1[mt][3]);
#else
        ql1[mt][0] = as_uint(x0.x);
        ql1[mt][1] = as_uint(x1.x);
        ql1[mt][2] = as_uint(x0.y);
        ql1[mt][3] = as_uint(x1.y);
#endif
      }
#define QL(MT) ql1[MT]
#else
#define QL(MT) ql[kk][MT]
#endif
#if Q_IN_REGS == 0
#define QH(MT) qh1[MT]
#else
#define QH(MT) qh[kk][MT]
#endif
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        // B: key 8 nt + g, the same two columns
        const float2 kx = *(__local const float2 *)(sKb + (nt * 8 + g) * LDSK + kk * 8 + 2 * tg);
        uint bh0, bl0, bh1, bl1;
        SPLIT_TF32(kx.x, bh0, bl0);
        SPLIT_TF32(kx.y, bh1, bl1);
        UNROLL for (int mt = 0; mt < M_TILES; mt++) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
          MMA_TF32(part, QL(mt), bh0, bh1);
          MMA_TF32(part, QH(mt), bl0, bl1);
          MMA_TF32(part, QH(mt), bh0, bh1);
          UNROLL for (int c = 0; c < 4; c++) sacc[mt][nt][c] += part[c];
        }
      }
#undef QL
#undef QH
    }
#else
    UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
#if !Q_IN_REGS
      uint qa1[M_TILES][4];
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
#if LDSM_BYTES
        LDSM_B(qa1[mt], sQ, qaddr + (mt * 16 * LDS + kk * 16) * 2);
#else
        int row = wrow0 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        LDSM_X4(qa1[mt], sQ, row * LDS + kk * 16 + (lane >> 4) * 8);
#endif
      }
#define QA(MT) qa1[MT]
#else
#define QA(MT) qa[kk][MT]
#endif
      UNROLL for (int n2 = 0; n2 < NT_S / 2; n2++) {
        uint kf[4];
#if LDSM_BYTES
        LDSM_B(kf, sK, kb_ + (n2 * 16 * LDS + kk * 16) * 2);
#else
        int key = n2 * 16 + (lane & 7) + (lane >> 4) * 8;
        LDSM_X4(kf, sKb, key * LDS + kk * 16 + ((lane >> 3) & 1) * 8);
#endif
        UNROLL for (int mt = 0; mt < M_TILES; mt++) {
          MMA(sacc[mt][2 * n2], QA(mt), kf[0], kf[1]);
          MMA(sacc[mt][2 * n2 + 1], QA(mt), kf[2], kf[3]);
        }
      }
#undef QA
    }
#endif

    // -- scores in the exp2 domain (score.h); with the scale folded into the softmax only the
    // hiding is left, and tiles that hide nothing skip the pass
    if (!SCORE_FOLD || need_mask) {
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
        UNROLL for (int nt = 0; nt < NT_S; nt++) {
          UNROLL for (int c = 0; c < 4; c++) {
            const int j = n0 + nt * 8 + 2 * tg + (c & 1);
            ROW_SCORE(sacc[mt][nt][c], mt, c >> 1, j, SCORE_FOLD || need_mask)
          }
        }
      }
    }

#if KV_SPLIT_STAGES
#if WARP_SKIP && USE_PTX
    }  // (the skipped tile's math resumes after the sync)
#endif
    // -- V(t) has landed; after the barrier no warp still reads K(t): K(t+1) loads under the
    // softmax and P V
    CP_WAIT(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t < t_last) {
      LOAD_K(t + 1)
      CP_COMMIT();
    }
    if (need_mask) SCAN_HIDDEN_V16(sV, LDS)  // (as above, for the one V buffer)
#if WARP_SKIP && USE_PTX
    if (!w_skip) {
#endif
#endif
    // -- online softmax.  Lazy rescaling (exact): the running max m moves, and l and O are
    // rescaled by alpha = 2^(m_old - m_new), only when some row of the warp saw its max grow by
    // more than RESCALE_THRESH (log2 units); otherwise P = 2^(S - m) stays below 2^RESCALE_THRESH.
    float m_new[M_TILES][2];
    int grow = 0;
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {
      UNROLL for (int hf = 0; hf < 2; hf++) {
        float mx = -INFINITY;
        UNROLL for (int nt = 0; nt < NT_S; nt++) {
          mx = fmax(mx, fmax(sacc[mt][nt][2 * hf], sacc[mt][nt][2 * hf + 1]));
        }
        mx = fmax(mx, SHFL_XOR(mx, 1));
        mx = fmax(mx, SHFL_XOR(mx, 2));
        m_new[mt][hf] = fmax(m_i[mt][hf], SCORE_MAX(mx, qk_scale));
        grow |= m_new[mt][hf] - m_i[mt][hf] > RESCALE_THRESH;  // false while both are -inf
      }
    }
    if (WARP_ANY(grow)) {
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
        UNROLL for (int hf = 0; hf < 2; hf++) {
          const float m_use = m_new[mt][hf] == -INFINITY ? 0.f : m_new[mt][hf];
          const float alpha = ex2(m_i[mt][hf] - m_use);
          m_i[mt][hf] = m_new[mt][hf];
          l_i[mt][hf] *= alpha;
          UNROLL for (int nd = 0; nd < NT_O; nd++) {
            o[mt][nd][2 * hf] *= alpha;
            o[mt][nd][2 * hf + 1] *= alpha;
          }
        }
      }
    }
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {
      UNROLL for (int hf = 0; hf < 2; hf++) {
        const float m_use = m_i[mt][hf] == -INFINITY ? 0.f : m_i[mt][hf];  // a row seeing nothing
        float rs = 0.f;
        UNROLL for (int nt = 0; nt < NT_S; nt++) {
          UNROLL for (int c = 0; c < 2; c++) {
            float p = ex2(SCORE_P_ARG(sacc[mt][nt][2 * hf + c], m_use, qk_scale));
            sacc[mt][nt][2 * hf + c] = p;
            rs += p;
          }
        }
        l_i[mt][hf] += rs;
      }
    }

#if IS_TF32
    // -- O += P V, 3xTF32.  k-step nt = the 8 keys of S n-tile nt, in the order of the S
    // accumulators (k = t: key 2t, k = t + 4: key 2t + 1); V's rows are read in that order.
    // Each 8-column n-tile of O takes this key tile's product from zero and adds it to O in
    // float32: O rounds once per key tile, not once per mma (whose accumulation truncates).
    uint ph[M_TILES][KSTEPS_PV][4], pl[M_TILES][KSTEPS_PV][4];
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {
      UNROLL for (int nt = 0; nt < KSTEPS_PV; nt++) {
        SPLIT_TF32(sacc[mt][nt][0], ph[mt][nt][0], pl[mt][nt][0]);  // (g, key 2t)
        SPLIT_TF32(sacc[mt][nt][2], ph[mt][nt][1], pl[mt][nt][1]);  // (g + 8, key 2t)
        SPLIT_TF32(sacc[mt][nt][1], ph[mt][nt][2], pl[mt][nt][2]);  // (g, key 2t + 1)
        SPLIT_TF32(sacc[mt][nt][3], ph[mt][nt][3], pl[mt][nt][3]);  // (g + 8, key 2t + 1)
      }
    }
    UNROLL for (int nd = 0; nd < NT_O; nd++) {
      float part[M_TILES][4];
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
        UNROLL for (int c = 0; c < 4; c++) part[mt][c] = 0.f;
      }
      UNROLL for (int nt = 0; nt < KSTEPS_PV; nt++) {
        __local const float *vp = sVb + (nt * 8 + 2 * tg) * LDSV + nd * 8 + g;
        uint bh0, bl0, bh1, bl1;
        SPLIT_TF32_V(vp[0], bh0, bl0);
        SPLIT_TF32_V(vp[LDSV], bh1, bl1);
        UNROLL for (int mt = 0; mt < M_TILES; mt++) {
          MMA_TF32(part[mt], pl[mt][nt], bh0, bh1);
          MMA_TF32(part[mt], ph[mt][nt], bl0, bl1);
          MMA_TF32(part[mt], ph[mt][nt], bh0, bh1);
        }
      }
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
        UNROLL for (int c = 0; c < 4; c++) o[mt][nd][c] += part[mt][c];
      }
    }
#else
    // -- O += P V: the S accumulators of n-tiles 2t2, 2t2+1 are the A fragment of k-step t2
    UNROLL for (int t2 = 0; t2 < KSTEPS_PV; t2++) {
      uint pa[M_TILES][4];
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {
        pa[mt][0] = pack2(sacc[mt][2 * t2][0], sacc[mt][2 * t2][1]);
        pa[mt][1] = pack2(sacc[mt][2 * t2][2], sacc[mt][2 * t2][3]);
        pa[mt][2] = pack2(sacc[mt][2 * t2 + 1][0], sacc[mt][2 * t2 + 1][1]);
        pa[mt][3] = pack2(sacc[mt][2 * t2 + 1][2], sacc[mt][2 * t2 + 1][3]);
      }
      UNROLL for (int n2 = 0; n2 < NT_O / 2; n2++) {
        uint vf[4];
#if LDSM_BYTES
        LDSM_B_T(vf, sV, vb_ + (t2 * 16 * LDS + n2 * 16) * 2);
#else
        int key = t2 * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        LDSM_X4_T(vf, sVb, key * LDS + n2 * 16 + (lane >> 4) * 8);
#endif
        UNROLL for (int mt = 0; mt < M_TILES; mt++) {
          MMA(o[mt][2 * n2], pa[mt], vf[0], vf[1]);
          MMA(o[mt][2 * n2 + 1], pa[mt], vf[2], vf[3]);
        }
      }
    }
#endif

    // -- the inf/NaN zeroed above, for the rows that see their keys (p > 0: inf or NaN stays)
    ADD_BACK_HIDDEN_V()
#if WARP_SKIP
#if USE_PTX
    }
#else
    if (w_skip) { RESTORE_STATE }
#endif
#endif
  }
#endif
  CP_WAIT(0);

  // -- epilogue (epilogue.h): O / l, lse = (m + log2 l) ln 2, the sink; empty rows
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {
    UNROLL for (int hf = 0; hf < 2; hf++) {
      float l = l_i[mt][hf];
      l += SHFL_XOR(l, 1);
      l += SHFL_XOR(l, 2);
      float inv, lse_r;
      EPI_FINISH(1, float, m_i[mt][hf], l, n_sinks, sinks[h], inv, lse_r)
      const int r = wrow0 + mt * 16 + g + 8 * hf;
      if (r < nrows) {
        const long row = qrow0 + m0 + r;
        __global ELEM *orow_e = out + ((qb * sq_arr + row) * n_heads + h) * HEAD_DIM_V;
#if HEAD_DIM_V % 2 == 0  // pairs of columns (2t, 2t + 1) of n-tile nd; the padding not stored
        __global OUT2 *orow = (__global OUT2 *)orow_e;
        UNROLL for (int nd = 0; nd < NT_O; nd++) {
          if (DV == HEAD_DIM_V || nd * 8 + 2 * tg < HEAD_DIM_V)
            orow[nd * 4 + tg] = OUT_PACK(o[mt][nd][2 * hf] * inv, o[mt][nd][2 * hf + 1] * inv);
        }
#else  // odd Dv: rows are not pair-aligned, one element at a time
        UNROLL for (int nd = 0; nd < NT_O; nd++) {
          UNROLL for (int e = 0; e < 2; e++) {
            const int col = nd * 8 + 2 * tg + e;
            if (col < HEAD_DIM_V) orow_e[col] = OUT_ONE(o[mt][nd][2 * hf + e] * inv);
          }
        }
#endif
        if (tg == 0) lse[(qb * n_heads + h) * sq_arr + row] = lse_r;
      }
    }
  }
}
