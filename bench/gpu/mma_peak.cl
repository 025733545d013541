// The ceiling of mma.sync.m16n8k16 (f32 accumulate) on the card: every warp keeps CHAINS
// independent accumulator tiles busy with the same A/B fragments, nothing else.
// -D IS_BF16=0|1, -D CHAINS=8
#if IS_BF16
#define MMA_TYPE "bf16"
#else
#define MMA_TYPE "f16"
#endif

__kernel void mma_peak(__global float *out, const int iters) {
  const uint lid = get_local_id(0);
  // small non-zero operands (1.0 +- a few ulps) so the values stay finite and data is not zeros
  uint a[4] = {0x3c003c01u ^ (lid & 7u), 0x3c023c00u, 0x3bff3c00u ^ (lid & 3u), 0x3c003bfeu};
  uint b0 = 0x3c013bffu ^ (lid & 5u), b1 = 0x3bfe3c02u;
#if IS_BF16
  a[0] = 0x3f803f81u ^ (lid & 7u); a[1] = 0x3f823f80u; a[2] = 0x3f7f3f80u; a[3] = 0x3f803f7eu;
  b0 = 0x3f813f7fu; b1 = 0x3f7e3f82u;
#endif
  float acc[CHAINS][4];
#pragma unroll
  for (int c = 0; c < CHAINS; c++) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
  for (int it = 0; it < iters; it++) {
#pragma unroll
    for (int c = 0; c < CHAINS; c++) {
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                   "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                   : "=f"(acc[c][0]), "=f"(acc[c][1]), "=f"(acc[c][2]), "=f"(acc[c][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
                     "f"(acc[c][0]), "f"(acc[c][1]), "f"(acc[c][2]), "f"(acc[c][3]));
    }
  }
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < CHAINS; c++) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  out[get_global_id(0)] = s;
}
