// The key-tile loop of attn_fwd_wgmma.cl: its schedules (WG_PIPE with and without WG_OVERLAP,
// the serial one, WG_OVERLAP), included inside the kernel after the per-tile steps (ISSUE_S,
// SCORES, SOFTMAX_P, RESCALE_O, PACK_P, ISSUE_PV, ADD_BACK_HIDDEN_V) and the buffers, barriers
// and options they use.

#if WG_PIPE
  // the mbarriers of the pipelined schedules: tile j's K and V sit in buffer (j - t_first) % 2,
  // and its use of each barrier completes phase ((j - t_first) / 2) % 2
  const uint mb = SBASE(mbar);
#define FULL_K(B) (mb + 8 * (B))
#define FULL_V(B) (mb + 16 + 8 * (B))
#define EMPTY_K(B) (mb + 32 + 8 * (B))
#define EMPTY_V(B) (mb + 48 + 8 * (B))
  if (tid < 8) MB_INIT(mb + 8 * tid, THREADS);
  barrier(CLK_LOCAL_MEM_FENCE);  // the barriers' init before any arrival
#endif

#if WG_PIPE && WG_OVERLAP
  // ---- FA3's schedule: pass t issues S(t) with P V(t-1) (one ping-pong turn), runs the softmax
  // of S(t) under P V(t-1), and loads K(t+1) and V(t) at its top (V one pass ahead of its use).
  // A thread shows its copies (cp.async wait, proxy fence, FULL arrival) after the softmax,
  // about half a tile after issuing them; it frees a buffer (EMPTY arrival) once its own
  // products have read it. The prologue is pass t_first's S and softmax.
  if (t_first < t_last) { LOAD_K1(t_first + 1, 1) }
  CP_COMMIT();
  CP_WAIT(1);  // Q, K(t_first), V(t_first)
  FENCE_ASYNC_SHARED();
  MB_ARRIVE(FULL_K(0));
  MB_ARRIVE(FULL_V(0));
  TURNS_BEGIN()
  if (t_first <= t_last) {
    MB_WAIT(FULL_K(0), 0)
    IN_TURN(ISSUE_S(0))
    WAIT_S();
    MB_ARRIVE(EMPTY_K(0));
    SCORES(t_first * BLOCK_N, NEED_MASK(t_first * BLOCK_N))
    SOFTMAX_P()
    PACK_P()
    if (t_first < t_last) {  // K(t_first + 1)
      CP_WAIT(0);
      FENCE_ASYNC_SHARED();
      MB_ARRIVE(FULL_K(1));
    }
  }
  for (int t = t_first + 1; t <= t_last + 1; t++) {
    const int i = t - t_first, cur = i & 1, prev = cur ^ 1;
    const int np = (t - 1) * BLOCK_N;  // tile t-1: its P is in pa, its V in buffer prev
    const bool mask_p = NEED_MASK(np);
    if (t + 1 <= t_last) {  // K(t+1) over K(t-1), which every thread's S has read
      MB_WAIT(EMPTY_K(prev), ((i - 1) >> 1) & 1)
      LOAD_K1(t + 1, prev)
    }
    if (t <= t_last) {  // V(t) over V(t-2), which every thread's P V has read
      if (i >= 2) MB_WAIT(EMPTY_V(cur), ((i - 2) >> 1) & 1)
      LOAD_V1(t, cur)
    }
    CP_COMMIT();
    MB_WAIT(FULL_V(prev), ((i - 1) >> 1) & 1)
    int v_bad = 0;  // tile t-1's scan (its flag value t + 1 is new in every pass)
    if (mask_p) SCAN_HIDDEN_V16(sV + prev * BLOCK_N * HEAD_DIM, HEAD_DIM)
    if (t <= t_last) {
      const int n0 = t * BLOCK_N;
      const bool need_mask = NEED_MASK(n0);
      MB_WAIT(FULL_K(cur), (i >> 1) & 1)
      IN_TURN(ISSUE_S(cur) ISSUE_PV(prev))
      WAIT1_S();  // S(t) done, P V(t-1) may still run
      MB_ARRIVE(EMPTY_K(cur));
      SCORES(n0, need_mask)
      SOFTMAX_P()
      CP_WAIT(0);  // this thread's K(t+1) and V(t)
      FENCE_ASYNC_SHARED();
      if (t + 1 <= t_last) MB_ARRIVE(FULL_K(prev));
      MB_ARRIVE(FULL_V(cur));
      WAIT_O();
    } else {
      resc = 0;
      IN_TURN(ISSUE_PV(prev))
      WAIT_O();
    }
    MB_ARRIVE(EMPTY_V(prev));
    {  // O holds tile t-1's P V: its hidden inf/NaN v, then the rescale for tile t's max
      const int n0 = np;
      ADD_BACK_HIDDEN_V()
    }
    RESCALE_O()
    if (t <= t_last) { PACK_P() }
  }
  TURNS_END()
