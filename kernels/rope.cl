/* attnlib: rotary embedding (Su et al. 2021, RoFormer) fused with a strided copy.
 *
 * Reads x (B, S, H, D) with element strides, writes y[dst[2b], (dst[2b+1] + s) % cap, h, d] with
 * y's strides (y_sb, y_ss, y_sh, 1): a plain rope writes a fresh (B, S, H, D) array (dst = (b, 0),
 * cap = S); a KV-cache append writes cache row dst[2b] from slot dst[2b+1] on (cap = max_seq_len,
 * so a ring buffer wraps). ROTATE=0 copies only. cs holds (cos, sin) per (b * S + s, pair t),
 * computed on the host in float64 from the absolute positions.
 * Pairs: INTERLEAVED=0 (GPT-NeoX) (t, t + R/2); INTERLEAVED=1 (GPT-J) (2t, 2t + 1); dims >= R copy.
 */
#if !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(ROTATE) || !defined(INTERLEAVED)
#error "STORE_KIND, ACC_KIND, ROTATE and INTERLEAVED must be defined"
#endif

#include "storage.h"

__kernel void rope_copy(__global const store_t *x, long x_off, long x_sb, long x_ss, long x_sh,
                        long x_sd, __global const acc_t *cs, __global const int *dst, int S,
                        int H, int D, int R, int cap, __global store_t *y, long y_sb, long y_ss,
                        long y_sh) {
    const int d = get_global_id(0), h = get_global_id(1);
    const long bs = get_global_id(2);
    if (d >= D || h >= H) return;
    const long b = bs / S, s = bs % S;
    const long xb = x_off + b * x_sb + s * x_ss + h * x_sh;
    acc_t val;
#if ROTATE
    if (d < R) {
#if INTERLEAVED
        const int t = d / 2, first = (d % 2) == 0;
        const acc_t a = LD(x, xb + (2 * t) * x_sd), c = LD(x, xb + (2 * t + 1) * x_sd);
#else
        const int half_r = R / 2, first = d < half_r, t = first ? d : d - half_r;
        const acc_t a = LD(x, xb + t * x_sd), c = LD(x, xb + (t + half_r) * x_sd);
#endif
        const acc_t cs_c = cs[(bs * (R / 2) + t) * 2], cs_s = cs[(bs * (R / 2) + t) * 2 + 1];
        /* (a, c) -> (a cos - c sin, a sin + c cos) */
        val = first ? a * cs_c - c * cs_s : a * cs_s + c * cs_c;
    } else {
        val = LD(x, xb + d * x_sd);
    }
#else
    val = LD(x, xb + d * x_sd);
#endif
    const long slot = ((long)dst[2 * b + 1] + s) % cap;
    ST(y, dst[2 * b] * y_sb + slot * y_ss + h * y_sh + d, val);
}
