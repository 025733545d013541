// What the tensor-core kernels (attn_fwd_mma.cl, attn_fwd_wgmma.cl, attn_decode_mma.cl) share:
// the warp-level NVIDIA instructions -- mma.sync.m16n8k16 (f32 accumulate), ldmatrix x4 (plain
// and .trans), cp.async 16-byte copies, shuffles, vote.any, ex2.approx and the f32 -> f16/bf16
// pair conversion -- the non-finite helpers, the softmax constant and the prefill kernels' shared
// parameters and tile geometry.  Their score transform and epilogue: score.h, epilogue.h.
//
// USE_PTX=1: inline PTX (NVIDIA's OpenCL, sm_80+).  USE_PTX=0: an exact emulation in plain
// OpenCL C for any device (PoCL in CI): each lane publishes its operands in a per-warp scratch
// area `scr` (256 uints, declared by the kernel), a barrier, then each lane reads what the PTX
// ISA says it receives.  Every such call must sit in work-group-uniform control flow.
//
// Needs IS_BF16 and USE_PTX defined; PREFILL_PARAMS needs score.h (MASK_T).

#define XSTR_(X) #X
#define XSTR(X) XSTR_(X)

#if IS_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

#if USE_PTX
#define UNROLL _Pragma("unroll")

#define MMA(D, A, B0, B1)                                                                       \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "                   \
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                               \
      : "=f"((D)[0]), "=f"((D)[1]), "=f"((D)[2]), "=f"((D)[3])                                  \
      : "r"((A)[0]), "r"((A)[1]), "r"((A)[2]), "r"((A)[3]), "r"(B0), "r"(B1),                  \
        "f"((D)[0]), "f"((D)[1]), "f"((D)[2]), "f"((D)[3]))

#define LDSM_X4(R, BASE, OFF)                                                                   \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"                 \
               : "=r"((R)[0]), "=r"((R)[1]), "=r"((R)[2]), "=r"((R)[3])                         \
               : "r"((uint)(size_t)((BASE) + (OFF))) : "memory")

#define LDSM_X4_T(R, BASE, OFF)                                                                 \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"           \
               : "=r"((R)[0]), "=r"((R)[1]), "=r"((R)[2]), "=r"((R)[3])                         \
               : "r"((uint)(size_t)((BASE) + (OFF))) : "memory")

#define CP_ASYNC16(DST, SRC)                                                                    \
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"                                      \
               :: "r"((uint)(size_t)(DST)), "l"((ulong)(SRC)) : "memory")

// The same three on a byte address in the shared window (a uint, e.g. (uint)(size_t)p + 16 i):
// callers keep one address per thread and add compile-time byte constants, which ptxas folds
// into the instruction's [R+imm] form (attn_fwd_mma.cl -DLDSM_BYTES=1).
#define LDSM_X4_ADDR(R, ADDR)                                                                   \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"                 \
               : "=r"((R)[0]), "=r"((R)[1]), "=r"((R)[2]), "=r"((R)[3])                         \
               : "r"((uint)(ADDR)) : "memory")
#define LDSM_X4_T_ADDR(R, ADDR)                                                                 \
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"           \
               : "=r"((R)[0]), "=r"((R)[1]), "=r"((R)[2]), "=r"((R)[3])                         \
               : "r"((uint)(ADDR)) : "memory")
#define CP_ASYNC16_ADDR(ADDR, SRC)                                                              \
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"                                      \
               :: "r"((uint)(ADDR)), "l"((ulong)(SRC)) : "memory")
#define CP_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
// wait until at most N (a literal or macro of one) groups are still in flight
#define CP_WAIT(N) asm volatile("cp.async.wait_group " XSTR(N) ";" ::: "memory")
// orders this thread's global writes before (and reads after) at GPU scope (__threadfence)
#define GLOBAL_FENCE() asm volatile("fence.acq_rel.gpu;" ::: "memory")

