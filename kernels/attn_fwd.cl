/* attnlib: tiled attention forward pass with online softmax (FlashAttention-2, Dao 2023, alg. 1).
 *
 * One work-group = one query block of BLOCK_M *packed* rows x one kv head x one key split.
 * Packed row m = i * group + g is query row i of query head hk * group + g (GQA packing: the query
 * heads that share a kv head share every K/V tile). K and V tiles of BLOCK_N keys are staged in
 * __local memory; work-item (tm, tn) owns a TM x TN micro-tile of scores (rows tm + THREADS_M*r,
 * keys tn + THREADS_N*c) and a TM x DV_PER tile of the output accumulator (columns DV_COL(c)).
 *
 * Sequences are described by desc[9 * s + 0..8] = q_batch, q_row0, q_len, k_batch, k_row0, k_len,
 * q_pos0, k_pos0, causal_hi (INT_MAX = not causal); desc[9 * n_seq + 2 * t + 0..1] = (sequence,
 * first packed row) of work-group column t. With SPLIT=1 the keys of a block are cut into
 * get_num_groups(2) splits (flash-decoding) and each writes a partial state (out, lse) in acc_t,
 * merged by merge.cl.
 *
 * Storage kinds: 0 float, 1 half (vload_half, no cl_khr_fp16 needed), 2 bfloat16 (ushort,
 * widened by shifting), 3 double. Math in float (ACC_KIND 0) or double (ACC_KIND 1).
 *
 * Vector paths (chosen on the host): D_VEC=4 reads Q and K from __local as 4-vectors along the head
 * dim (HEAD_DIM % 4 == 0); V_VEC=4 gives each work-item output columns in 4-wide chunks
 * interleaved across work-items, read as 4-vectors; LOAD_VEC=1 loads global rows with vload4
 * (unit stride along the head dims). P is always read 4 keys at a time (BLOCK_N % 4 == 0).
 * PAGE_SIZE > 0: k and v are page pools (num_pages, PAGE_SIZE, Hkv, D) (batch stride = page
 * stride) and logical key row r of sequence s lives in page block_table[s, r / PAGE_SIZE], slot
 * r % PAGE_SIZE (vLLM / FlashInfer); page indices are clamped into [0, n_pages) and the table
 * column into [0, tbl_w), so no table, however wrong, makes a work-item read outside the pool.
 * Attention sinks (n_sinks > 0, a run-time argument: no build of its own): sinks[h] (float, one
 * per query head) joins each row's softmax denominator in the epilogue, as the state (out 0,
 * lse sink) merged once: l' = l e^(m - m') + e^(sink - m') with m' = max(m, sink); a row that saw
 * no key gives out 0, lse sink. With SPLIT the partial states hold no sink: merge.cl folds it in.
 * TREE_MAX=1 reduces the
 * per-tile row max over the THREADS_N items of a row in log2(THREADS_N) halving steps (wide decode
 * tilings), instead of every item reading all THREADS_N partial maxima. STAGE: global loads per
 * work-item issued before their __local stores when staging a tile.
 *
 * KV_FORMAT > 0 (kv_format.h: 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8; a load variant, contract §10):
 * k and v hold 8-bit codes (uchar) and k_scl / v_scl one float scale per (row, kv head), strides
 * (ks_sb, ks_ss, ks_sh) along batch (or page), row (or slot), head; each element is dequantized
 * to scale * kv_decode(code) as its tile is staged into __local (as acc_t), so the math below is
 * unchanged and nothing dequantizes the cache as a whole. Needs the scalar staging (LOAD_VEC,
 * CPU_VEC and CP_ASYNC off). q and out keep STORE_KIND.
 *
 * CPU_VEC=8 (chosen on the host for CPU devices only: float32, one work-item per work-group, D,
 * Dv and BLOCK_N multiples of 8): the work-item is the whole block, so it computes S = Q K^T and
 * O += P V as register-blocked outer products of float8 vectors (K staged transposed in __local,
 * so consecutive keys are one vector) and the exponentials a vector at a time. Not float16: PoCL
 * 3.0 (LLVM 14) on an AVX-512 CPU its LLVM cannot name (AMD Zen 4) compiles the kernel for an
 * older CPU without AVX-512 but links its AVX-512 builtin library, and a 512-bit vector passed to
 * a builtin (exp) then crosses that ABI mismatch and crashes. Everything else (staging of Q and V,
 * masking, the online softmax, the epilogue) is the code every device runs.
 */
#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef HEAD_DIM_V
#error "HEAD_DIM_V must be defined"
#endif
#if !defined(BLOCK_M) || !defined(BLOCK_N) || !defined(THREADS_M) || !defined(THREADS_N)
#error "BLOCK_M, BLOCK_N, THREADS_M and THREADS_N must be defined"
#endif
#if !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(MASK_KIND)
#error "STORE_KIND, ACC_KIND and MASK_KIND must be defined"
#endif
#if !defined(HAS_ALIBI) || !defined(HAS_SOFTCAP) || !defined(SPLIT)
#error "HAS_ALIBI, HAS_SOFTCAP and SPLIT must be defined"
#endif
#if !defined(D_VEC) || !defined(V_VEC) || !defined(LOAD_VEC)
#error "D_VEC, V_VEC and LOAD_VEC must be defined"
#endif
#ifndef TREE_MAX
#define TREE_MAX 0
#endif
#ifndef PAGE_SIZE
#define PAGE_SIZE 0
#endif
#if PAGE_SIZE
#define PAGED_ARGS                                                                              \
    , __global const int *block_table, long tbl_off, long tbl_s0, long tbl_s1, int tbl_w,       \
        int n_pages
