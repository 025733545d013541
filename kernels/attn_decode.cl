/* attnlib: attention for decoding (few packed query rows), reading K and V straight from global
 * memory (flash-decoding's split-KV layout, FlashInfer's decode kernels: one thread per key for
 * Q K^T, threads across the head dim for P V).
 *
 * Same arguments, descriptor table, positions, options and outputs as attn_fwd.cl (read its
 * header), restricted to what decoding needs: BLOCK_M packed rows (i * group + g) per work-group,
 * at most 8; no mask (MASK_KIND 0); head dims multiples of 4 read with unit stride (4-vectors).
 *
 * Per chunk of NT keys (one per work-item), with no __local staging of K or V:
 *   1. work-item t computes the BLOCK_M scores of key n0 + t from its K row (4-vector loads) and Q
 *      in __local (broadcast reads);
 *   2. the chunk's row max in two levels (16 partial maxima per row, then every item reads them):
 *      two barriers, where attn_fwd.cl's decode tiling needs log2(THREADS_N) of them;
 *   3. p = exp(s - m) to __local; each item keeps its own partial row sums l (reduced once, at the
 *      end, in a fixed order);
 *   4. P V: item (lane, c4) owns output columns 4 c4 .. 4 c4 + 3 and the keys lane, lane + LANES,
 *      ... of the chunk: a warp reads whole V rows (coalesced). The LANES partial outputs are
 *      summed once, at the end, in lane order (deterministic).
 * A key with p == 0 (hidden) is never multiplied, so NaN or garbage in its v cannot leak.
 */
#if !defined(HEAD_DIM) || !defined(HEAD_DIM_V) || !defined(BLOCK_M) || !defined(NT)
#error "HEAD_DIM, HEAD_DIM_V, BLOCK_M and NT must be defined"
#endif
#if !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(HAS_ALIBI) || !defined(HAS_SOFTCAP)
#error "STORE_KIND, ACC_KIND, HAS_ALIBI and HAS_SOFTCAP must be defined"
#endif
#ifndef SPLIT
#error "SPLIT must be defined"
#endif
#if (HEAD_DIM % 4) || (HEAD_DIM_V % 4) || BLOCK_M > 8 || (NT % 16) || (NT & (NT - 1))
#error "needs D, Dv multiples of 4, BLOCK_M <= 8, NT a power of two >= 16"
#endif

#include "storage.h"

#define D4 (HEAD_DIM / 4)
#define DV4 (HEAD_DIM_V / 4)
/* work-items per V row (4 columns each): DV4 rounded up to a power of two, at most NT */
#if DV4 <= 1
#define VS 1
#elif DV4 <= 2
#define VS 2
#elif DV4 <= 4
#define VS 4
#elif DV4 <= 8
#define VS 8
#elif DV4 <= 16
#define VS 16
#elif DV4 <= 32
#define VS 32
#elif DV4 <= 64
#define VS 64
#else
#define VS 128
#endif
#if VS > NT
#error "NT too small for HEAD_DIM_V"
#endif
#define LANES (NT / VS)
#define SEGS 16 /* partial maxima per row */

#if SPLIT
typedef acc_t out_t;
#define OUT_ST(p, i, x) ((p)[i] = (x))
#else
typedef store_t out_t;
#define OUT_ST(p, i, x) ST(p, i, x)
#endif

inline acc_t nan_max(acc_t a, acc_t b) { return (b > a || isnan(b)) ? b : a; }

