// attn_fwd_mma.cl, -DSOFTMAX_PIPE=1: the key-tile loop of the 16-bit kernel, software-pipelined
// over half tiles (HN = BLOCK_N / 2 keys).  S of the next half is issued to the tensor cores in
// the same basic block as the exponentials and P V of the current half, so ptxas can interleave
// the mma.sync of one with the FP/MUFU work of the other inside one warp (FlashAttention-3
// overlaps softmax with the next GEMM the same way, with wgmma); the online softmax steps once
// per half tile.  Included inside the kernel body in place of the plain loop.
//
// K and V are double-buffered with separate phases (two barriers per tile):
//   alpha_t (before S(t, half 0) is issued): K(t) landed; K(t+1) is issued into K(t-1)'s buffer
//   beta_t  (before P V(t, half 0)):          V(t) landed; V(t+1) is issued into V(t-1)'s buffer
// Program order per tile t:  A(t,0) beta_t B(t,0) A(t,1) alpha_t+1 B(t,1), where
//   A(t,h): scale / mask S(t,h), row max, lazy rescale of l and O  (a vote and a branch)
//   B(t,h): issue S of the next half | exponentials of S(t,h), l, O += P V(t, keys of h)
// The groups in flight at alpha and beta: the one waited for and the one issued after it, so
// both wait with cp.async.wait_group 1.  The last tile's B(t,1) computes S of a tile that does
// not exist from a stale K buffer (kept branch-free; the result is never used; with WARP_SKIP
// it is skipped where the warp sees no key there).

#if IS_TF32 || KV_SPLIT_STAGES || BLOCK_N % 32
#error "SOFTMAX_PIPE=1 is for the 16-bit kernel, BLOCK_N % 32 == 0, no KV_SPLIT_STAGES"
#endif
#define HN (BLOCK_N / 2)
#define NT_H (HN / 8)   // 8-column n-tiles of S per half tile
#define KS_H (HN / 16)  // k-steps of P V per half tile

// S (M_TILES x NT_H x 4) = Q K^T for keys KEY0 .. KEY0 + HN - 1 of the K buffer at KB (element
// pointer) / KA (LDSM_BYTES: byte address)
#if LDSM_BYTES
#define LDSM_K(R, KB, KA, KEY0, N2, KK) LDSM_B(R, sK, (KA) + (((KEY0) + (N2) * 16) * LDS + (KK) * 16) * 2)
#define LDSM_V(R, VB, VA, KEY0, T2, N2) LDSM_B_T(R, sV, (VA) + (((KEY0) + (T2) * 16) * LDS + (N2) * 16) * 2)
#define LDSM_Q(R, MT, KK) LDSM_B(R, sQ, qaddr + ((MT) * 16 * LDS + (KK) * 16) * 2)
#else
#define LDSM_K(R, KB, KA, KEY0, N2, KK)                                                        \
  LDSM_X4(R, KB, ((KEY0) + (N2) * 16 + (lane & 7) + (lane >> 4) * 8) * LDS + (KK) * 16 +       \
          ((lane >> 3) & 1) * 8)