/* the pool page of logical page p of the sequence whose table row starts at `base` */
inline long paged_page(__global const int *t, long base, long s1, int w, int n_pages, long p) {
    const long x = t[base + min(p, (long)(w - 1)) * s1];
    return clamp(x, 0L, (long)(n_pages - 1));
}
/* element offset of logical key row ROW in a pool with page stride SB and slot stride SS */
#define KV_ROW(ROW, SB, SS)                                                                     \
    (paged_page(block_table, tbl_off + seq * tbl_s0, tbl_s1, tbl_w, n_pages,                    \
                (ROW) / PAGE_SIZE) * (SB) + ((ROW) % PAGE_SIZE) * (SS))
#else
#define PAGED_ARGS
#define KV_ROW(ROW, SB, SS) (kb * (SB) + (ROW) * (SS))
#endif
#ifndef CP_ASYNC
#define CP_ASYNC 0
#endif
#ifndef KV_FORMAT
#define KV_FORMAT 0
#endif
#if KV_FORMAT && (LOAD_VEC || CP_ASYNC || (defined(CPU_VEC) && CPU_VEC))
#error "KV_FORMAT (8-bit K/V) needs the scalar staging: LOAD_VEC, CPU_VEC and CP_ASYNC off"
#endif
#ifndef CPU_VEC
#define CPU_VEC 0
#endif
#if CPU_VEC && (CPU_VEC != 8 || THREADS_M != 1 || THREADS_N != 1 ||          \
                STORE_KIND != 0 || ACC_KIND || HEAD_DIM % CPU_VEC || HEAD_DIM_V % CPU_VEC ||      \
                BLOCK_N % CPU_VEC || V_VEC != 4)
#error "CPU_VEC (8) needs one work-item per work-group, float32, D, Dv, BLOCK_N multiples"
#endif
#ifndef CP_ASYNC_EMULATE
#define CP_ASYNC_EMULATE 0
#endif
#if CP_ASYNC && (!LOAD_VEC || STORE_KIND == 3 || ACC_KIND)
#error "CP_ASYNC needs LOAD_VEC and float/half/bfloat16 storage"
#endif
#if TREE_MAX && (THREADS_N & (THREADS_N - 1))
#error "TREE_MAX needs THREADS_N to be a power of two"
#endif
#if (BLOCK_M % THREADS_M) || (BLOCK_N % THREADS_N) || (BLOCK_N % 4)
#error "BLOCK_M, BLOCK_N must be multiples of THREADS_M, THREADS_N; BLOCK_N of 4"
#endif
#if (D_VEC == 4 && HEAD_DIM % 4) || (LOAD_VEC && (D_VEC != 4 || HEAD_DIM_V % 4))
#error "D_VEC=4 needs HEAD_DIM % 4 == 0; LOAD_VEC needs D_VEC=4 and HEAD_DIM_V % 4 == 0"
#endif

#include "storage.h"
/* the score transform (score.h) in natural units, and the epilogue */
#define SCORE_T acc_t
#define SCORE_LOG2 0
#define SCORE_SOFTCAP HAS_SOFTCAP
#define SCORE_ALIBI HAS_ALIBI
#include "score.h"
#include "epilogue.h"

#if KV_FORMAT
#include "kv_format.h"
typedef uchar kvs_t; /* K and V as stored in global memory */
#define KV_ARGS                                                                                 \
    , __global const float *k_scl, long ks_off, long ks_sb, long ks_ss, long ks_sh,             \
        __global const float *v_scl, long vs_off, long vs_sb, long vs_ss, long vs_sh
#define KSCL_ARGS k_scl, ks_off, ks_sb, ks_ss, ks_sh
#define VSCL_ARGS v_scl, vs_off, vs_sb, vs_ss, vs_sh
#else
typedef store_t kvs_t;
#define KV_ARGS
#define KSCL_ARGS 0, 0, 0, 0, 0
#define VSCL_ARGS 0, 0, 0, 0, 0
#endif

/* K/V tiles in __local: 16-bit storage is staged raw (half or bfloat16 bits: half the __local
 * memory and load registers) and widened when read; other storage (and 8-bit codes, dequantized
 * as staged) as acc_t. */
#if (STORE_KIND == 1 || STORE_KIND == 2) && !KV_FORMAT
typedef ushort kv_t;
typedef ushort4 kv4_t;
#define G_RAW(p, i) (((__global const ushort *)(p))[i])
#define G_RAW4(p, i) vload4(0, ((__global const ushort *)(p)) + (i))
#if STORE_KIND == 1
#define KV(p, i) ((acc_t)vload_half((size_t)(i), (__local const half *)(p)))
#define KV4(p, i4) vload_half4((size_t)(i4), (__local const half *)(p))
#else
#define KV(p, i) ((acc_t)as_float((uint)(p)[i] << 16))
#define KV4(p, i4) as_float4(convert_uint4(vload4((size_t)(i4), (p))) << 16)
#endif
#else
typedef acc_t kv_t;
typedef acc4_t kv4_t;
#define G_RAW(p, i) LD(p, i)
#define G_RAW4(p, i) LD4(p, i)
#define KV(p, i) ((p)[i])
#define KV4(p, i4) (((__local const acc4_t *)(p))[i4])
#endif

