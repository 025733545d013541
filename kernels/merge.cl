/* attnlib: merge partial attention states over disjoint key sets (FlashInfer's merge_state,
 * flash-decoding's reduction step).
 *
 * Row r = (b * S + s) * H + h of the output; state i holds out_i[i * o_stride + r * DV + c] and
 * lse_i[i * l_stride + b * l_sb + s * l_ss + h * l_sh]. Then
 *   lse = log sum_i exp(lse_i),  out = sum_i exp(lse_i - lse) out_i,
 * computed around m = max_i lse_i; states with lse = -inf are skipped (their out is never read), so
 * merging only empty states gives (0, -inf). Work-item (c0, r) computes the row's weights once and
 * writes columns c0, c0 + get_global_size(0), ...; the loop order over states is fixed, so results
 * are deterministic.
 *
 * IN_KIND: storage kind of the partial outs (0 float, 1 half, 2 bfloat16, 3 double); STORE_KIND:
 * that of the merged out; ACC_KIND: 0 float, 1 double (also the type of every lse).
 */
#if !defined(IN_KIND) || !defined(STORE_KIND) || !defined(ACC_KIND)
#error "IN_KIND, STORE_KIND and ACC_KIND must be defined"
#endif

#include "storage.h"


/* weights of the first W_CACHE states are kept in registers, later ones are recomputed */
#define W_CACHE 8

__kernel void merge_states(__global const in_t *outs, long o_stride, __global const acc_t *lses,
                           long l_stride, long l_sb, long l_ss, long l_sh, int n_states, int S,
                           int H, int DV, long n_rows, __global store_t *out,
                           __global acc_t *lse_out) {
    const long r = get_global_id(1);
    if (r >= n_rows) return;
    const long b = r / ((long)S * H), s = (r / H) % S, h = r % H;
    const long loff = b * l_sb + s * l_ss + h * l_sh;
    const int c0 = get_global_id(0), c_step = get_global_size(0);

    /* -- m = max_i lse_i (NaN propagates) */
    acc_t m = NEG_INF;
    for (int i = 0; i < n_states; ++i) {
        const acc_t li = lses[i * l_stride + loff];
        m = (li > m || isnan(li)) ? li : m;
    }
    if (m == NEG_INF) {
        for (int c = c0; c < DV; c += c_step) ST(out, r * DV + c, (acc_t)0);
        if (c0 == 0) lse_out[(b * H + h) * S + s] = NEG_INF;
        return;
    }
    /* -- weights exp(lse_i - m) once per row; empty states (w = 0) are skipped, never read */
    acc_t w[W_CACHE];
    acc_t sum = 0;
    for (int i = 0; i < n_states; ++i) {
        const acc_t li = lses[i * l_stride + loff];
        const acc_t wi = li == NEG_INF ? (acc_t)0 : exp(li - m);
        if (i < W_CACHE) w[i] = wi;
        sum += wi;
    }
    /* -- out = sum_i w_i out_i / sum, columns c0, c0 + c_step, ... (coalesced across items) */
    for (int c = c0; c < DV; c += c_step) {
        acc_t o = 0;
        for (int i = 0; i < n_states; ++i) {
            acc_t wi;
            if (i < W_CACHE) {
                wi = w[i];
            } else {
                const acc_t li = lses[i * l_stride + loff];
                wi = li == NEG_INF ? (acc_t)0 : exp(li - m);
            }
            if (wi != 0) o += wi * LD_IN(outs, i * o_stride + r * DV + c);
        }
        ST(out, r * DV + c, o / sum);
    }
    if (c0 == 0) lse_out[(b * H + h) * S + s] = m + log(sum);
}
