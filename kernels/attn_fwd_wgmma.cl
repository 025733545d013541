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
// Shared-memory layout of Q, K and V tiles ("no swizzle" canonical layout): 8 x 8 core matrices
// of 128 contiguous bytes, element (r, c) at halves (r / 8) * 8 HEAD_DIM + (c / 8) * 64 +
// (r % 8) * 8 + c % 8. As a K-major operand (Q, K: rows = M or N, columns = K) the core matrices
// are LBO = 128 bytes apart along K and SBO = 16 HEAD_DIM bytes along M/N; as the N-major B of
// P V (V: rows = keys = K, columns = N) they are LBO = 16 HEAD_DIM bytes apart along K and
// SBO = 128 bytes along N. The 16-byte chunk c of a tile (chunk = 8 halves of one row) sits at
// bytes 16 c when c = r % 8 + 8 (col / 8) + HEAD_DIM (r / 8): cp.async destinations are linear.
//
// Compile-time sizes (-D): HEAD_DIM (64 or 128), WGS (1..3), BLOCK_N (multiple of 16, at most
// 256), IS_BF16, SOFTCAP, ALIBI, SCALE_POS; debugging: V_SWAP / QK_SWAP exchange LBO and SBO.

#define USE_PTX 1
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
#ifndef V_SWAP
#define V_SWAP 0
#endif
#ifndef QK_SWAP
#define QK_SWAP 0
#endif
#define LOG2E 1.4426950408889634f
#include "nv_warp.h"

// make the generic-proxy writes to shared memory (cp.async, stores) visible to wgmma's reads
#define FENCE_ASYNC_SHARED() asm volatile("fence.proxy.async.shared::cta;" ::: "memory")