typedef MASK_T mask_t; /* score.h: uchar (bool) or acc_t (additive, MASK_KIND 2) */

#if SPLIT
typedef acc_t out_t;
#define OUT_ST(p, i, x) ((p)[i] = (x))
#else
typedef store_t out_t;
#define OUT_ST(p, i, x) ST(p, i, x)
#endif

#define TM (BLOCK_M / THREADS_M)
#define TN (BLOCK_N / THREADS_N)
#define NT (THREADS_M * THREADS_N)
#if V_VEC == 4
#define DV_PER (((HEAD_DIM_V + 4 * THREADS_N - 1) / (4 * THREADS_N)) * 4)
#define DV_COL(c) ((((c) / 4) * THREADS_N + tn) * 4 + (c) % 4)
#else
#define DV_PER ((HEAD_DIM_V + THREADS_N - 1) / THREADS_N)
#define DV_COL(c) (tn + THREADS_N * (c))
#endif
#define DV_PAD (DV_PER * THREADS_N)
/* padded leading dimensions: work-items reading different rows at one column hit different banks
 * (D + 1 for scalar reads; D + 4 keeps 4-vectors aligned) */
#define QS_LD (HEAD_DIM + (D_VEC == 4 ? 4 : 1))
#define KS_LD QS_LD
#define VS_LD DV_PAD
#if CPU_VEC
/* vector loads and stores straight from the arrays (PoCL calls vload8 / vstore8 out of line):
 * rows of multiples of CPU_VEC floats, arrays aligned to 64 bytes */
typedef float8 cvec_t;
#define PS_LD BLOCK_N
#define ALIGN8 __attribute__((aligned(64)))
#define L8(p) (*(__local cvec_t *)(p))
#define P8(p) (*(cvec_t *)(p))
#else
#define PS_LD (BLOCK_N + 4)
#define ALIGN8
#endif
#define KV_SIZE ((BLOCK_N * KS_LD) > (BLOCK_N * VS_LD) ? (BLOCK_N * KS_LD) : (BLOCK_N * VS_LD))
#define V4(n) (((n) + 3) / 4)

#if V_VEC == 4
#define V_ROW(n, b)                                                           \
    for (int c4 = 0; c4 < DV_PER / 4; ++c4) {                                 \
        const acc4_t t_ = KV4(v_s, (n) * (VS_LD / 4) + c4 * THREADS_N + tn);   \
        b[4 * c4] = t_.x;                                                     \
        b[4 * c4 + 1] = t_.y;                                                 \
        b[4 * c4 + 2] = t_.z;                                                 \
        b[4 * c4 + 3] = t_.w;                                                 \
    }
#else
#define V_ROW(n, b)                                                           \
    for (int c = 0; c < DV_PER; ++c) b[c] = KV(v_s, (n) * VS_LD + tn + THREADS_N * c);
#endif

/* acc += P V over the staged tile; GUARD=1 skips keys with p == 0 */
#if CPU_VEC
/* CPU_RB rows x Dv in vector accumulators (at most 16 vectors), one V row of the tile at a time */
#define CPU_VB (DV_PER / CPU_VEC)
#define CPU_RB (CPU_VB >= 16 ? 1 : 16 / CPU_VB)
#define PV_TILE(GUARD)                                                        \
    for (int r0 = 0; r0 < TM; r0 += CPU_RB) {                                 \
        cvec_t o_[CPU_RB][CPU_VB];                                            \
        _Pragma("unroll") for (int r = 0; r < CPU_RB; ++r)                    \
            _Pragma("unroll") for (int c = 0; c < CPU_VB; ++c)                \
                o_[r][c] = (r0 + r < TM) ? P8(&acc[r0 + r][CPU_VEC * c]) : 0; \
        for (int n = 0; n < BLOCK_N; ++n) {                                   \
            cvec_t b_[CPU_VB];                                                \
            _Pragma("unroll") for (int c = 0; c < CPU_VB; ++c)                \
                b_[c] = L8(v_s + n * VS_LD + CPU_VEC * c);                    \
            _Pragma("unroll") for (int r = 0; r < CPU_RB; ++r) {              \
                const float p_ = r0 + r < TM ? p_s[(r0 + r) * PS_LD + n] : 0; \
                if (GUARD && p_ == 0) continue;                               \
                _Pragma("unroll") for (int c = 0; c < CPU_VB; ++c)            \
                    o_[r][c] += p_ * b_[c];                                   \
            }                                                                 \
        }                                                                     \
        _Pragma("unroll") for (int r = 0; r < CPU_RB; ++r)                    \
            if (r0 + r < TM)                                                  \
                _Pragma("unroll") for (int c = 0; c < CPU_VB; ++c)            \
                    P8(&acc[r0 + r][CPU_VEC * c]) = o_[r][c];                 \
    }
