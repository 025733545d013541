// 3xTF32 pieces of attn_fwd_mma.cl (IS_TF32=1): float32 products on the tf32 tensor cores.
//
// Each float32 operand is split x = hi + lo with hi = tf32(x) (cvt.rna: to 10 mantissa bits,
// nearest, ties away from zero) and lo = tf32(x - hi); then
//   a b ~= a_lo b_hi + a_hi b_lo + a_hi b_hi      (a_lo b_lo, ~2^-22 |a b|, is dropped)
// each term one mma.sync.m16n8k8 .tf32 with float32 accumulators: float32-class accuracy at
// three tensor-core products per product.
// Fragments (g = lane / 4, t = lane % 4): A 16x8 row: a0 (g, t), a1 (g+8, t), a2 (g, t+4),
// a3 (g+8, t+4); B 8x8 col: b0 (k t, n g), b1 (k t+4, n g); C/D as m16n8k16: c0 (g, 2t),
// c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1).
// Included after nv_warp.h (the emulated mma below publishes its operands with emu_publish).

#define NONFINITE32(U) (((U) & 0x7f800000u) == 0x7f800000u)

#if USE_PTX
inline uint tf32_rna(float x) {
  uint r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

#define MMA_TF32(D, A, B0, B1)                                                                  \
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "                                    \
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"                               \
      : "=f"((D)[0]), "=f"((D)[1]), "=f"((D)[2]), "=f"((D)[3])                                  \
      : "r"((A)[0]), "r"((A)[1]), "r"((A)[2]), "r"((A)[3]), "r"(B0), "r"(B1),                  \
        "f"((D)[0]), "f"((D)[1]), "f"((D)[2]), "f"((D)[3]))
#else
// cvt.rna.tf32.f32 by integer arithmetic: half an ulp of tf32 added to the magnitude, the 13 low
// mantissa bits dropped (a carry into the exponent is the correct rounding, up to inf);
// inf and NaN pass unchanged
inline uint tf32_rna(float x) {
  const uint u = as_uint(x);
  return NONFINITE32(u) ? u : (u + 0x1000u) & 0xffffe000u;
}

// the tensor core reads 19 bits of a tf32 operand (sign, exponent, 10 mantissa bits)
inline float tf32_operand(uint b) { return as_float(b & 0xffffe000u); }

// m16n8k8 tf32: the products of tf32 values are exact in float32; they are accumulated in
// float32 onto the accumulator, k in order
inline void emu_mma_tf32(float *d, const uint *a, uint b0, uint b1, __local uint *scr) {
  int lane = emu_publish(a, b0, b1, scr);
  int g = lane >> 2, t = lane & 3;
  for (int c = 0; c < 4; c++) {
    int row = g + ((c >> 1) << 3), col = 2 * t + (c & 1);
    float acc = d[c];
    for (int kk = 0; kk < 8; kk++) {
      // A (row, kk): lane (row % 8) * 4 + kk % 4, register row / 8 + 2 (kk / 4)
      uint ab = scr[(((row & 7) << 2) | (kk & 3)) * 8 + (row >> 3) + ((kk >> 2) << 1)];
      // B (kk, col): lane col * 4 + kk % 4, register b0 or b1 by kk / 4
      uint bb = scr[((col << 2) | (kk & 3)) * 8 + 4 + (kk >> 2)];
      float prod = tf32_operand(ab) * tf32_operand(bb);
      acc = acc + prod;
    }
    d[c] = acc;
  }
}
#define MMA_TF32(D, A, B0, B1) emu_mma_tf32((D), (A), (B0), (B1), scr)
#endif

// How x is split: hi = rna(x), lo = x - hi; the mma reads lo's top 19 bits (truncation), x kept
// to 2^-22 |x| (bench/RESULTS.md compares the other splits)
#define TF32_HI(X) tf32_rna(X)
#define TF32_LO(D) as_uint(D)
#define SPLIT_TF32(X, HI, LO)                                                                   \
  {                                                                                             \
    const float x_ = (X);                                                                       \
    HI = TF32_HI(x_);                                                                           \
    LO = TF32_LO(x_ - as_float(HI));                                                            \
  }
// V holding inf: lo = 0 (inf - inf would turn every product with it into NaN where the exact
// result is +-inf).  Not needed where every V tile is scanned and its inf/NaN zeroed first.
#define SPLIT_TF32_V SPLIT_TF32
