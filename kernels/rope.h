/* attnlib: the rotation of one element by rotary embedding (Su et al. 2021, RoFormer), shared by
 * rope.cl and kv_quant.cl. Pairs: INTERLEAVED=0 (GPT-NeoX) (t, t + R/2); INTERLEAVED=1 (GPT-J)
 * (2t, 2t + 1). Needs storage.h first (store_t, acc_t, LD).
 */
#ifndef ATTNLIB_ROPE_H
#define ATTNLIB_ROPE_H

#if !defined(ROTATE) || !defined(INTERLEAVED)
#error "ROTATE and INTERLEAVED must be defined"
#endif

#if ROTATE
/* Element d of the row at xb rotated by the (cos, sin) pairs of cs row csr (d < R). */
inline acc_t rotated(__global const store_t *x, long xb, long x_sd, __global const acc_t *cs,
                     long csr, int d, int R) {
#if INTERLEAVED
    const int t = d / 2, first = (d % 2) == 0;
    const acc_t a = LD(x, xb + (2 * t) * x_sd), c = LD(x, xb + (2 * t + 1) * x_sd);
#else
    const int half_r = R / 2, first = d < half_r, t = first ? d : d - half_r;
    const acc_t a = LD(x, xb + t * x_sd), c = LD(x, xb + (t + half_r) * x_sd);
#endif
    const acc_t cs_c = cs[(csr * (R / 2) + t) * 2], cs_s = cs[(csr * (R / 2) + t) * 2 + 1];
    /* (a, c) -> (a cos - c sin, a sin + c cos) */
    return first ? a * cs_c - c * cs_s : a * cs_s + c * cs_c;
}
#endif

/* element d of the row at xb: rotated when d < R, else copied (the calling kernel's cs and R) */
#if ROTATE
#define ROTATED(x, xb, x_sd, csr, d) \
    ((d) < R ? rotated(x, xb, x_sd, cs, csr, d, R) : LD(x, (xb) + (d) * (x_sd)))
#else
#define ROTATED(x, xb, x_sd, csr, d) LD(x, (xb) + (d) * (x_sd))
#endif

#endif /* ATTNLIB_ROPE_H */