#define LDSM_V(R, VB, VA, KEY0, T2, N2)                                                        \
  LDSM_X4_T(R, VB, ((KEY0) + (T2) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS +          \
            (N2) * 16 + (lane >> 4) * 8)
#define LDSM_Q(R, MT, KK)                                                                      \
  LDSM_X4(R, sQ, (wrow0 + (MT) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + (KK) * 16 +  \
          (lane >> 4) * 8)
#endif
#if Q_IN_REGS
#define Q_FRAGS(KK)
#define QF(KK, MT) qa[KK][MT]
#else
#define Q_FRAGS(KK)                                                                            \
  uint qa1[M_TILES][4];                                                                        \
  UNROLL for (int mt = 0; mt < M_TILES; mt++) { LDSM_Q(qa1[mt], mt, KK); }
#define QF(KK, MT) qa1[MT]
#endif
#define S_HALF(SH, KB, KA, KEY0)                                                               \
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                                \
    UNROLL for (int nt = 0; nt < NT_H; nt++) {                                                 \
      UNROLL for (int c = 0; c < 4; c++) SH[mt][nt][c] = 0.f;                                  \
    }                                                                                          \
  }                                                                                            \
  UNROLL for (int kk = 0; kk < KSTEPS_QK; kk++) {                                              \
    Q_FRAGS(kk)                                                                                \
    UNROLL for (int n2 = 0; n2 < NT_H / 2; n2++) {                                             \
      uint kf[4];                                                                              \
      LDSM_K(kf, KB, KA, KEY0, n2, kk);                                                        \
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                            \
        MMA(SH[mt][2 * n2], QF(kk, mt), kf[0], kf[1]);                                         \
        MMA(SH[mt][2 * n2 + 1], QF(kk, mt), kf[2], kf[3]);                                     \
      }                                                                                        \
    }                                                                                          \
  }