#else
#define PV_TILE(GUARD)                                                        \
    for (int n4 = 0; n4 < BLOCK_N / 4; ++n4) {                                \
        acc_t pr[TM][4];                                                      \
        for (int r = 0; r < TM; ++r) {                                        \
            const acc4_t t_ = p_s4[(tm + THREADS_M * r) * (PS_LD / 4) + n4];  \
            pr[r][0] = t_.x;                                                  \
            pr[r][1] = t_.y;                                                  \
            pr[r][2] = t_.z;                                                  \
            pr[r][3] = t_.w;                                                  \
        }                                                                     \
        for (int e = 0; e < 4; ++e) {                                         \
            acc_t b[DV_PER];                                                  \
            V_ROW(4 * n4 + e, b)                                              \
            for (int r = 0; r < TM; ++r)                                      \
                for (int c = 0; c < DV_PER; ++c)                              \
                    acc[r][c] += (GUARD && pr[r][e] == 0) ? (acc_t)0 : pr[r][e] * b[c]; \
        }                                                                     \
    }
#endif

/* Tile staging from global to __local. LOAD_REGS issues the loads of chunks BASE + u * NT + lid
 * (u < PER) of a tile of keys from N0 on into registers, STORE_REGS writes them to __local; chunk
 * idx is key idx / COLS4, 4-vector idx % COLS4. Columns at or past VALID4 and keys past k_len are
 * 0. Issuing several loads before their stores keeps many in flight (memory-level parallelism):
 * STAGE_TILE does it STAGE chunks at a time. */
#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))
#ifndef STAGE
#define STAGE 8
#endif
#define LOAD_REGS(REGS, PER, BASE, SRC, S_OFF, S_SB, S_SS, S_SH, COLS4, VALID4, N0)              \
    for (int u_ = 0; u_ < (PER); ++u_) {                                                        \
        const int idx_ = (BASE) + u_ * NT + lid;                                                \
        const int n_ = idx_ / (COLS4), c_ = idx_ % (COLS4);                                     \
        const long j_ = (N0) + n_;                                                              \
        REGS[u_] = 0;                                                                           \
        if (idx_ < BLOCK_N * (COLS4) && j_ < k_len && c_ < (VALID4)) {                          \
            long row_ = k_row0 + j_;                                                            \
            if (ring && row_ >= ring) row_ -= ring;                                             \
            REGS[u_] = G_RAW4(SRC, S_OFF + KV_ROW(row_, S_SB, S_SS) + hk * S_SH + 4 * c_);       \
        }                                                                                       \
    }
#define STORE_REGS(DST4, REGS, PER, BASE, COLS4, DST_LD4)                                       \
    for (int u_ = 0; u_ < (PER); ++u_) {                                                        \
        const int idx_ = (BASE) + u_ * NT + lid;                                                \
        if (idx_ < BLOCK_N * (COLS4))                                                           \
            (DST4)[(idx_ / (COLS4)) * (DST_LD4) + idx_ % (COLS4)] = REGS[u_];                   \
    }
#if CP_ASYNC
/* NVIDIA sm_80+: cp.async copies global -> __local without passing through registers, so a
 * work-item can have its whole share of the tile in flight (with registers it is STAGE chunks:
 * the decode kernel's staging was measured to run one register batch at a time). The host sets
 * CP_ASYNC only there, and only with offsets and strides that keep every chunk aligned. Each
 * tile is waited for where it is staged. */
#if CP_ASYNC_EMULATE /* the same tile walk with plain copies, for PoCL and Oclgrind */
#define CP_ASYNC_KV(DST, SRC) (*(DST) = G_RAW4((SRC), 0))
#define CP_COMMIT()
#define CP_WAIT(N)
#elif STORE_KIND == 0
#define CP_ASYNC_KV(DST, SRC)                                                                   \
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"                                    \
                 :: "r"((uint)(size_t)(DST)), "l"((ulong)(SRC)) : "memory")
#else
#define CP_ASYNC_KV(DST, SRC)                                                                   \
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;"                                     \
                 :: "r"((uint)(size_t)(DST)), "l"((ulong)(SRC)) : "memory")
#endif
#if !CP_ASYNC_EMULATE
#define CP_COMMIT() asm volatile("cp.async.commit_group;" ::: "memory")
#define CP_WAIT(N) asm volatile("cp.async.wait_group " #N ";" ::: "memory")
#endif
#define STAGE_TILE(DST4, SRC, S_OFF, S_SB, S_SS, S_SH, COLS4, VALID4, DST_LD4)                  \
    for (int idx_ = lid; idx_ < BLOCK_N * (COLS4); idx_ += NT) {                                \
        const int n_ = idx_ / (COLS4), c_ = idx_ % (COLS4);                                     \
        const long j_ = n0 + n_;                                                                \
        __local kv4_t *d_ = (DST4) + n_ * (DST_LD4) + c_;                                       \
        if (j_ < k_len && c_ < (VALID4)) {                                                      \
            long row_ = k_row0 + j_;                                                            \
            if (ring && row_ >= ring) row_ -= ring;                                             \
            CP_ASYNC_KV(d_, (SRC) + S_OFF + KV_ROW(row_, S_SB, S_SS) + hk * S_SH + 4 * c_);      \
        } else {                                                                                \
            *d_ = 0;                                                                            \
        }                                                                                       \
    }                                                                                           \
    CP_COMMIT();                                                                                \
    CP_WAIT(0);