#elif WG_PIPE
  // ---- serial schedule, pipelined through mbarriers (see WG_PIPE): tile i = t - t_first uses
  // buffers b = i % 2; the prologue's tile (Q, K(t_first), V(t_first), buffer 0) is handed over
  // like the others.
  CP_WAIT(0);
  FENCE_ASYNC_SHARED();
  MB_ARRIVE(FULL_K(0));
  MB_ARRIVE(FULL_V(0));
  TURNS_BEGIN()
  for (int t = t_first; t <= t_last; t++) {
    const int i = t - t_first, b = i & 1, nb = b ^ 1;
    const uint ph = (i >> 1) & 1, ph_prev = ((i - 1) >> 1) & 1;
    // K(t+1) into buffer nb once every thread's S read K(t-1) there
    if (t < t_last) {
      if (i >= 1) MB_WAIT(EMPTY_K(nb), ph_prev)
      LOAD_K1(t + 1, nb)
    }
    CP_COMMIT();
    if (i >= 1) {  // V(t), issued in tile t-1: this thread's copies landed (K(t+1) may not have)
      CP_WAIT(1);
      FENCE_ASYNC_SHARED();
      MB_ARRIVE(FULL_V(b));
    }
    MB_WAIT(FULL_K(b), ph)
    const int n0 = t * BLOCK_N;
    const bool need_mask = NEED_MASK(n0);
    IN_TURN(ISSUE_S(b))
    WAIT_S();
    MB_ARRIVE(EMPTY_K(b));
    SCORES(n0, need_mask)
    SOFTMAX_P()
    RESCALE_O()
    PACK_P()
    if (t < t_last) {  // K(t+1) landed: show it; V(t+1) into buffer nb once P V(t-1) read it
      CP_WAIT(0);
      FENCE_ASYNC_SHARED();
      MB_ARRIVE(FULL_K(nb));
      if (i >= 1) MB_WAIT(EMPTY_V(nb), ph_prev)
      LOAD_V1(t + 1, nb)
    }
    CP_COMMIT();
    MB_WAIT(FULL_V(b), ph)
    // hidden keys' inf/NaN v zeroed for the tensor cores (tiles that hide keys only; a
    // work-group barrier inside, on every thread alike)
    int v_bad = 0;
    if (need_mask) SCAN_HIDDEN_V16(sV + b * BLOCK_N * HEAD_DIM, HEAD_DIM)
    IN_TURN(ISSUE_PV(b))
    WAIT_O();
    MB_ARRIVE(EMPTY_V(b));
    ADD_BACK_HIDDEN_V()
  }
  TURNS_END()
#elif !WG_OVERLAP
  // ---- serial schedule: per tile S, wait, softmax, P V, wait; one K/V buffer pair per tile,
  // the next tile's pair loaded under this tile's math.  WG_ABL (timing only, wrong results):
  // bit 0 drops the softmax (P = S), bit 1 the K/V loads after the first tile (every tile
  // reads buffer 0), bit 2 the P V products: what each step costs, by difference
  TURNS_BEGIN()
  for (int t = t_first; t <= t_last; t++) {
    const int buf = (WG_ABL & 2) ? 0 : (t - t_first) & 1;
    // -- tile t (and Q) landed; after the barrier no thread still reads tile t-1's buffer, so
    // the prefetch of tile t+1 into it overlaps this tile's math
    CP_WAIT(0);
    FENCE_ASYNC_SHARED();
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t < t_last && !(WG_ABL & 2)) {
      LOAD_KV(t + 1, buf ^ 1)
      CP_COMMIT();
    }
    const int n0 = t * BLOCK_N;
    const bool need_mask = NEED_MASK(n0);
    // hidden keys' inf/NaN v zeroed for the tensor cores (tiles that hide keys only)
    int v_bad = 0;
    if (need_mask) SCAN_HIDDEN_V16(sV + buf * BLOCK_N * HEAD_DIM, HEAD_DIM)
    IN_TURN(ISSUE_S(buf))
    WAIT_S();