__kernel __attribute__((reqd_work_group_size(NT, 1, 1))) void attn_decode(
    __global const store_t *q, long q_off, long q_sb, long q_ss, long q_sh, long q_sd,
    __global const store_t *k, long k_off, long k_sb, long k_ss, long k_sh, long k_sd,
    __global const store_t *v, long v_off, long v_sb, long v_ss, long v_sh, long v_sd,
    __global const int *desc, int n_seq, int ring, long win_left, long win_right,
    acc_t scale, acc_t softcap, __global const float *alibi,
    __global const uchar *mask_unused, long m_off, long m_s0, long m_s1, long m_s2, long m_s3,
    __global out_t *out, __global acc_t *lse, int sq_arr, int n_heads, long n_out_rows,
    int group) {
    __local acc4_t q_s[BLOCK_M * D4];
    __local acc_t p_s[BLOCK_M * NT];
    __local acc_t seg_s[BLOCK_M * SEGS];
    __local acc4_t o_s[LANES * BLOCK_M * VS];

    const int lid = get_local_id(0);
    const int hk = get_group_id(1);
    const int split = get_group_id(2);
    const int n_splits = get_num_groups(2);
    const int lane = lid / VS, c4 = lid % VS;

    const int seq = desc[9 * n_seq + 2 * get_group_id(0)];
    const int m0 = desc[9 * n_seq + 2 * get_group_id(0) + 1];
    __global const int *d = desc + 9 * seq;
    const int qb = d[0], q_row0 = d[1], q_len = d[2], kb = d[3], k_row0 = d[4], k_len = d[5];
    const long q_pos0 = d[6], k_pos0 = d[7];
    const long causal_hi = d[8] == INT_MAX ? ((long)1 << 40) : (long)d[8];
    const long hi_off = min(causal_hi, win_right);

    const int rows = q_len * group;
    const int m_last = min(m0 + BLOCK_M, rows) - 1;
    const long qpos_lo = q_pos0 + m0 / group;
    const long qpos_hi = q_pos0 + m_last / group;
    const long j_lo = max(0L, qpos_lo - win_left - k_pos0);
    const long j_hi = min((long)k_len, qpos_hi + hi_off + 1 - k_pos0);
    const long f_lo = max(0L, qpos_hi - win_left - k_pos0);
    const long f_hi = min((long)k_len, qpos_lo + hi_off + 1 - k_pos0);
    const long n_first = (j_lo / NT) * NT;
    const long n_tiles = j_hi > n_first ? (j_hi - n_first + NT - 1) / NT : 0;
    const long per_split = (n_tiles + n_splits - 1) / n_splits;
    const long t_begin = split * per_split;
    const long t_end = min(n_tiles, t_begin + per_split);

    /* -- the query rows of the block, zeros for padding rows */
    for (int idx = lid; idx < BLOCK_M * D4; idx += NT) {
        const int mr = idx / D4, i4 = idx % D4, m = m0 + mr;
        acc4_t x = 0;
        if (m < rows) {
            const long h = hk * group + m % group;
            x = LD4(q, q_off + qb * q_sb + (long)(q_row0 + m / group) * q_ss + h * q_sh + 4 * i4);
        }
        q_s[idx] = x;
    }

    int row_ok[BLOCK_M];
    long qpos[BLOCK_M];
    acc_t slope[BLOCK_M], m_i[BLOCK_M], l_i[BLOCK_M];
    acc4_t acc[BLOCK_M];
    for (int r = 0; r < BLOCK_M; ++r) {
        const int m = m0 + r;
        row_ok[r] = m < rows;
        qpos[r] = q_pos0 + m / group;
#if HAS_ALIBI
        slope[r] = row_ok[r] ? (acc_t)alibi[(long)seq * n_heads + hk * group + m % group] : 0;
#else
        slope[r] = 0;
#endif
        m_i[r] = NEG_INF;
        l_i[r] = 0;
        acc[r] = 0;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (long t = t_begin; t < t_end; ++t) {
        const long n0 = n_first + t * NT;
        const int full = n0 >= f_lo && n0 + NT <= f_hi;

        /* -- 1. scores of key n0 + lid */
        const long j = n0 + lid;
        acc_t s[BLOCK_M];
        for (int r = 0; r < BLOCK_M; ++r) s[r] = 0;
        if (j < k_len) {
            long row = k_row0 + j;
            if (ring && row >= ring) row -= ring;
            __global const store_t *kr = k + k_off + kb * k_sb + row * k_ss + hk * k_sh;
            for (int i4 = 0; i4 < D4; ++i4) {
                const acc4_t kv = LD4(kr, 4 * i4);
                for (int r = 0; r < BLOCK_M; ++r) {
                    const acc4_t qv = q_s[r * D4 + i4];
                    s[r] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
                }
            }
        }
        for (int r = 0; r < BLOCK_M; ++r) {
            acc_t x = s[r] * scale;
#if HAS_SOFTCAP
            x = softcap * tanh(x / softcap);
#endif
#if HAS_ALIBI
            const long dist = k_pos0 + j - qpos[r];
            x -= slope[r] * (acc_t)(dist < 0 ? -dist : dist);
#endif
            if (!full) {
                const long dlt = k_pos0 + j - qpos[r];
                if (!(row_ok[r] && j < k_len && dlt <= hi_off && dlt >= -win_left)) x = NEG_INF;
            }
            s[r] = x;
            p_s[r * NT + lid] = x;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* -- 2. row max of the chunk: SEGS partial maxima per row, then all of them per item */
        for (int idx = lid; idx < BLOCK_M * SEGS; idx += NT) {
            const int r = idx / SEGS, sg = idx % SEGS;
            acc_t mx = NEG_INF;
            for (int u = 0; u < NT / SEGS; ++u) mx = nan_max(mx, p_s[r * NT + sg * (NT / SEGS) + u]);
            seg_s[idx] = mx;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* -- 3. online softmax: rescale by alpha = exp(m_old - m_new); p to __local */
        for (int r = 0; r < BLOCK_M; ++r) {
            acc_t mt = m_i[r];
            for (int sg = 0; sg < SEGS; ++sg) mt = nan_max(mt, seg_s[r * SEGS + sg]);
            const int empty = mt == NEG_INF; /* exp(-inf - -inf) would be NaN */
            const acc_t alpha = empty ? (acc_t)1 : exp(m_i[r] - mt);
            m_i[r] = mt;
            const acc_t p = empty ? (acc_t)0 : exp(s[r] - mt);
            l_i[r] = l_i[r] * alpha + p;
            acc[r] *= alpha;
            p_s[r * NT + lid] = p;
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        /* -- 4. acc += P V over this item's keys and columns */
        if (c4 < DV4) {
            for (int jj = lane; jj < NT; jj += LANES) {
                const long jv = n0 + jj;
                if (jv >= k_len) break;
                acc_t pr[BLOCK_M];
                int any = 0;
                for (int r = 0; r < BLOCK_M; ++r) {
                    pr[r] = p_s[r * NT + jj];
                    any |= pr[r] != 0;
                }
                if (!any) continue;
                long row = k_row0 + jv;
                if (ring && row >= ring) row -= ring;
                const acc4_t vv = LD4(v, v_off + kb * v_sb + row * v_ss + hk * v_sh + 4 * c4);
                for (int r = 0; r < BLOCK_M; ++r)
                    if (pr[r] != 0) acc[r] += pr[r] * vv;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE); /* p_s is overwritten by the next chunk */
    }

    /* -- epilogue: l = sum of the NT partial sums, out = sum of the LANES partial outputs, both in
     *    a fixed order; written by the items of lane 0 (columns) and item 0 (lse) */
    for (int r = 0; r < BLOCK_M; ++r) {
        p_s[r * NT + lid] = l_i[r];
        o_s[(lane * BLOCK_M + r) * VS + c4] = acc[r];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int idx = lid; idx < BLOCK_M * VS; idx += NT) {
        const int r = idx / VS, cc = idx % VS, m = m0 + r;
        if (m >= rows || cc >= DV4) continue;
        acc_t l = 0;
        for (int u = 0; u < NT; ++u) l += p_s[r * NT + u];
        acc4_t o = 0;
        for (int ln = 0; ln < LANES; ++ln) o += o_s[(ln * BLOCK_M + r) * VS + cc];
        const long row = q_row0 + m / group, h = hk * group + m % group;
        const long orow = ((long)qb * sq_arr + row) * n_heads + h;
#if SPLIT
        const long obase = (split * n_out_rows + orow) * HEAD_DIM_V;
        const long lidx = split * n_out_rows + orow;
#else
        const long obase = orow * HEAD_DIM_V;
        const long lidx = ((long)qb * n_heads + h) * sq_arr + row;
#endif
        const acc4_t res = l == 0 ? (acc4_t)0 : o / l;
        OUT_ST(out, obase + 4 * cc, res.x);
        OUT_ST(out, obase + 4 * cc + 1, res.y);
        OUT_ST(out, obase + 4 * cc + 2, res.z);
        OUT_ST(out, obase + 4 * cc + 3, res.w);
        if (cc == 0) lse[lidx] = l == 0 ? NEG_INF : m_i[r] + log(l);
    }
}