#else
#define STAGE_TILE(DST4, SRC, S_OFF, S_SB, S_SS, S_SH, COLS4, VALID4, DST_LD4)                  \
    for (int base_ = 0; base_ < BLOCK_N * (COLS4); base_ += NT * STAGE) {                       \
        kv4_t tmp_[STAGE];                                                                      \
        LOAD_REGS(tmp_, STAGE, base_, SRC, S_OFF, S_SB, S_SS, S_SH, COLS4, VALID4, n0)          \
        STORE_REGS(DST4, tmp_, STAGE, base_, COLS4, DST_LD4)                                    \
    }
#endif

/* max that propagates NaN, as numpy's max does (CPU_VEC: b != b, which PoCL keeps inline where
 * it calls isnan out of line) */
#if CPU_VEC
inline acc_t nan_max(acc_t a, acc_t b) { return (b > a || b != b) ? b : a; }
#else
inline acc_t nan_max(acc_t a, acc_t b) { return (b > a || isnan(b)) ? b : a; }
#endif

/* element i of K or V as staged; KV_FORMAT: the code's value times the scale at sidx */
#if KV_FORMAT
#define G_KV(src, i, scl, sidx) ((acc_t)kv_decode((src)[i]) * (acc_t)(scl)[sidx])
#else
#define G_KV(src, i, scl, sidx) G_RAW(src, i)
#endif

/* -- stage one key tile of K or V (WIDTH columns, the first VALID of them real) into DST with
 * scalar loads; keys past k_len and padding columns are zero. Ring rows wrap at `ring`. SCL,
 * soff, ssb, sss, ssh: the scales of 8-bit K or V (KV_FORMAT; unused otherwise). */
#define STAGE_TILE_SCALAR(DST, src, off, sb, ss, sh, sd, WIDTH, VALID, LD_S, SCL, soff, ssb,   \
                          sss, ssh)                                                            \
    for (int idx = lid; idx < BLOCK_N * (WIDTH); idx += NT) {                                  \
        const int n = idx / (WIDTH), dd = idx % (WIDTH);                                       \
        const long j = n0 + n;                                                                 \
        kv_t x = 0;                                                                            \
        if (j < k_len && dd < (VALID)) {                                                       \
            long row = k_row0 + j;                                                             \
            if (ring && row >= ring) row -= ring;                                              \
            x = G_KV(src, (off) + KV_ROW(row, sb, ss) + hk * (sh) + dd * (sd), SCL,             \
                     (soff) + KV_ROW(row, ssb, sss) + hk * (ssh));                              \
        }                                                                                      \
        (DST)[n * (LD_S) + dd] = x;                                                            \
    }

/* stage K or V into DST: WIDTH columns (the first VALID real) into rows of LD elements */
#if LOAD_VEC
#define STAGE_KV(DST, SRC, OFF, SB, SS, SH, SD, WIDTH, VALID, LD, SCL)                          \
    STAGE_TILE((__local kv4_t *)(DST), SRC, OFF, SB, SS, SH, (WIDTH) / 4, (VALID) / 4, (LD) / 4)
#else
#define STAGE_KV(DST, SRC, OFF, SB, SS, SH, SD, WIDTH, VALID, LD, SCL)                          \
    STAGE_TILE_SCALAR(DST, SRC, OFF, SB, SS, SH, SD, WIDTH, VALID, LD, SCL)
#endif
#define STAGE_K(DST)                                                                         \
    STAGE_KV(DST, k, k_off, k_sb, k_ss, k_sh, k_sd, HEAD_DIM, HEAD_DIM, KS_LD,                 \
             KSCL_ARGS)
