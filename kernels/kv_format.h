/* attnlib: 8-bit KV-cache formats (contract §10), shared by the dequantizing loads of attn_fwd.cl
 * and attn_decode_mma.cl and kv_quant.cl's quantizing writes.
 *
 * KV_FORMAT (required): 1 fp8 e4m3fn (bias 7, 3 mantissa bits, no infinities, S.1111.111 NaN),
 * 2 fp8 e5m2 (bias 15, 2 mantissa bits, IEEE-like), 3 int8; stored as uchar. A value is
 * scale * kv_decode(code), one float scale per (token, kv head). kv_decode is exact (every code is
 * a float); kv_encode rounds to the nearest code, ties to even (as ml_dtypes casts and np.rint),
 * after clamping to [-KV_FMAX, KV_FMAX]; NaN gives a NaN code (int8: 0, the scale carries it).
 */
#ifndef ATTNLIB_KV_FORMAT_H
#define ATTNLIB_KV_FORMAT_H

#ifndef KV_FORMAT
#error "KV_FORMAT must be defined"
#endif

#if KV_FORMAT == 1
#define KV_MBITS 3
#define KV_BIAS 7
#define KV_FMAX 448.0f
#define KV_NAN 0x7fu
#elif KV_FORMAT == 2
#define KV_MBITS 2
#define KV_BIAS 15
#define KV_FMAX 57344.0f
#define KV_NAN 0x7eu
#elif KV_FORMAT == 3
#define KV_FMAX 127.0f
#else
#error "unknown KV_FORMAT"
#endif

/* 2**e as a float, for the exponents of normal floats */
#define KV_POW2(e) as_float((uint)((e) + 127) << 23)

inline float kv_decode(uchar c) {
#if KV_FORMAT == 3
    return (float)as_char(c);
#else
    const uint s = ((uint)c & 0x80u) << 24;
    const uint e = ((uint)c >> KV_MBITS) & ((0x80u >> KV_MBITS) - 1u);
    const uint m = (uint)c & ((1u << KV_MBITS) - 1u);
    if (e == 0) /* subnormal: m * 2**(1 - bias - mbits) */
        return as_float(s | as_uint((float)m * KV_POW2(1 - KV_BIAS - KV_MBITS)));
#if KV_FORMAT == 1
    if (e == 15u && m == 7u) return as_float(s | 0x7fc00000u);
#else
    if (e == 31u) return as_float(s | (m ? 0x7fc00000u : 0x7f800000u));
#endif
    return as_float(s | ((e + 127u - KV_BIAS) << 23) | (m << (23 - KV_MBITS)));
#endif
}

inline uchar kv_encode(float x) {
#if KV_FORMAT == 3
    return x != x ? (uchar)0 : as_uchar((char)clamp(rint(x), -127.0f, 127.0f));
#else
    const uint s = (as_uint(x) >> 24) & 0x80u;
    if (x != x) return (uchar)(s | KV_NAN);
    const float a = fmin(fabs(x), KV_FMAX);
    /* the spacing of the codes in a's binade (the subnormal spacing below the smallest normal),
     * then a rounded to a multiple of it: a / q is exact, rint rounds half to even */
    const int e = max((int)((as_uint(a) >> 23) & 0xffu) - 127, 1 - KV_BIAS);
    const float r = rint(a * KV_POW2(KV_MBITS - e)) * KV_POW2(e - KV_MBITS);
    if (r == 0.0f) return (uchar)s;
    const int er = (int)((as_uint(r) >> 23) & 0xffu) - 127;
    if (er < 1 - KV_BIAS) /* subnormal code: r in units of the smallest subnormal */
        return (uchar)(s | (uint)(r * KV_POW2(KV_BIAS + KV_MBITS - 1)));
    return (uchar)(s | ((uint)(er + KV_BIAS) << KV_MBITS) |
                   ((as_uint(r) >> (23 - KV_MBITS)) & ((1u << KV_MBITS) - 1u)));
#endif
}

#endif /* ATTNLIB_KV_FORMAT_H */
