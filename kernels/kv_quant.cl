/* attnlib: writes into quantized KV caches (contract §10; formats in kv_format.h).
 *
 * kv_quant_write is rope.cl's rope_copy for an 8-bit cache: one work-item per (new token, kv
 * head) reads the row x[b, s, h, :] (STORE_KIND, the cache's dtype), rotated at its position
 * (ROTATE=1: cs row b * S + s, as rope_copy), takes scale = absmax / KV_FMAX (NaN if the row holds
 * a NaN), and writes the codes kv_encode(x / scale) (zeros for a zero row) to y[dst[2b], (dst[2b+1]
 * + s) % cap, h, :] and the scale to ys at the same (row, slot, head). A paged write is the same
 * with one token per b: (page, slot) pairs and cap = page_size.
 *
 * kv_copy_pages copies whole pages of bytes within a pool (copy-on-write): page pairs[2i] to page
 * pairs[2i + 1], page_bytes each (the code pools and the scale pools, C order).
 */
#if !defined(STORE_KIND) || !defined(ACC_KIND) || !defined(ROTATE) || !defined(INTERLEAVED)
#error "STORE_KIND, ACC_KIND, ROTATE and INTERLEAVED must be defined"
#endif

#include "storage.h"
#include "kv_format.h"
#include "rope.h"

__kernel void kv_quant_write(__global const store_t *x, long x_off, long x_sb, long x_ss,
                             long x_sh, long x_sd, __global const acc_t *cs,
                             __global const int *dst, int S, int H, int D, int R, int cap,
                             __global uchar *y, long y_sb, long y_ss, long y_sh,
                             __global float *ys, long ys_sb, long ys_ss, long ys_sh) {
    const int h = get_global_id(0);
    const long bs = get_global_id(1);
    if (h >= H) return;
    const long b = bs / S, s = bs % S;
    const long xb = x_off + b * x_sb + s * x_ss + h * x_sh;
    /* -- the row's absmax (after RoPE); a NaN anywhere makes it NaN, as numpy's max */
    float amax = 0.0f;
    for (int d = 0; d < D; ++d) {
        const float a = fabs((float)ROTATED(x, xb, x_sd, bs, d));
        amax = (a > amax || a != a) ? a : amax;
    }
    const float scale = amax / KV_FMAX;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    const long row = dst[2 * b], slot = ((long)dst[2 * b + 1] + s) % cap;
    const long yb = row * y_sb + slot * y_ss + h * y_sh;
    for (int d = 0; d < D; ++d) y[yb + d] = kv_encode((float)ROTATED(x, xb, x_sd, bs, d) * inv);
    ys[row * ys_sb + slot * ys_ss + h * ys_sh] = scale;
}

__kernel void kv_copy_pages(__global uchar *pool, __global const int *pairs, long page_bytes) {
    const long i = get_global_id(0);
    const int p = get_global_id(1);
    if (i >= page_bytes) return;
    pool[pairs[2 * p + 1] * page_bytes + i] = pool[pairs[2 * p] * page_bytes + i];
}
