/* attnlib: how the kernels store and load their data, shared by the .cl files in kernels/.
 *
 * STORE_KIND (required): storage of the arrays a kernel reads and writes; IN_KIND (optional): a
 * second storage kind for inputs (merge.cl's partial outputs). 0 float, 1 half, 2 bfloat16 (kept
 * as 16-bit integers: widened by a 16-bit shift, narrowed with round-to-nearest-even), 3 double.
 * ACC_KIND: 0 float, 1 double math (acc_t). LD/ST/LD4 load and store STORE_KIND elements as
 * acc_t; LD_IN loads IN_KIND elements.
 */
#ifndef ATTNLIB_STORAGE_H
#define ATTNLIB_STORAGE_H

#if !defined(STORE_KIND) || !defined(ACC_KIND)
#error "STORE_KIND and ACC_KIND must be defined"
#endif

#if ACC_KIND == 1 || STORE_KIND == 3 || (defined(IN_KIND) && IN_KIND == 3)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
#if ACC_KIND == 1
typedef double acc_t;
typedef double4 acc4_t;
#else
typedef float acc_t;
typedef float4 acc4_t;
#endif

/* float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN */
inline ushort bf16_rne(float f) {
    uint u = as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (ushort)(u >> 16);
}

#if STORE_KIND == 0
typedef float store_t;
#define LD(p, i) ((acc_t)(p)[i])
#define LD4(p, i) vload4(0, (p) + (i))
#define ST(p, i, x) ((p)[i] = (float)(x))
#elif STORE_KIND == 1
typedef half store_t;
#define LD(p, i) ((acc_t)vload_half((size_t)(i), (p)))
#define LD4(p, i) vload_half4(0, (p) + (i))
#define ST(p, i, x) vstore_half_rte((float)(x), (size_t)(i), (p))
#elif STORE_KIND == 2
typedef ushort store_t;
#define LD(p, i) ((acc_t)as_float((uint)(p)[i] << 16))
#define LD4(p, i) as_float4(convert_uint4(vload4(0, (p) + (i))) << 16)
#define ST(p, i, x) ((p)[i] = bf16_rne((float)(x)))
#elif STORE_KIND == 3
typedef double store_t;
#define LD(p, i) ((acc_t)(p)[i])
#define LD4(p, i) vload4(0, (p) + (i))
#define ST(p, i, x) ((p)[i] = (double)(x))
#else
#error "unknown STORE_KIND"
#endif

#ifdef IN_KIND
#if IN_KIND == 0
typedef float in_t;
#define LD_IN(p, i) ((acc_t)(p)[i])
#elif IN_KIND == 1
typedef half in_t;
#define LD_IN(p, i) ((acc_t)vload_half((size_t)(i), (p)))
#elif IN_KIND == 2
typedef ushort in_t;
#define LD_IN(p, i) ((acc_t)as_float((uint)(p)[i] << 16))
#elif IN_KIND == 3
typedef double in_t;
#define LD_IN(p, i) ((acc_t)(p)[i])
#else
#error "unknown IN_KIND"
#endif
#endif

#define NEG_INF (-(acc_t)INFINITY)

#endif /* ATTNLIB_STORAGE_H */