#if !(WG_ABL & 1)
    SCORES(n0, need_mask)
    SOFTMAX_P()
    RESCALE_O()
#endif
    PACK_P()
#if !(WG_ABL & 4)
    IN_TURN(ISSUE_PV(buf))
    WAIT_O();
#endif
    ADD_BACK_HIDDEN_V()
  }
  TURNS_END()
#else
  // ---- overlapped schedule (FA3's intra-warpgroup pipelining): tile t's S = Q K(t)^T and
  // tile t-1's O += P V(t-1) are issued together, and the softmax of S(t) runs while the tensor
  // cores do P V(t-1).  K and V have two buffers each, loaded in separate cp.async groups:
  // K(t+1) right after the top barrier of tile t (K(t-1)'s buffer is free: every warpgroup
  // waited for S(t-1)), V(t+1) after the middle barrier (V(t-1)'s buffer is free once every
  // warpgroup waited for P V(t-1)).  Groups in flight at the top of tile t: at most V(t), so
  // CP_WAIT(1) there means K(t) and V(t-1) have landed.
  if (t_first <= t_last) {
    if (t_first < t_last) { LOAD_K1(t_first + 1, 1) }
    CP_COMMIT();
    if (t_first < t_last) { LOAD_V1(t_first + 1, 1) }
    CP_COMMIT();
    // groups: Q+K(f)+V(f) (the prologue's one), K(f+1), V(f+1): K(f) and Q have landed when at
    // most two are in flight
    CP_WAIT(2);
    FENCE_ASYNC_SHARED();
    barrier(CLK_LOCAL_MEM_FENCE);
    ISSUE_S(0)
    WAIT_S();
    SCORES(t_first * BLOCK_N, NEED_MASK(t_first * BLOCK_N))
    SOFTMAX_P()
    PACK_P()
  }
  for (int t = t_first + 1; t <= t_last + 1; t++) {
    const int cur = (t - t_first) & 1, prev = cur ^ 1;
    const int np = (t - 1) * BLOCK_N;  // tile t-1: its P is in pa, its V in buffer prev
    const bool mask_p = NEED_MASK(np);
    CP_WAIT(1);
    FENCE_ASYNC_SHARED();
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t + 1 <= t_last) { LOAD_K1(t + 1, prev) }
    CP_COMMIT();
    int v_bad = 0;  // tile t-1's scan (its flag value t + 1 is new in every pass)
    if (mask_p) SCAN_HIDDEN_V16(sV + prev * BLOCK_N * HEAD_DIM, HEAD_DIM)
    if (t <= t_last) {
      const int n0 = t * BLOCK_N;
      const bool need_mask = NEED_MASK(n0);
      ISSUE_S(cur)
      ISSUE_PV(prev)
      WAIT1_S();  // S(t) done, P V(t-1) may still run
      SCORES(n0, need_mask)
      SOFTMAX_P()
      WAIT_O();
    } else {
      resc = 0;
      ISSUE_PV(prev)
      WAIT_O();
    }
    {  // O holds tile t-1's P V: its hidden inf/NaN v, then the rescale for tile t's max
      const int n0 = np;
      ADD_BACK_HIDDEN_V()
    }
    RESCALE_O()
    if (t <= t_last) { PACK_P() }
    barrier(CLK_LOCAL_MEM_FENCE);  // every warpgroup is done with V(t-1)'s buffer
    if (t + 1 <= t_last) { LOAD_V1(t + 1, prev) }
    CP_COMMIT();
  }
#endif
