// How fast can one work-group stream K/V tiles from L2 into shared memory on NVIDIA sm_90, and
// by which instruction?  The load half of the tensor-core attention kernels without their math:
// work-group g reads every key tile of head g / QBLOCKS of K and V ([SEQ][NH][128] halves, the
// bshd layout: 256-byte rows NH * 256 bytes apart), BLOCK_N rows per tile, into STAGES
// shared-memory buffers, and optionally spins DELAY clocks per tile (the math it would hide
// under).  Bench only (bench/gpu/l2probe.py); not part of the library.
//
// METHOD 1: cp.async.cg 16-byte chunks, lanes 0-7 of a warp on rows 0-7 of one column chunk
//           (the order of attn_fwd_wgmma.cl's no-swizzle layout: 8 lines per warp instruction);
//        2: cp.async.cg, lanes along a row (2 rows per warp instruction, fully coalesced);
//        3: cp.async.bulk (the TMA engine, no tensor map): one 256-byte copy per row, issued by
//           warp 0, completion counted by an mbarrier per stage.
// Shared rows are padded to 272 bytes (the mma.sync kernel's layout).  PAD_KB adds an unused
// shared array, to hold the work-groups per SM at the attention kernels' count.

#define ROWB 256
#define LDSB 272
#define CHUNKS 16
#define TILE_BYTES (BLOCK_N * LDSB)
#ifndef DELAY
#define DELAY 0
#endif
#ifndef PAD_KB
#define PAD_KB 0
#endif

inline ulong clk(void) {
  ulong c;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(c));
  return c;
}

#if METHOD == 3
inline void bar_init(uint a) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
}
inline void bar_expect(uint a, uint bytes) {
  ulong st;
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
               : "=l"(st) : "r"(a), "r"(bytes) : "memory");
}
inline void bar_wait(uint a, uint parity) {
  uint ok;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                 " selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(a), "r"(parity) : "memory");
  } while (!ok);
}
inline void bulk_row(uint dst, __global const ushort *src, uint bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 256, [%2];"
               ::"r"(dst), "l"((ulong)src), "r"(bar) : "memory");
}
#endif

#define CP16(DST, SRC)                                                                         \
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(DST), "l"((ulong)(SRC)) : "memory")

__kernel __attribute__((reqd_work_group_size(THREADS, 1, 1)))
void probe(__global const ushort *k, __global const ushort *v, __global uint *out, int seq, int nh,
           int qblocks) {
  __local uint4 sk[STAGES * TILE_BYTES / 16];
  __local uint4 sv[STAGES * TILE_BYTES / 16];
#if PAD_KB
  __local uint pad[PAD_KB * 256];
#endif
  const int tid = get_local_id(0);
  const int head = get_group_id(0) / qblocks;
  const int ntiles = seq / BLOCK_N;
  const long rs = (long)nh * 128;  // row stride in halves
  __global const ushort *kh = k + head * 128;
  __global const ushort *vh = v + head * 128;
  const uint kbase = (uint)(size_t)sk, vbase = (uint)(size_t)sv;
  uint acc = 0;
#if PAD_KB
  pad[tid] = tid;
#endif

#if METHOD == 3
  __local ulong bars[STAGES];
  const uint bbase = (uint)(size_t)bars;
  if (tid == 0) {
    for (int s = 0; s < STAGES; s++) bar_init(bbase + 8 * s);
  }
  barrier(CLK_LOCAL_MEM_FENCE);
#define ISSUE(T)                                                                               \
  if (tid < 32 && (T) < ntiles) {                                                              \
    const int st_ = (T) % STAGES;                                                              \
    const uint b_ = bbase + 8 * st_;                                                           \
    if (tid == 0) bar_expect(b_, 2 * BLOCK_N * ROWB);                                          \
    asm volatile("bar.warp.sync 0xffffffff;" ::: "memory");                                    \
    for (int r = tid; r < BLOCK_N; r += 32) {                                                  \
      const long row = (long)(T) * BLOCK_N + r;                                                \
      bulk_row(kbase + st_ * TILE_BYTES + r * LDSB, kh + row * rs, b_);                        \
      bulk_row(vbase + st_ * TILE_BYTES + r * LDSB, vh + row * rs, b_);                        \
    }                                                                                          \
  }
#define WAIT_TILE(T) bar_wait(bbase + 8 * ((T) % STAGES), ((T) / STAGES) & 1)
#else
#if METHOD == 1
#define CROW(C) (((C) & 7) + 8 * ((C) / (8 * CHUNKS)))
#define CCOL(C) (((C) >> 3) % CHUNKS)
#else
#define CROW(C) ((C) / CHUNKS)
#define CCOL(C) ((C) % CHUNKS)
#endif
#define ISSUE(T)                                                                               \
  {                                                                                            \
    if ((T) < ntiles) {                                                                        \
      const int st_ = (T) % STAGES;                                                            \
      for (int c = tid; c < BLOCK_N * CHUNKS; c += THREADS) {                                  \
        const int r = CROW(c), ch = CCOL(c);                                                   \
        const long row = (long)(T) * BLOCK_N + r;                                              \
        CP16(kbase + st_ * TILE_BYTES + r * LDSB + ch * 16, kh + row * rs + ch * 8);           \
        CP16(vbase + st_ * TILE_BYTES + r * LDSB + ch * 16, vh + row * rs + ch * 8);           \
      }                                                                                        \
    }                                                                                          \
    asm volatile("cp.async.commit_group;" ::: "memory");                                      \
  }
#define XSTR_(X) #X
#define XSTR(X) XSTR_(X)
#define WAIT_TILE(T) asm volatile("cp.async.wait_group " XSTR(WAITN) ";" ::: "memory")  // WAITN = STAGES - 2
#endif

  for (int s = 0; s < STAGES - 1; s++) ISSUE(s)
  for (int t = 0; t < ntiles; t++) {
    WAIT_TILE(t);
    barrier(CLK_LOCAL_MEM_FENCE);  // tile t visible to all; every thread is done with t - 1
    ISSUE(t + STAGES - 1)
    const int st = t % STAGES;
    const uint4 a = sk[(st * TILE_BYTES + (tid % BLOCK_N) * LDSB) / 16 + tid / BLOCK_N];
    const uint4 b = sv[(st * TILE_BYTES + (tid % BLOCK_N) * LDSB) / 16 + tid / BLOCK_N];
    acc ^= a.x ^ a.w ^ b.y ^ b.z;
#if DELAY
    const ulong c0 = clk();
    while (clk() - c0 < DELAY) {
    }
#endif
  }
#if PAD_KB
  acc ^= pad[(tid + 1) % THREADS];
#endif
  out[get_global_id(0)] = acc;
}
