/* attnlib: softmax / logsumexp along one axis, one work-group per row.
 *
 * x is viewed as (outer, n, inner) with element strides (s_o, s_n, s_i); row = o * inner + t.
 * Pass 1 streams the row once keeping an online (max, sum) pair per work-item (Milakov & Gimelshein
 * 2018, "Online normalizer calculation for softmax"); the pairs are combined by a fixed tree in
 * __local memory (deterministic). LOG=1 writes lse[row]; LOG=0 writes exp(x - m) / l to a
 * C-contiguous (outer, n, inner) output. An all -inf row gives zeros / -inf; NaN propagates.
 */
#if !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(WG) || !defined(LOG)
#error "STORE_KIND, ACC_KIND, WG and LOG must be defined"
#endif
#if (WG & (WG - 1)) != 0
#error "WG must be a power of two"
#endif

#include "storage.h"

#if LOG
typedef acc_t out_t;
#else
typedef store_t out_t;
#endif


inline acc_t nan_max(acc_t a, acc_t b) { return (b > a || isnan(b)) ? b : a; }

__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) void softmax_rows(
    __global const store_t *x, long x_off, long s_o, long s_n, long s_i, int n, long inner,
    __global out_t *out) {
    __local acc_t red_m[WG];
    __local acc_t red_l[WG];
    const int lid = get_local_id(0);
    const long row = get_group_id(0);
    const long o = row / inner, t = row % inner;
    const long base = x_off + o * s_o + t * s_i;

    /* -- pass 1: online max and rescaled sum */
    acc_t m = NEG_INF, l = 0;
    for (int j = lid; j < n; j += WG) {
        const acc_t xv = LD(x, base + j * s_n);
        if (xv == NEG_INF) continue; /* contributes exp(-inf) = 0 */
        if (xv > m || isnan(xv)) {
            l = l * exp(m - xv) + 1;
            m = xv;
        } else {
            l += exp(xv - m);
        }
    }
    red_m[lid] = m;
    red_l[lid] = l;
    /* -- combine the pairs: (m, l) = (M, l1 e^(m1-M) + l2 e^(m2-M)), M = max(m1, m2) */
    for (int off = WG / 2; off > 0; off >>= 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < off) {
            const acc_t m1 = red_m[lid], m2 = red_m[lid + off];
            const acc_t mm = nan_max(m1, m2);
            acc_t ll = 0;
            if (mm != NEG_INF) {
                if (m1 != NEG_INF) ll += red_l[lid] * exp(m1 - mm);
                if (m2 != NEG_INF) ll += red_l[lid + off] * exp(m2 - mm);
            }
            red_m[lid] = mm;
            red_l[lid] = ll;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const acc_t mm = red_m[0], ll = red_l[0];
#if LOG
    if (lid == 0) out[row] = mm == NEG_INF ? NEG_INF : mm + log(ll);
#else
    /* -- pass 2: normalise */
    for (int j = lid; j < n; j += WG) {
        const acc_t xv = LD(x, base + j * s_n);
        const acc_t y = mm == NEG_INF ? (acc_t)0 : exp(xv - mm) / ll;
        ST(out, (o * n + j) * inner + t, y);
    }
#endif
}
