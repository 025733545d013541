/* attnlib: merge partial attention states over disjoint key sets (FlashInfer's merge_state,
 * flash-decoding's reduction step).
 *
 * Row r = (b * S + s) * H + h of the output; state i holds out_i[i * o_stride + r * DV + c] and
 * lse_i[i * l_stride + b * l_sb + s * l_ss + h * l_sh]. Then
 *   lse = log sum_i exp(lse_i),  out = sum_i exp(lse_i - lse) out_i,
 * computed around m = max_i lse_i; states with lse = -inf are skipped (their out is never used), so
 * merging only empty states gives (0, -inf). Every other state is multiplied in, also where its
 * weight is NaN or underflows to 0, so NaN / inf from a visible key reaches the result as in
 * one-shot attention (0 * NaN = NaN).
 *
 * Work-groups of WG work-items: CW columns of one row (grid dimension 0 runs over the row's column
 * chunks), the states split over G = WG / CW groups of work-items (state i goes to group i % G),
 * so that a work-item has few states and issues their loads together: the weighted sum is a
 * round trip or two to memory instead of one per UNROLL states (one work-item per column
 * walking all states was several times slower on a GPU, bench/RESULTS.md).
 * Each state's weight exp(lse_i - m) is computed once per work-group into __local (CHUNK states
 * at a time) and shared by its columns; the max and the sum of the weights are reduced in
 * __local in a fixed tree order, and the G partial sums of a column are added in group order, so
 * results are deterministic.
 *
 * IN_KIND: storage kind of the partial outs (0 float, 1 half, 2 bfloat16, 3 double); STORE_KIND:
 * that of the merged out; ACC_KIND: 0 float, 1 double (also the type of every lse). WG: a power of
 * two, the work-group size; G: a power of two dividing it. n_sinks > 0 (a run-time argument):
 * the merged state is merged once more with (out 0, lse sinks[h]) (the attention sinks of
 * split-KV partial states, which hold none): a row whose states are all empty gives out 0,
 * lse sink.
 */
#if !defined(IN_KIND) || !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(WG) || !defined(G)
#error "IN_KIND, STORE_KIND, ACC_KIND, WG and G must be defined"
#endif
#if WG % G
#error "G must divide WG"
#endif
#define CW (WG / G)

#include "storage.h"
#include "epilogue.h"

#define CHUNK 256
#define UNROLL 8
/* the weight recorded for an empty state: exp() is never negative (NaN compares unequal) */
#define EMPTY_W (-1)

inline acc_t nan_max2(acc_t a, acc_t b) { return (b > a || isnan(b)) ? b : a; }

__kernel __attribute__((reqd_work_group_size(WG, 1, 1))) void merge_states(
    __global const in_t *outs, long o_stride, __global const acc_t *lses, long l_stride,
    long l_sb, long l_ss, long l_sh, int n_states, int S, int H, int DV, long n_rows,
    __global store_t *out, __global acc_t *lse_out, __global const float *sinks, int n_sinks) {
    __local acc_t red[WG];
    __local acc_t w_s[CHUNK];
    const long r = get_group_id(1);
    const int lid = get_local_id(0);
    const long b = r / ((long)S * H), s = (r / H) % S, h = r % H;
    const long loff = b * l_sb + s * l_ss + h * l_sh;

    /* -- m = max_i lse_i (NaN propagates), tree-reduced */
    acc_t m = NEG_INF;
    for (int i = lid; i < n_states; i += WG) m = nan_max2(m, lses[i * l_stride + loff]);
    red[lid] = m;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = WG / 2; w > 0; w /= 2) {
        if (lid < w) red[lid] = nan_max2(red[lid], red[lid + w]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    m = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    /* -- sum of the weights exp(lse_i - m); empty states weigh 0, so the sum is 0 exactly when
     *    every state is empty (m = -inf). That case runs the same path as the others and is told
     *    apart at the end: an early return between the barriers (legal, being uniform) was
     *    miscompiled by Intel's CPU OpenCL compiler (2026.2) when it does not vectorise the
     *    kernel (CL_CONFIG_CPU_VECTORIZER_MODE=1): wrong or NaN results for non-empty states. */
    acc_t sum = 0;
    for (int i = lid; i < n_states; i += WG) {
        const acc_t li = lses[i * l_stride + loff];
        sum += li == NEG_INF ? (acc_t)0 : exp(li - m);
    }
    red[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = WG / 2; w > 0; w /= 2) {
        if (lid < w) red[lid] += red[lid + w];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    sum = red[0];

    /* -- out = sum_i w_i out_i / sum: column c of this chunk, states grp, grp + G, ... */
    const int grp = lid / CW;
    const int c = get_group_id(0) * CW + lid % CW;
    acc_t o = 0;
    for (int i0 = 0; i0 < n_states; i0 += CHUNK) {
        const int n = min(CHUNK, n_states - i0);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = lid; i < n; i += WG) {
            const acc_t li = lses[(i0 + i) * l_stride + loff];
            w_s[i] = li == NEG_INF ? (acc_t)EMPTY_W : exp(li - m);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (c < DV) {
            /* UNROLL unconditional loads issued before their FMAs, so that they are in flight
             * together (a load under a branch was issued one state at a time). Every partial
             * state is written by attn_fwd (an empty one as out 0, lse -inf); an empty state
             * (weight EMPTY_W) is dropped by a select, never
             * multiplied, so whatever its out holds cannot leak. */
            int i = grp;
            for (; i + G * (UNROLL - 1) < n; i += G * UNROLL) {
                acc_t x[UNROLL];
                for (int u = 0; u < UNROLL; ++u)
                    x[u] = LD_IN(outs, (i0 + i + G * u) * o_stride + r * DV + c);
                for (int u = 0; u < UNROLL; ++u) {
                    const acc_t wi = w_s[i + G * u];
                    o += wi != EMPTY_W ? wi * x[u] : (acc_t)0;
                }
            }
            for (; i < n; i += G) {
                const acc_t wi = w_s[i];
                if (wi != EMPTY_W) o += wi * LD_IN(outs, (i0 + i) * o_stride + r * DV + c);
            }
        }
    }
#if G > 1 /* the groups' partial sums of each column, added in group order */
    barrier(CLK_LOCAL_MEM_FENCE);
    red[lid] = o;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (grp == 0) {
        for (int g2 = 1; g2 < G; ++g2) o += red[g2 * CW + lid];
    }
#endif
    /* the merged state (m, sum) through the epilogue (epilogue.h): out = o / sum, lse, the
     * sink folded in once; all states empty (sum 0): out 0, lse -inf or the sink */
    acc_t inv, lse_r;
    EPI_FINISH(0, acc_t, m, sum, n_sinks, sinks[h], inv, lse_r)
    if (grp == 0 && c < DV) ST(out, r * DV + c, o * inv);
    if (lid == 0 && get_group_id(0) == 0) lse_out[(b * H + h) * S + s] = lse_r;
}