#define STAGE_V(DST)                                                                         \
    STAGE_KV(DST, v, v_off, v_sb, v_ss, v_sh, v_sd, DV_PAD, HEAD_DIM_V, VS_LD, VSCL_ARGS)

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attn_fwd(
    __global const store_t *q, long q_off, long q_sb, long q_ss, long q_sh, long q_sd,
    __global const kvs_t *k, long k_off, long k_sb, long k_ss, long k_sh, long k_sd,
    __global const kvs_t *v, long v_off, long v_sb, long v_ss, long v_sh, long v_sd,
    __global const int *desc, int n_seq, int ring, long win_left, long win_right,
    acc_t scale, acc_t softcap, __global const float *alibi,
    __global const mask_t *mask, long m_off, long m_s0, long m_s1, long m_s2, long m_s3,
    __global out_t *out, __global acc_t *lse, int sq_arr, int n_heads, long n_out_rows,
    int group, __global const float *sinks, int n_sinks PAGED_ARGS KV_ARGS) {
    __local acc4_t q_s4[V4(BLOCK_M * QS_LD)] ALIGN8;
    __local kv4_t kv_s4[V4(KV_SIZE)] ALIGN8; /* V is staged over K once S is done */
    __local kv_t *k_s = (__local kv_t *)kv_s4, *v_s = k_s;
    __local acc4_t p_s4[V4(BLOCK_M * PS_LD)] ALIGN8;
    __local acc_t red_s[THREADS_N * BLOCK_M];
    __local acc_t *q_s = (__local acc_t *)q_s4;
    __local acc_t *p_s = (__local acc_t *)p_s4;

    const int lid = get_local_id(0);
    const int tn = lid % THREADS_N;
    const int tm = lid / THREADS_N;
    const int hk = get_group_id(1);
    const int split = get_group_id(2);
    const int n_splits = get_num_groups(2);

    const int seq = desc[9 * n_seq + 2 * get_group_id(0)];
    const int m0 = desc[9 * n_seq + 2 * get_group_id(0) + 1];
    __global const int *d = desc + 9 * seq;
    const int qb = d[0], q_row0 = d[1], q_len = d[2], kb = d[3], k_row0 = d[4], k_len = d[5];
    const long q_pos0 = d[6], k_pos0 = d[7];
    const long causal_hi = d[8] == INT_MAX ? ((long)1 << 40) : (long)d[8];
    /* key visible iff -win_left <= kpos - qpos <= hi_off */
    const long hi_off = min(causal_hi, win_right);
    /* the scores' factor: scale (over the softcap with one: score.h) */
    const acc_t qmul = HAS_SOFTCAP ? scale / softcap : scale;

    const int rows = q_len * group;
    const int m_last = min(m0 + BLOCK_M, rows) - 1;
    const long qpos_lo = q_pos0 + m0 / group;
    const long qpos_hi = q_pos0 + m_last / group;
    /* keys some row of the block sees: [j_lo, j_hi); keys every row sees: [f_lo, f_hi) */
    const long j_lo = max(0L, qpos_lo - win_left - k_pos0);
    const long j_hi = min((long)k_len, qpos_hi + hi_off + 1 - k_pos0);
    const long f_lo = max(0L, qpos_hi - win_left - k_pos0);
    const long f_hi = min((long)k_len, qpos_lo + hi_off + 1 - k_pos0);
    const long n_first = (j_lo / BLOCK_N) * BLOCK_N;
    const long n_tiles = j_hi > n_first ? (j_hi - n_first + BLOCK_N - 1) / BLOCK_N : 0;
    const long per_split = (n_tiles + n_splits - 1) / n_splits;
    const long t_begin = split * per_split;
    const long t_end = min(n_tiles, t_begin + per_split);

    /* -- load the query block once (zeros for padding rows) */
#if LOAD_VEC
    for (int idx = lid; idx < BLOCK_M * (HEAD_DIM / 4); idx += NT) {
        const int mr = idx / (HEAD_DIM / 4), d4 = idx % (HEAD_DIM / 4), m = m0 + mr;
        acc4_t x = 0;
        if (m < rows) {
            const long h = hk * group + m % group;
            x = LD4(q, q_off + qb * q_sb + (long)(q_row0 + m / group) * q_ss + h * q_sh + 4 * d4);
        }
        q_s4[mr * (QS_LD / 4) + d4] = x;
    }
#else
    for (int idx = lid; idx < BLOCK_M * HEAD_DIM; idx += NT) {
        const int mr = idx / HEAD_DIM, dd = idx % HEAD_DIM, m = m0 + mr;
        acc_t x = 0;
        if (m < rows) {
            const long h = hk * group + m % group;
            x = LD(q, q_off + qb * q_sb + (long)(q_row0 + m / group) * q_ss + h * q_sh + dd * q_sd);
        }
        q_s[mr * QS_LD + dd] = x;
    }
#endif

    int row_ok[TM], row_i[TM], row_h[TM];
    long qpos[TM], klo[TM], khi[TM];
    acc_t m_i[TM], l_i[TM], acc[TM][DV_PER] ALIGN8;
    for (int r = 0; r < TM; ++r) {
        const int m = m0 + tm + THREADS_M * r;
        row_ok[r] = m < rows;
        row_i[r] = m / group;
        row_h[r] = hk * group + m % group; /* a valid head on padding rows too */
        qpos[r] = q_pos0 + row_i[r];
        /* the keys the row sees (none for a padding row) */
        klo[r] = max(0L, qpos[r] - k_pos0 - win_left);
        khi[r] = row_ok[r] ? min((long)k_len - 1, qpos[r] - k_pos0 + hi_off) : -1L;
        m_i[r] = NEG_INF;
        l_i[r] = 0;
        for (int c = 0; c < DV_PER; ++c) acc[r][c] = 0;
    }

    for (long t = t_begin; t < t_end; ++t) {
        const long n0 = n_first + t * BLOCK_N;
        const int full = MASK_KIND == 0 && n0 >= f_lo && n0 + BLOCK_N <= f_hi;

        /* -- stage the K tile (keys past k_len read as 0 and are masked below) */
        barrier(CLK_LOCAL_MEM_FENCE);
#if CPU_VEC /* transposed: k_s[dd * BLOCK_N + n] */
        for (int n = 0; n < BLOCK_N; ++n) {
            const long j = n0 + n;
            long row = k_row0 + j;
            if (ring && row >= ring) row -= ring;
            const long base = k_off + KV_ROW(row, k_sb, k_ss) + hk * k_sh;
            for (int dd = 0; dd < HEAD_DIM; ++dd)
                k_s[dd * BLOCK_N + n] = j < k_len ? LD(k, base + dd * (LOAD_VEC ? 1 : k_sd)) : 0;
        }
#else
        STAGE_K(k_s)
#endif
        barrier(CLK_LOCAL_MEM_FENCE);

        /* -- S = Q K^T on the micro-tile */
        acc_t s[TM][TN] ALIGN8;
#if CPU_VEC /* CPU_SRB rows x BLOCK_N keys in vector accumulators (at most 16 vectors) */
#define CPU_KB (BLOCK_N / CPU_VEC)
#define CPU_SRB (CPU_KB >= 16 ? 1 : 16 / CPU_KB)
        for (int r0 = 0; r0 < TM; r0 += CPU_SRB) {
            cvec_t sa[CPU_SRB][CPU_KB];
            _Pragma("unroll") for (int r = 0; r < CPU_SRB; ++r)
                _Pragma("unroll") for (int c = 0; c < CPU_KB; ++c) sa[r][c] = 0;
            for (int dd = 0; dd < HEAD_DIM; ++dd) {
                cvec_t b[CPU_KB];
                _Pragma("unroll") for (int c = 0; c < CPU_KB; ++c)
                    b[c] = L8(k_s + dd * BLOCK_N + CPU_VEC * c);
                _Pragma("unroll") for (int r = 0; r < CPU_SRB; ++r) {
                    const float a = r0 + r < TM ? q_s[(r0 + r) * QS_LD + dd] : 0;
                    _Pragma("unroll") for (int c = 0; c < CPU_KB; ++c) sa[r][c] += a * b[c];
                }
            }
            /* scaled here; the row max too, which is final on a full tile without softcap or
             * ALiBi (the per-score loop below then skips the row) */
            _Pragma("unroll") for (int r = 0; r < CPU_SRB; ++r) {
                if (r0 + r >= TM) break;
                cvec_t mv = NEG_INF;
                _Pragma("unroll") for (int c = 0; c < CPU_KB; ++c) {
                    const cvec_t x = sa[r][c] * qmul;
                    P8(&s[r0 + r][CPU_VEC * c]) = x;
                    mv = (x > mv || x != x) ? x : mv;
                }
                acc_t lanes[CPU_VEC] ALIGN8, m = NEG_INF;
                P8(lanes) = mv;
                for (int u = 0; u < CPU_VEC; ++u) m = nan_max(m, lanes[u]);
                red_s[r0 + r] = m;
            }
        }
#if HAS_SOFTCAP || HAS_ALIBI
        const int cpu_fast = 0;
#else
        const int cpu_fast = full;
#endif
#else
        for (int r = 0; r < TM; ++r)
            for (int c = 0; c < TN; ++c) s[r][c] = 0;
#endif
#if CPU_VEC
#elif D_VEC == 4
        for (int d4 = 0; d4 < HEAD_DIM / 4; ++d4) {
            acc4_t a[TM], b[TN];
            for (int r = 0; r < TM; ++r) a[r] = q_s4[(tm + THREADS_M * r) * (QS_LD / 4) + d4];
            for (int c = 0; c < TN; ++c) b[c] = KV4(k_s, (tn + THREADS_N * c) * (KS_LD / 4) + d4);
            for (int r = 0; r < TM; ++r)
                for (int c = 0; c < TN; ++c) {
                    acc_t t = s[r][c];
                    t += a[r].x * b[c].x;
                    t += a[r].y * b[c].y;
                    t += a[r].z * b[c].z;
                    t += a[r].w * b[c].w;
                    s[r][c] = t;
                }
        }
#else
        for (int dd = 0; dd < HEAD_DIM; ++dd) {
            acc_t a[TM], b[TN];
            for (int r = 0; r < TM; ++r) a[r] = q_s[(tm + THREADS_M * r) * QS_LD + dd];
            for (int c = 0; c < TN; ++c) b[c] = KV(k_s, (tn + THREADS_N * c) * KS_LD + dd);
            for (int r = 0; r < TM; ++r)
                for (int c = 0; c < TN; ++c) s[r][c] += a[r] * b[c];
        }
#endif

        /* -- the score transform (score.h); invisible keys become -inf */
        acc_t mx[TM];
        for (int r = 0; r < TM; ++r) {
#if CPU_VEC
            if (cpu_fast) continue;
#endif
            mx[r] = NEG_INF;
#if HAS_ALIBI
            /* The slope is loaded here, inside the tile loop after its barriers, and not kept in
             * a private variable from before the loop: Intel's CPU OpenCL compiler (2026.2)
             * hoists the negated slope out of the loop and its barrier lowering then keeps that
             * value in a register across the barrier, so every work-item used the slope of the
             * last work-item (or SIMD group) that ran before the barrier. A value loaded after
             * the barrier lives in the same barrier region as its uses. */
            const acc_t slope = (acc_t)alibi[(long)seq * n_heads + row_h[r]];
#endif
            for (int c = 0; c < TN; ++c) {
                const long j = n0 + tn + THREADS_N * c;
                acc_t x = s[r][c]; /* CPU_VEC: scaled in the S pass */
                SCORE_VARIANT(x, CPU_VEC ? (acc_t)1 : qmul, softcap, slope,
                              qpos[r] - k_pos0 - j, j, klo[r], khi[r],
                              mask + m_off + seq * m_s0 + row_h[r] * m_s1 + row_i[r] * m_s2 +
                                  j * m_s3,
                              !full)
                s[r][c] = x;
                mx[r] = nan_max(mx[r], x);
            }
            red_s[tn * BLOCK_M + tm + THREADS_M * r] = mx[r];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#if TREE_MAX /* log2(THREADS_N) halving steps instead of THREADS_N reads per row and item */
        for (int w = THREADS_N / 2; w > 0; w /= 2) {
            if (tn < w)
                for (int r = 0; r < TM; ++r) {
                    const int mr = tm + THREADS_M * r;
                    red_s[tn * BLOCK_M + mr] =
                        nan_max(red_s[tn * BLOCK_M + mr], red_s[(tn + w) * BLOCK_M + mr]);
                }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
#endif

        /* -- online softmax: new row max, rescale l and acc by alpha = exp(m_old - m_new) */
        for (int r = 0; r < TM; ++r) {
            const int mr = tm + THREADS_M * r;
            acc_t mt = m_i[r];
#if TREE_MAX
            mt = nan_max(mt, red_s[mr]);
#else
            for (int u = 0; u < THREADS_N; ++u) mt = nan_max(mt, red_s[u * BLOCK_M + mr]);
#endif
            const int empty = mt == NEG_INF; /* guard: exp(-inf - -inf) would be NaN */
#if CPU_VEC /* an unchanged finite max (the common case) gives alpha = exp(0) = 1: no rescale */
            const int same = m_i[r] - mt == 0;
            if (!same) {
                const acc_t alpha = empty ? (acc_t)1 : exp(m_i[r] - mt);
                l_i[r] *= alpha;
                for (int c = 0; c < DV_PER; ++c) acc[r][c] *= alpha;
            }
            m_i[r] = mt;
#else
            const acc_t alpha = empty ? (acc_t)1 : exp(m_i[r] - mt);
            m_i[r] = mt;
            l_i[r] *= alpha;
            for (int c = 0; c < DV_PER; ++c) acc[r][c] *= alpha;
#endif
#if CPU_VEC /* a vector of exponentials at a time; the lanes' sums added in a fixed order */
            cvec_t l8 = 0;
            for (int c8 = 0; c8 < TN / CPU_VEC; ++c8) {
                const cvec_t p = empty ? (cvec_t)0 : exp(P8(&s[r][CPU_VEC * c8]) - mt);
                l8 += p;
                L8(p_s + mr * PS_LD + CPU_VEC * c8) = p;
            }
            l_i[r] += ((l8.s0 + l8.s1) + (l8.s2 + l8.s3)) + ((l8.s4 + l8.s5) + (l8.s6 + l8.s7));
#else
            for (int c = 0; c < TN; ++c) {
                const acc_t p = empty ? (acc_t)0 : exp(s[r][c] - mt);
                l_i[r] += p;
                p_s[mr * PS_LD + tn + THREADS_N * c] = p;
            }
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* -- stage the V tile over the K tile (padding columns zeroed) */
        STAGE_V(v_s)
        barrier(CLK_LOCAL_MEM_FENCE);

        /* -- O += P V, four keys per step; on partly visible tiles an invisible key (p == 0) is
         *    skipped, never multiplied, so NaN or garbage in its v cannot leak */
        if (full) {
            PV_TILE(0)
        } else {
            PV_TILE(1)
        }
    }

    /* -- epilogue: l = sum of the THREADS_N partial row sums (fixed order: deterministic) */
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < TM; ++r) red_s[tn * BLOCK_M + tm + THREADS_M * r] = l_i[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int r = 0; r < TM; ++r) {
        if (!row_ok[r]) continue;
        const int mr = tm + THREADS_M * r;
        acc_t l = 0;
        for (int u = 0; u < THREADS_N; ++u) l += red_s[u * BLOCK_M + mr];
        const long row = q_row0 + row_i[r];
        const long orow = ((long)qb * sq_arr + row) * n_heads + row_h[r];
#if SPLIT
        const long obase = (split * n_out_rows + orow) * HEAD_DIM_V;
        const long lidx = split * n_out_rows + orow;
#else
        const long obase = orow * HEAD_DIM_V;
        const long lidx = ((long)qb * n_heads + row_h[r]) * sq_arr + row;
#endif
        /* out = acc / l, lse, the sink (never into split partial states): epilogue.h */
        acc_t inv, lse_r;
        EPI_FINISH(0, acc_t, m_i[r], l, !SPLIT && n_sinks, sinks[row_h[r]], inv, lse_r)
        for (int c = 0; c < DV_PER; ++c) {
            const int col = DV_COL(c);
            if (col < HEAD_DIM_V) OUT_ST(out, obase + col, acc[r][c] * inv);
        }
        if (tn == 0) lse[lidx] = lse_r;
    }
}