inline float shfl_xor1(float x) {
  uint r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, 1, 0x1f, 0xffffffff;" : "=r"(r) : "r"(as_uint(x)));
  return as_float(r);
}
inline float shfl_xor2(float x) {
  uint r;
  asm volatile("shfl.sync.bfly.b32 %0, %1, 2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(as_uint(x)));
  return as_float(r);
}
inline int warp_any(int pred) {
  uint r;
  asm volatile("{ .reg .pred p; setp.ne.u32 p, %1, 0; vote.sync.any.pred p, p, 0xffffffff; "
               "selp.u32 %0, 1, 0, p; }" : "=r"(r) : "r"(pred));
  return (int)r;
}
#define WARP_ANY(P) warp_any(P)
// M: the literal 1 or 2 (the lane mask is an immediate of the instruction)
#define SHFL_XOR(X, M) shfl_xor##M(X)

inline float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// two floats -> packed pair, lo in bits 0..15 (PTX cvt puts its first source in the high half)
inline uint pack2(float lo, float hi) {
  uint r;
  asm("cvt.rn." MMA_TYPE "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

#else
// ---------------------------------------------------------------- emulation (any OpenCL device)
#define UNROLL

inline float bits_to_float(uint b) {
#if IS_BF16
  return as_float(b << 16);
#else
  ushort h = (ushort)b;
  return vload_half(0, (const __private half *)&h);
#endif
}

// float -> 16-bit storage, round to nearest even (what cvt.rn does), by integer arithmetic
inline uint f2bits(float x) {
  uint u = as_uint(x);
#if IS_BF16
  if (isnan(x)) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
#else
  uint sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (a >= 0x477ff000u) return sign | 0x7c00u;          // rounds to >= 65520: inf
  if (a < 0x38800000u) {                                  // subnormal half (or zero)
    if (a < 0x33000000u) return sign;
    uint m = (a & 0x7fffffu) | 0x800000u, sh = 126u - (a >> 23);
    uint r = m >> sh, rem = m & ((1u << sh) - 1u), half_ = 1u << (sh - 1u);
    if (rem > half_ || (rem == half_ && (r & 1u))) r++;
    return sign | r;
  }
  uint r = (a - 0x38000000u) >> 13, rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return sign | r;
#endif
}

inline uint pack2(float lo, float hi) { return f2bits(lo) | (f2bits(hi) << 16); }
inline float ex2(float x) { return exp2(x); }

// A (16x16, row-major): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
inline float emu_a(__local uint *scr, int row, int k) {
  int reg = ((k >> 3) << 1) | (row >> 3);
  int ln = ((row & 7) << 2) | ((k & 7) >> 1);
  return bits_to_float((scr[ln * 8 + reg] >> ((k & 1) * 16)) & 0xffffu);
}
// B (16x8, column-major): b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
inline float emu_b(__local uint *scr, int k, int n) {
  int reg = 4 + (k >> 3);
  int ln = (n << 2) | ((k & 7) >> 1);
  return bits_to_float((scr[ln * 8 + reg] >> ((k & 1) * 16)) & 0xffffu);
}

// Every lane publishes its A fragment (4 registers) and B pair in the warp's scratch area,
// slots lane * 8 + 0..5, between two barriers; then any lane reads any lane's operands (the mma
// emulations here and in attn_fwd_mma_tf32.h).  Returns the lane.
inline int emu_publish(const uint *a, uint b0, uint b1, __local uint *scr) {
  int lane = get_local_id(0) & 31;
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int r = 0; r < 4; r++) scr[lane * 8 + r] = a[r];
  scr[lane * 8 + 4] = b0;
  scr[lane * 8 + 5] = b1;
  barrier(CLK_LOCAL_MEM_FENCE);
  return lane;
}

// D (16x8 f32): d0 (g, 2t), d1 (g, 2t+1), d2 (g+8, 2t), d3 (g+8, 2t+1)
inline void emu_mma(float *d, const uint *a, uint b0, uint b1, __local uint *scr) {
  int lane = emu_publish(a, b0, b1, scr);
  int g = lane >> 2, t = lane & 3;
  for (int c = 0; c < 4; c++) {
    int row = g + ((c >> 1) << 3), col = 2 * t + (c & 1);
    float acc = d[c];
    for (int kk = 0; kk < 16; kk++) acc += emu_a(scr, row, kk) * emu_b(scr, kk, col);
    d[c] = acc;
  }
}
#define MMA(D, A, B0, B1) emu_mma((D), (A), (B0), (B1), scr)

// ldmatrix x4: lanes 8i..8i+7 give the row addresses of matrix i; lane l receives from matrix i
// row l/4, columns 2(l%4), 2(l%4)+1 (with .trans: rows 2(l%4), 2(l%4)+1 of column l/4).
inline void emu_ldsm(uint *r, __local const ushort *base, int off, int trans, __local uint *scr) {
  int lane = get_local_id(0) & 31;
  barrier(CLK_LOCAL_MEM_FENCE);
  scr[lane * 8] = (uint)off;
  barrier(CLK_LOCAL_MEM_FENCE);
  int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; i++) {
    uint lo, hi;
    if (!trans) {
      int o = (int)scr[(i * 8 + g) * 8] + 2 * t;
      lo = base[o];
      hi = base[o + 1];
    } else {
      lo = base[(int)scr[(i * 8 + 2 * t) * 8] + g];
      hi = base[(int)scr[(i * 8 + 2 * t + 1) * 8] + g];
    }
    r[i] = lo | (hi << 16);
  }
}
#define LDSM_X4(R, BASE, OFF) emu_ldsm((R), (BASE), (OFF), 0, scr)
#define LDSM_X4_T(R, BASE, OFF) emu_ldsm((R), (BASE), (OFF), 1, scr)

inline float emu_shfl(float x, int m, __local uint *scr) {
  int lane = get_local_id(0) & 31;
  barrier(CLK_LOCAL_MEM_FENCE);
  scr[lane * 8] = as_uint(x);
  barrier(CLK_LOCAL_MEM_FENCE);
  return as_float(scr[(lane ^ m) * 8]);
}
inline int emu_any(int pred, __local uint *scr) {
  int lane = get_local_id(0) & 31, r = 0;
  barrier(CLK_LOCAL_MEM_FENCE);
  scr[lane * 8] = (uint)(pred != 0);
  barrier(CLK_LOCAL_MEM_FENCE);
  for (int i = 0; i < 32; i++) r |= (int)scr[i * 8];
  return r;
}
#define WARP_ANY(P) emu_any((P), scr)
#define SHFL_XOR(X, M) emu_shfl((X), (M), scr)

// cp.async as a plain copy: the kernel's barrier after CP_WAIT makes it visible
#define CP_ASYNC16(DST, SRC) (*(__local uint4 *)(DST) = *(__global const uint4 *)(SRC))
#define CP_COMMIT()
#define CP_WAIT(N)
#define GLOBAL_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#endif

// ---------------------------------------------------------------- shared by the kernels
// Lazy rescaling: (l, O) are rescaled only when a row's running max grows by more than this
// (log2 units).
#define RESCALE_THRESH 8.0f

#define ZERO16(DST) (*(__local uint4 *)(DST) = (uint4)(0u, 0u, 0u, 0u))

// inf/NaN in a 16-bit value (exponent all ones), in either half of a 32-bit word
#if IS_BF16
#define EXP16 0x7f80u
#define MANT16 0x007fu
#else
#define EXP16 0x7c00u
#define MANT16 0x03ffu
#endif
#define NONFINITE16(B) (((B) & EXP16) == EXP16)
#define NONFINITE2(W) (NONFINITE16(W) || NONFINITE16((W) >> 16))
inline float nonfinite_value(uint b) {
  return (b & MANT16) ? NAN : ((b & 0x8000u) ? -INFINITY : INFINITY);
}
// Hidden keys whose v holds inf/NaN (the mma would multiply P = 0 by them): zero the non-finite
// halves of the staged 16-bit V tile at VT (BLOCK_N rows of CHUNKS 16-byte chunks, LD_ halves
// apart) and set v_bad for the whole work-group when any was found (v_flag = t + 1: a new value
// per tile, never reset); the kernel adds them back after P V to the rows that see their keys.
// Work-group uniform; uses the kernel's tid, THREADS, BLOCK_N, CHUNKS, t, v_flag and v_bad.
#define SCAN_HIDDEN_V16(VT, LD_)                                                                \
  {                                                                                             \
    int mine_ = 0;                                                                              \
    for (int c_ = tid; c_ < BLOCK_N * SCAN_CHUNKS; c_ += THREADS) {                             \
      __local ushort *pv_ = (VT) + (c_ / SCAN_CHUNKS) * (LD_) + (c_ % SCAN_CHUNKS) * 8;         \
      const uint4 w_ = *(__local const uint4 *)pv_;                                             \
      if (NONFINITE2(w_.x) || NONFINITE2(w_.y) || NONFINITE2(w_.z) || NONFINITE2(w_.w)) {       \
        for (int e_ = 0; e_ < 8; e_++) {                                                        \
          if (NONFINITE16((uint)pv_[e_])) pv_[e_] = 0;                                          \
        }                                                                                       \
        mine_ = 1;                                                                              \
      }                                                                                         \
    }                                                                                           \
    if (mine_) v_flag = t + 1;                                                                  \
    SCAN_FENCE()                                                                                \
    barrier(CLK_LOCAL_MEM_FENCE);                                                               \
    v_bad = v_flag == t + 1;                                                                    \
  }
// chunks per V row the scan reads (attn_fwd_mma.cl: V's own, fewer than its load loops' slots)
#ifndef SCAN_CHUNKS
#define SCAN_CHUNKS CHUNKS
#endif
// what a kernel runs between its scan's writes and the barrier (attn_fwd_wgmma.cl: the fence
// that shows them to wgmma's reads); nothing by default
#ifndef SCAN_FENCE
#define SCAN_FENCE()
#endif

// One sequence's row of the kernels' seqs table (SEQ_FIELDS longs, in the order the host
// writes them: _nvidia_mma._tables): query batch and first row, query rows, key batch and first
// row, keys, then the mask's base and its diagonal bounds (see row_lo / row_hi).
#define SEQ_FIELDS 9
#define LOAD_SEQ(SP)                                                                            \
  const long qb = SP[0], qrow0 = SP[1];                                                         \
  const int qlen = (int)SP[2];                                                                  \
  const long kb = SP[3], krow0 = SP[4];                                                         \
  const int klen = (int)SP[5];                                                                  \
  const long base = SP[6], dlo = SP[7], dhi = SP[8];

// The two prefill kernels (attn_fwd_mma.cl, attn_fwd_wgmma.cl): their parameters (the host's
// _nvidia_mma.run sets them), the work-group's query head h, kv head hk, sequence s and first
// local row m0 (from the tile table; HEADS_INNER: one grid dimension, tile * n_heads + head),
// the sequence's row of seqs and the block's rows, and the keys the block sees: lo_blk..hi_blk
// (union over its rows), lo_all..hi_all (seen by every row), key tiles t_first..t_last.
#define PREFILL_PARAMS                                                                          \
  __global const ELEM *q, __global const ELEM *k, __global const ELEM *v, __global ELEM *out,   \
      __global float *lse, __global const int *tiles, __global const long *seqs,                \
      __global const float *sinks, __global const float *alibi, const long q_off,               \
      const long q_sb, const long q_sr, const long q_sh, const long k_off, const long k_sb,     \
      const long k_sr, const long k_sh, const long v_off, const long v_sb, const long v_sr,     \
      const long v_sh, const int sq_arr, const int n_heads, const int group, const int ring,    \
      const float qk_scale, const float cap, const int n_sinks,                                  \
      __global const MASK_T *mask, const long m_off, const long m_s0, const long m_s1,          \
      const long m_s2, const long m_s3
#if HEADS_INNER
#define PREFILL_BLOCK_ID                                                                        \
  const int h = get_group_id(0) % n_heads, hk = h / group, wg = get_group_id(0) / n_heads;      \
  const int s = tiles[2 * wg], m0 = tiles[2 * wg + 1];
#else
#define PREFILL_BLOCK_ID                                                                        \
  const int h = get_group_id(1), hk = h / group;                                                \
  const int s = tiles[2 * get_group_id(0)], m0 = tiles[2 * get_group_id(0) + 1];
#endif
#define PREFILL_ROWS                                                                            \
  __global const long *sp = seqs + (long)s * SEQ_FIELDS;                                        \
  LOAD_SEQ(sp)                                                                                  \
  const int nrows = min(BLOCK_M, qlen - m0);
// (PREFILL_KEY_BOUNDS: the key bounds alone, for a kernel that narrows the tiles further)
#define PREFILL_KEY_BOUNDS                                                                      \
  const int lo_blk = row_lo(m0, base, dlo, klen), hi_blk = row_hi(m0 + nrows - 1, base, dhi, klen); \
  const int lo_all = row_lo(m0 + nrows - 1, base, dlo, klen), hi_all = row_hi(m0, base, dhi, klen);
#define PREFILL_KEY_RANGE                                                                       \
  PREFILL_KEY_BOUNDS                                                                            \
  const int t_first = lo_blk / BLOCK_N;                                                         \
  const int t_last = hi_blk >= lo_blk ? hi_blk / BLOCK_N : t_first - 1;

// Visible key range of local query row i: [i + base + dlo, i + base + dhi] within [0, klen).
inline int row_lo(long i, long base, long dlo, int klen) {
  return (int)clamp(i + base + dlo, 0L, (long)klen);
}
inline int row_hi(long i, long base, long dhi, int klen) {
  return (int)clamp(i + base + dhi, -1L, (long)klen - 1);
}

// Paged K/V pools (-DPAGE_SIZE > 0; attn_decode_mma.cl and attn_fwd_mma.cl): k and v are page
// pools (num_pages, PAGE_SIZE, Hkv, D) (batch stride = page stride) and logical key row r of
// sequence s lives in page block_table[s, r / PAGE_SIZE], slot r % PAGE_SIZE (vLLM /
// FlashInfer, as attn_fwd.cl).  A key tile's table entries (at most NPG) are staged in local
// memory (the kernel's sPg) by 4-byte cp.async ahead of its K/V loads; page indices are clamped
// into [0, n_pages) and table columns into [0, tbl_w): no table, however wrong, makes a kernel
// read outside the pool.  Uses the kernel's tid, THREADS, BLOCK_N, krow0, tbl and sPg.
#ifndef PAGE_SIZE
#define PAGE_SIZE 0
#endif
#if PAGE_SIZE
#define NPG ((BLOCK_N - 1) / PAGE_SIZE + 2)  // table entries one tile can span
#define PAGED_PARAMS                                                                           \
  , __global const int *block_table, const long tbl_off, const long tbl_s0, const long tbl_s1, \
      const int tbl_w, const int n_pages
#if USE_PTX
#define CP_ASYNC4(DST, SRC)                                                                    \
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;"                                      \
               :: "r"((uint)(size_t)(DST)), "l"((ulong)(SRC)) : "memory")
#else
#define CP_ASYNC4(DST, SRC) (*(DST) = *(SRC))
#endif
// the first table column of tile TL; its entries copied into slot SLOT of sPg
#define PG_FIRST(TL) ((krow0 + (long)(TL) * BLOCK_N) / PAGE_SIZE)
#define FETCH_PAGES(TL, SLOT)                                                                  \
  for (int e = tid; e < NPG; e += THREADS) {                                                   \
    const long col = min(PG_FIRST(TL) + e, (long)(tbl_w - 1));                                 \
    CP_ASYNC4(sPg + (SLOT) * NPG + e, tbl + col * tbl_s1);                                     \
  }
#else
#define PAGED_PARAMS
#endif