// 64-bit wgmma matrix descriptor: start address, LBO, SBO (bytes, each >> 4), no swizzle
inline ulong wg_desc(uint addr, uint lbo, uint sbo) {
  return (ulong)((addr & 0x3FFFFu) >> 4) | ((ulong)(lbo >> 4) << 16) | ((ulong)(sbo >> 4) << 32);
}
#if QK_SWAP
#define DESC_KMAJ(A) wg_desc((A), 16 * HEAD_DIM, 128)
#else
#define DESC_KMAJ(A) wg_desc((A), 128, 16 * HEAD_DIM)
#endif
#if V_SWAP
#define DESC_NMAJ(A) wg_desc((A), 128, 16 * HEAD_DIM)
#else
#define DESC_NMAJ(A) wg_desc((A), 16 * HEAD_DIM, 128)
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
void attn_fwd_wgmma(__global const ELEM *q, __global const ELEM *k, __global const ELEM *v,
                    __global ELEM *out, __global float *lse,
                    __global const int *tiles,    // (n_tiles, 2): sequence, first local query row
                    __global const long *seqs,    // (n_seq, SEQ_FIELDS), see _nvidia_mma.py
                    __global const float *alibi,  // (n_seq, Hq) slopes * log2(e), when ALIBI
                    const long q_off, const long q_sb, const long q_sr, const long q_sh,
                    const long k_off, const long k_sb, const long k_sr, const long k_sh,
                    const long v_off, const long v_sb, const long v_sr, const long v_sh,
                    const int sq_arr, const int n_heads, const int group, const int ring,
                    const float qk_scale, const float cap) {
  __local ELEM sQ[BLOCK_M * HEAD_DIM] __attribute__((aligned(128)));
  __local ELEM sK[2 * BLOCK_N * HEAD_DIM] __attribute__((aligned(128)));
  __local ELEM sV[2 * BLOCK_N * HEAD_DIM] __attribute__((aligned(128)));
  __local int v_flag;  // = t + 1 when tile t's V held inf/NaN under hidden keys
  const int tid = get_local_id(0), lane = tid & 31;
  const int wgi = tid >> 7, warp = (tid >> 5) & 3;
  const int g = lane >> 2, tg = lane & 3;
  if (tid == 0) v_flag = 0;
#if HEADS_INNER
  const int h = get_group_id(0) % n_heads, hk = h / group, wgid = get_group_id(0) / n_heads;
  const int s = tiles[2 * wgid], m0 = tiles[2 * wgid + 1];
#else
  const int h = get_group_id(1), hk = h / group;
  const int s = tiles[2 * get_group_id(0)], m0 = tiles[2 * get_group_id(0) + 1];
#endif
  __global const long *sp = seqs + (long)s * SEQ_FIELDS;
  LOAD_SEQ(sp)
  const int nrows = min(BLOCK_M, qlen - m0);
  const int wrow0 = wgi * 64 + warp * 16;  // this warp's first row in the block

  const int lo_blk = row_lo(m0, base, dlo, klen), hi_blk = row_hi(m0 + nrows - 1, base, dhi, klen);
  const int lo_all = row_lo(m0 + nrows - 1, base, dlo, klen), hi_all = row_hi(m0, base, dhi, klen);
  const int t_first = lo_blk / BLOCK_N;
  const int t_last = hi_blk >= lo_blk ? hi_blk / BLOCK_N : t_first - 1;
  int rlo[2], rhi[2];
  UNROLL for (int hf = 0; hf < 2; hf++) {
    long i = m0 + wrow0 + g + 8 * hf;
    rlo[hf] = row_lo(i, base, dlo, klen);
    rhi[hf] = row_hi(i, base, dhi, klen);
  }
#if ALIBI
  const float slope = alibi[(long)s * n_heads + h];
#endif

  // -- chunk c of a tile: row r = c % 8 + 8 (c / (8 CHUNKS)), column chunk (c / 8) % CHUNKS,
  // local bytes 16 c (see the layout above)
  __global const ELEM *qh = q + q_off + qb * q_sb + h * q_sh;
  for (int c = tid; c < BLOCK_M * CHUNKS; c += THREADS) {
    const int r = (c & 7) + 8 * (c / (8 * CHUNKS)), ch = (c >> 3) % CHUNKS;
    if (r < nrows) CP_ASYNC16(sQ + 8 * c, qh + (qrow0 + m0 + r) * q_sr + ch * 8);
    else ZERO16(sQ + 8 * c);
  }
  CP_COMMIT();
  __global const ELEM *kh = k + k_off + kb * k_sb + hk * k_sh;
  __global const ELEM *vh = v + v_off + kb * v_sb + hk * v_sh;
  // this thread's chunks of a K/V tile: c = tid + i THREADS, i < KV_PER: the same column chunk,
  // rows r0_ + i ROW_STEP
#define KV_PER (BLOCK_N * CHUNKS / THREADS)
#define ROW_STEP (8 * THREADS / (8 * CHUNKS))
  const int r0_ = (tid & 7) + 8 * (tid / (8 * CHUNKS)), ch0_ = (tid >> 3) % CHUNKS;
  __global const ELEM *kp0 = kh + (krow0 + r0_) * k_sr + ch0_ * 8;
  __global const ELEM *vp0 = vh + (krow0 + r0_) * v_sr + ch0_ * 8;
#define LOAD_KV(TILE, BUF)                                                                     \
  {                                                                                            \
    const int n0_ = (TILE) * BLOCK_N;                                                          \
    __local ELEM *kd_ = sK + (BUF) * BLOCK_N * HEAD_DIM + 8 * tid;                             \
    __local ELEM *vd_ = sV + (BUF) * BLOCK_N * HEAD_DIM + 8 * tid;                             \
    if (n0_ >= lo_blk && n0_ + BLOCK_N - 1 <= hi_blk &&                                        \
        (ring == 0 || krow0 + n0_ + BLOCK_N <= ring)) {                                        \
      __global const ELEM *kt = kp0 + n0_ * k_sr, *vt = vp0 + n0_ * v_sr;                      \
      UNROLL for (int i = 0; i < KV_PER; i++) {                                                \
        CP_ASYNC16(kd_ + i * 8 * THREADS, kt + i * ROW_STEP * k_sr);                           \
        CP_ASYNC16(vd_ + i * 8 * THREADS, vt + i * ROW_STEP * v_sr);                           \
      }                                                                                        \
    } else {                                                                                   \
      UNROLL for (int i = 0; i < KV_PER; i++) {                                                \
        const int j = n0_ + r0_ + i * ROW_STEP;                                                \
        if (j >= lo_blk && j <= hi_blk) {                                                      \
          long row = krow0 + j;                                                                \
          if (ring > 0 && row >= ring) row -= ring;                                            \
          CP_ASYNC16(kd_ + i * 8 * THREADS, kh + row * k_sr + ch0_ * 8);                       \
          CP_ASYNC16(vd_ + i * 8 * THREADS, vh + row * v_sr + ch0_ * 8);                       \
        } else {                                                                               \
          ZERO16(kd_ + i * 8 * THREADS);                                                       \
          ZERO16(vd_ + i * 8 * THREADS);                                                       \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
  }
  if (t_first <= t_last) { LOAD_KV(t_first, 0) }
  CP_COMMIT();

  const uint q_addr = (uint)(size_t)sQ + wgi * TILE_BYTES(64);
  const uint k_addr = (uint)(size_t)sK, v_addr = (uint)(size_t)sV;
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
    const bool need_mask = !(n0 >= lo_all && n0 + BLOCK_N - 1 <= hi_all);

    // -- hidden keys' inf/NaN v zeroed for the tensor cores (tiles that hide keys only)
    int v_bad = 0;
    if (need_mask) {
      int mine = 0;
      __local ELEM *vb = sV + buf * BLOCK_N * HEAD_DIM;
      for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {
        __local ushort *pv = vb + 8 * c;
        const uint4 w = *(__local const uint4 *)pv;
        if (NONFINITE2(w.x) || NONFINITE2(w.y) || NONFINITE2(w.z) || NONFINITE2(w.w)) {
          for (int e = 0; e < 8; e++) {
            if (NONFINITE16((uint)pv[e])) pv[e] = 0;
          }
          mine = 1;
        }
      }
      if (mine) v_flag = t + 1;
      FENCE_ASYNC_SHARED();
      barrier(CLK_LOCAL_MEM_FENCE);
      v_bad = v_flag == t + 1;
    }

    // -- S = Q K^T: KSTEPS_QK k-slices of 16 (two core matrices, 256 bytes, along K)
    const ulong dk0 = DESC_KMAJ(k_addr + buf * TILE_BYTES(BLOCK_N));
    WG_FENCE_S(sacc);
    UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {
      WG_SS_S(sacc, dq0 + (ulong)(kk * 16), dk0 + (ulong)(kk * 16), kk);
    }
    WG_COMMIT();
    WG_WAIT_S(sacc);

    // -- scores in the exp2 domain: softcap, alibi, then the mask
#if FOLD
    if (need_mask) {
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        UNROLL for (int c = 0; c < 4; c++) {
          const int j = n0 + nt * 8 + 2 * tg + (c & 1);
          if (j < rlo[c >> 1] || j > rhi[c >> 1]) sacc[nt][c] = -INFINITY;
        }
      }
    }
#else
    UNROLL for (int nt = 0; nt < NT_S; nt++) {
      UNROLL for (int c = 0; c < 4; c++) {
        float x = sacc[nt][c];
#if SOFTCAP
        x = cap * tanh(x * qk_scale);
#else
        x *= qk_scale;
#endif
        const int j = n0 + nt * 8 + 2 * tg + (c & 1);
#if ALIBI
        {
          long i = m0 + wrow0 + g + 8 * (c >> 1);
          x -= slope * fabs((float)(i + base - j));
        }
#endif
        if (need_mask && (j < rlo[c >> 1] || j > rhi[c >> 1])) x = -INFINITY;
        sacc[nt][c] = x;
      }
    }
#endif

    // -- online softmax (lazy rescaling, exact; see attn_fwd_mma.cl)
    float m_new[2];
    int grow = 0;
    UNROLL for (int hf = 0; hf < 2; hf++) {
      float mx = -INFINITY;
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        mx = fmax(mx, fmax(sacc[nt][2 * hf], sacc[nt][2 * hf + 1]));
      }
      mx = fmax(mx, SHFL_XOR(mx, 1));
      mx = fmax(mx, SHFL_XOR(mx, 2));
#if FOLD
      mx *= qk_scale;
#endif
      m_new[hf] = fmax(m_i[hf], mx);
      grow |= m_new[hf] - m_i[hf] > RESCALE_THRESH;
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
    uint pa[KSTEPS_PV][4];
    UNROLL for (int hf = 0; hf < 2; hf++) {
      const float m_use = m_i[hf] == -INFINITY ? 0.f : m_i[hf];
      float rs = 0.f;
      UNROLL for (int nt = 0; nt < NT_S; nt++) {
        UNROLL for (int c = 0; c < 2; c++) {
#if FOLD
          float p = ex2(fma(sacc[nt][2 * hf + c], qk_scale, -m_use));
#else
          float p = ex2(sacc[nt][2 * hf + c] - m_use);
#endif
          sacc[nt][2 * hf + c] = p;
          rs += p;
        }
      }
      l_i[hf] += rs;
    }
    // the S accumulators of n-tiles 2 t2, 2 t2 + 1 are the A fragment of k-slice t2
    UNROLL for (int t2 = 0; t2 < KSTEPS_PV; t2++) {
      pa[t2][0] = pack2(sacc[2 * t2][0], sacc[2 * t2][1]);
      pa[t2][1] = pack2(sacc[2 * t2][2], sacc[2 * t2][3]);
      pa[t2][2] = pack2(sacc[2 * t2 + 1][0], sacc[2 * t2 + 1][1]);
      pa[t2][3] = pack2(sacc[2 * t2 + 1][2], sacc[2 * t2 + 1][3]);
    }

    // -- O += P V: k-slice t2 = keys 16 t2 .. 16 t2 + 15 = two core matrices along K
    const ulong dv0 = DESC_NMAJ(v_addr + buf * TILE_BYTES(BLOCK_N));
    WG_FENCE_O(o);
    UNROLL for (int t2 = 0; t2 < KSTEPS_PV; t2++) {
      WG_RS_O(o, pa[t2], dv0 + (ulong)(t2 * HEAD_DIM * 2), 1);
    }
    WG_COMMIT();
    WG_WAIT_O(o);

    ADD_BACK_HIDDEN_V()
  }
  CP_WAIT(0);

  // -- epilogue: O / l, lse = (m + log2 l) ln 2; a row that saw no key: 0 and -inf
  UNROLL for (int hf = 0; hf < 2; hf++) {
    float l = l_i[hf];
    l += SHFL_XOR(l, 1);
    l += SHFL_XOR(l, 2);
    const float inv = l == 0.f ? 0.f : 1.f / l;
    const int r = wrow0 + g + 8 * hf;
    if (r < nrows) {
      const long row = qrow0 + m0 + r;
      __global uint *orow = (__global uint *)(out + ((qb * sq_arr + row) * n_heads + h) * HEAD_DIM);
      UNROLL for (int nd = 0; nd < NT_O; nd++) {
        orow[nd * 4 + tg] = pack2(o[nd][2 * hf] * inv, o[nd][2 * hf + 1] * inv);
      }
      if (tg == 0) {
        lse[(qb * n_heads + h) * sq_arr + row] = l == 0.f ? -INFINITY : (m_i[hf] + log2(l)) * LN2;
      }
    }
  }
}