// A: scores of keys N0H.. in the exp2 domain (ROW_SCORE: score.h), row max, lazy rescale
#define A_HALF(SH, N0H)                                                                        \
  {                                                                                            \
    const bool nm_ = MASK_KIND || !((N0H) >= lo_all && (N0H) + HN - 1 <= hi_all);             \
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                              \
      UNROLL for (int nt = 0; nt < NT_H; nt++) {                                               \
        UNROLL for (int c = 0; c < 4; c++) {                                                   \
          const int j = (N0H) + nt * 8 + 2 * tg + (c & 1);                                     \
          ROW_SCORE(SH[mt][nt][c], mt, c >> 1, j, nm_)                                         \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
    float m_new[M_TILES][2];                                                                   \
    int grow = 0;                                                                              \
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                              \
      UNROLL for (int hf = 0; hf < 2; hf++) {                                                  \
        float mx = -INFINITY;                                                                  \
        UNROLL for (int nt = 0; nt < NT_H; nt++) {                                             \
          mx = fmax(mx, fmax(SH[mt][nt][2 * hf], SH[mt][nt][2 * hf + 1]));                     \
        }                                                                                      \
        mx = fmax(mx, SHFL_XOR(mx, 1));                                                        \
        mx = fmax(mx, SHFL_XOR(mx, 2));                                                        \
        m_new[mt][hf] = fmax(m_i[mt][hf], SCORE_MAX(mx, qk_scale));                            \
        grow |= m_new[mt][hf] - m_i[mt][hf] > RESCALE_THRESH;                                  \
      }                                                                                        \
    }                                                                                          \
    if (WARP_ANY(grow)) {                                                                      \
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                            \
        UNROLL for (int hf = 0; hf < 2; hf++) {                                                \
          const float m_use = m_new[mt][hf] == -INFINITY ? 0.f : m_new[mt][hf];                \
          const float alpha = ex2(m_i[mt][hf] - m_use);                                        \
          m_i[mt][hf] = m_new[mt][hf];                                                         \
          l_i[mt][hf] *= alpha;                                                                \
          UNROLL for (int nd = 0; nd < NT_O; nd++) {                                           \
            o[mt][nd][2 * hf] *= alpha;                                                        \
            o[mt][nd][2 * hf + 1] *= alpha;                                                    \
          }                                                                                    \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
  }

// B's second part: P = 2^(S - m), l += rowsum P, O += P V for keys KEY0.. of the V buffer
#define EXP_PV(SH, VB, VA, KEY0)                                                               \
  UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                                \
    UNROLL for (int hf = 0; hf < 2; hf++) {                                                    \
      const float m_use = m_i[mt][hf] == -INFINITY ? 0.f : m_i[mt][hf];                        \
      float rs = 0.f;                                                                          \
      UNROLL for (int nt = 0; nt < NT_H; nt++) {                                               \
        UNROLL for (int c = 0; c < 2; c++) {                                                   \
          const float p = ex2(SCORE_P_ARG(SH[mt][nt][2 * hf + c], m_use, qk_scale));           \
          SH[mt][nt][2 * hf + c] = p;                                                          \
          rs += p;                                                                             \
        }                                                                                      \
      }                                                                                        \
      l_i[mt][hf] += rs;                                                                       \
    }                                                                                          \
  }                                                                                            \
  UNROLL for (int t2 = 0; t2 < KS_H; t2++) {                                                   \
    uint pa[M_TILES][4];                                                                       \
    UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                              \
      pa[mt][0] = pack2(SH[mt][2 * t2][0], SH[mt][2 * t2][1]);                                 \
      pa[mt][1] = pack2(SH[mt][2 * t2][2], SH[mt][2 * t2][3]);                                 \
      pa[mt][2] = pack2(SH[mt][2 * t2 + 1][0], SH[mt][2 * t2 + 1][1]);                         \
      pa[mt][3] = pack2(SH[mt][2 * t2 + 1][2], SH[mt][2 * t2 + 1][3]);                         \
    }                                                                                          \
    UNROLL for (int n2 = 0; n2 < NT_O / 2; n2++) {                                             \
      uint vf[4];                                                                              \
      LDSM_V(vf, VB, VA, KEY0, t2, n2);                                                        \
      UNROLL for (int mt = 0; mt < M_TILES; mt++) {                                            \
        MMA(o[mt][2 * n2], pa[mt], vf[0], vf[1]);                                              \
        MMA(o[mt][2 * n2 + 1], pa[mt], vf[2], vf[3]);                                          \
      }                                                                                        \
    }                                                                                          \
  }

#if LDSM_BYTES
#define K_ADDR(BUF) (kaddr + (BUF) * KV_BUF_BYTES)
#define V_ADDR(BUF) (vaddr + (BUF) * KV_BUF_BYTES)
#else
#define K_ADDR(BUF) 0u
#define V_ADDR(BUF) 0u
#endif
// (K's loads are each tile's first: they stage the next tile's table entries, NEXT_PAGES)
#define LOAD_K_B(TILE, BUF)                                                                    \
  NEXT_PAGES(TILE)                                                                             \
  LOAD_X(TILE, sK + (BUF) * BLOCK_N * LDS, sK, kp0, kc0, k_step, kh, k_sb, k_sr,               \
         kdst0 + (BUF) * KV_BUF_BYTES, HEAD_DIM, QK_CHUNKS)
#define LOAD_V_B(TILE, BUF)                                                                    \
  LOAD_X(TILE, sV + (BUF) * BLOCK_N * LDS, sV, vp0, vc0, v_step, vh, v_sb, v_sr,               \
         vdst0 + (BUF) * KV_BUF_BYTES, HEAD_DIM_V, V_CHUNKS)

// WARP_SKIP: a warp skips the half tiles none of its rows sees (S, A and P V of that half,
// each guarded by the same test).  B keeps S and P V in one basic block when neither is skipped.
// Emulated: everything is computed and m, l, O restored after a skipped half (plain loop's way).
#if WARP_SKIP
#define HSKIP(N0H) ((N0H) > w_hi || (N0H) + HN - 1 < w_lo)
#if USE_PTX
#define S_STEP(SH, KB, KA, KEY0, N0H) if (!HSKIP(N0H)) { S_HALF(SH, KB, KA, KEY0) }
#define A_STEP(SH, N0H) if (!HSKIP(N0H)) { A_HALF(SH, N0H) }
#define PV_STEP(SH, VB, VA, KEY0, N0H) if (!HSKIP(N0H)) { EXP_PV(SH, VB, VA, KEY0) }
#define SPV_STEP(SN, KB, KA, KEYN, N0N, SC, VB, VA, KEYC, N0C)                                 \
  if (!HSKIP(N0N) && !HSKIP(N0C)) {                                                            \
    S_HALF(SN, KB, KA, KEYN)                                                                   \
    EXP_PV(SC, VB, VA, KEYC)                                                                   \
  } else {                                                                                     \
    S_STEP(SN, KB, KA, KEYN, N0N)                                                              \
    PV_STEP(SC, VB, VA, KEYC, N0C)                                                             \
  }
#else
  float o_keep[M_TILES][NT_O][4], m_keep[M_TILES][2], l_keep[M_TILES][2];
#define S_STEP(SH, KB, KA, KEY0, N0H) S_HALF(SH, KB, KA, KEY0)
#define A_STEP(SH, N0H) KEEP_STATE A_HALF(SH, N0H)
#define PV_STEP(SH, VB, VA, KEY0, N0H)                                                         \
  EXP_PV(SH, VB, VA, KEY0)                                                                     \
  if (HSKIP(N0H)) { RESTORE_STATE }
#define SPV_STEP(SN, KB, KA, KEYN, N0N, SC, VB, VA, KEYC, N0C)                                 \
  S_HALF(SN, KB, KA, KEYN)                                                                     \
  PV_STEP(SC, VB, VA, KEYC, N0C)
#endif
#else
#define S_STEP(SH, KB, KA, KEY0, N0H) S_HALF(SH, KB, KA, KEY0)
#define A_STEP(SH, N0H) A_HALF(SH, N0H)
#define PV_STEP(SH, VB, VA, KEY0, N0H) EXP_PV(SH, VB, VA, KEY0)
#define SPV_STEP(SN, KB, KA, KEYN, N0N, SC, VB, VA, KEYC, N0C)                                 \
  S_HALF(SN, KB, KA, KEYN)                                                                     \
  EXP_PV(SC, VB, VA, KEYC)
#endif

  float s0[M_TILES][NT_H][4], s1[M_TILES][NT_H][4];
  if (t_first <= t_last) {
    // alpha of the first tile: Q and K(t_first) landed (V(t_first) may be in flight)
    CP_WAIT(1);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t_first < t_last) { LOAD_K_B(t_first + 1, 1) }
    CP_COMMIT();
    S_STEP(s0, sK, K_ADDR(0), 0, t_first * BLOCK_N)
  }
  for (int t = t_first; t <= t_last; t++) {
    const int buf = (t - t_first) & 1;
    const int n0 = t * BLOCK_N;
    const bool need_mask = MASK_KIND || !(n0 >= lo_all && n0 + BLOCK_N - 1 <= hi_all);
    __local const ELEM *sKb = sK + buf * BLOCK_N * LDS;
    __local const ELEM *sVb = sV + buf * BLOCK_N * LDS;
    __local const ELEM *sKn = sK + (buf ^ 1) * BLOCK_N * LDS;  // K(t+1)
    A_STEP(s0, n0)
    // -- beta_t: V(t) landed; no warp reads V(t-1) any more
    CP_WAIT(1);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t < t_last) { LOAD_V_B(t + 1, buf ^ 1) }
    CP_COMMIT();
    int v_bad = 0;
    // as in the plain loop: zero inf/NaN of V(t), added back after P V
    if (need_mask) SCAN_HIDDEN_V16(sV + buf * BLOCK_N * LDS, LDS)
    // -- B(t, 0): S(t, 1) under the softmax and P V of half 0
    SPV_STEP(s1, sKb, K_ADDR(buf), HN, n0 + HN, s0, sVb, V_ADDR(buf), 0, n0)
    A_STEP(s1, n0 + HN)
    // -- alpha_t+1: K(t+1) landed; no warp reads K(t) any more
    CP_WAIT(1);
    barrier(CLK_LOCAL_MEM_FENCE);
    if (t + 1 < t_last) { LOAD_K_B(t + 2, buf) }
    CP_COMMIT();
    // -- B(t, 1): S(t+1, 0) (unused after the last tile) under the softmax and P V of half 1
    SPV_STEP(s0, sKn, K_ADDR(buf ^ 1), 0, n0 + BLOCK_N, s1, sVb, V_ADDR(buf), HN, n0 + HN)
    ADD_BACK_HIDDEN_V()
  }
