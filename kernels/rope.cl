/* attnlib: rotary embedding (Su et al. 2021, RoFormer) fused with a strided copy.
 *
 * rope_copy reads x (B, S, H, D) with element strides, writes y[dst[2b], (dst[2b+1] + s) % cap, h,
 * d] with y's strides (y_sb, y_ss, y_sh, 1): a plain rope writes a fresh (B, S, H, D) array (dst =
 * (b, 0), cap = S); a KV-cache append writes cache row dst[2b] from slot dst[2b+1] on (cap =
 * max_seq_len, so a ring buffer wraps). ROTATE=0 copies only. cs holds (cos, sin) per (b * S + s,
 * pair t), computed on the host in float64 from the absolute positions.
 * rope_append is one decode-step append (with RoPE: ROTATE=1) in one launch (see below).
 * Pairs: INTERLEAVED=0 (GPT-NeoX) (t, t + R/2); INTERLEAVED=1 (GPT-J) (2t, 2t + 1); dims >= R copy.
 */
#if !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(ROTATE) || !defined(INTERLEAVED)
#error "STORE_KIND, ACC_KIND, ROTATE and INTERLEAVED must be defined"
#endif

#include "storage.h"

#include "rope.h"

__kernel void rope_copy(__global const store_t *x, long x_off, long x_sb, long x_ss, long x_sh,
                        long x_sd, __global const acc_t *cs, __global const int *dst, int S,
                        int H, int D, int R, int cap, __global store_t *y, long y_sb, long y_ss,
                        long y_sh) {
    const int d = get_global_id(0), h = get_global_id(1);
    const long bs = get_global_id(2);
    if (d >= D || h >= H) return;
    const long b = bs / S, s = bs % S;
    const long xb = x_off + b * x_sb + s * x_ss + h * x_sh;
#if ROTATE
    const acc_t val = d < R ? rotated(x, xb, x_sd, cs, bs, d, R) : LD(x, xb + d * x_sd);
#else
    const acc_t val = LD(x, xb + d * x_sd);
#endif
    const long slot = ((long)dst[2 * b + 1] + s) % cap;
    ST(y, dst[2 * b] * y_sb + slot * y_ss + h * y_sh + d, val);
}

/* A KV-cache append in one launch over (max(D, DV), HQ + 2 HKV, B S) work items. Heads h < HQ
 * rotate q into qo (B, S, HQ, D), C order: with RoPE, q has as many rows as the new tokens (a
 * decode step), so q row s and new token s share the position start_b + s (HQ = 0: no q). The
 * next HKV rotate the new k into the k cache, the last HKV copy the new v into the v cache (DV
 * dims), both at cache row dst[3b], slot (dst[3b+1] + s) % cap. cs is a table of consecutive
 * positions: position start_b + s is cs row dst[3b+2] + s. ROTATE=0: a plain append (HQ = 0). */
__kernel void rope_append(__global const store_t *q, long q_off, long q_sb, long q_ss, long q_sh,
                          long q_sd, __global const store_t *k, long k_off, long k_sb, long k_ss,
                          long k_sh, long k_sd, __global const store_t *v, long v_off, long v_sb,
                          long v_ss, long v_sh, long v_sd, __global const acc_t *cs,
                          __global const int *dst, int S, int HQ, int HKV, int D, int DV, int R,
                          int cap, __global store_t *qo, __global store_t *kc, long kc_sb,
                          long kc_ss, long kc_sh, __global store_t *vc, long vc_sb, long vc_ss,
                          long vc_sh) {
    const int d = get_global_id(0), h = get_global_id(1);
    const long bs = get_global_id(2);
    const long b = bs / S, s = bs % S;
    if (h < HQ) {
        if (d >= D) return;
        const long xb = q_off + b * q_sb + s * q_ss + h * q_sh;
        ST(qo, (bs * HQ + h) * D + d, ROTATED(q, xb, q_sd, dst[3 * b + 2] + s, d));
        return;
    }
    const long row = dst[3 * b], slot = ((long)dst[3 * b + 1] + s) % cap;
    if (h < HQ + HKV) {
        const int hk = h - HQ;
        if (d >= D) return;
        const long xb = k_off + b * k_sb + s * k_ss + hk * k_sh;
        ST(kc, row * kc_sb + slot * kc_ss + hk * kc_sh + d,
           ROTATED(k, xb, k_sd, dst[3 * b + 2] + s, d));
    } else {
        const int hv = h - HQ - HKV;
        if (d >= DV) return;
        ST(vc, row * vc_sb + slot * vc_ss + hv * vc_sh + d,
           LD(v, v_off + b * v_sb + s * v_ss + hv * v_sh + d * v_sd));
    }
}
