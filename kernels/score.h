/* attnlib: the score transform of every attention kernel in kernels/ (attn_fwd.cl, attn_fwd_mma.cl
 * with attn_fwd_mma_pipe.h, attn_fwd_wgmma.cl, attn_decode_mma.cl): how the product x = q.k of a
 * query row and a key becomes the logit the softmax sees, and whether the row sees the key. As
 * FlashInfer's attention variants split this into a logits transform and a logits mask per
 * (row, key), each kernel keeps its own data layout and loop order and applies SCORE_VARIANT to
 * every score: a score option is written here once. All choices are compile time, so a kernel
 * built without an option runs exactly the code it ran before the option existed.
 *
 * The including kernel defines:
 *   SCORE_T        the type of a score (attn_fwd.cl: acc_t; the NVIDIA kernels: float)
 *   SCORE_LOG2     1: scores live in the exp2 domain (the NVIDIA kernels: the host folds log2(e)
 *                  into the scale, the softcap and the ALiBi slopes, _nvidia_tables; an additive
 *                  mask value is multiplied by log2(e) here); 0: natural units
 *   SCORE_SOFTCAP, SCORE_ALIBI   0 or 1
 *   SCALE_POS      (SCORE_LOG2 kernels) 1 when scale > 0
 *   MASK_KIND      0 none, 1 bool (uchar, 0 hides the key), additive (added to the logit; -inf
 *                  hides the key) as 2 SCORE_T, 3 float16, 4 bfloat16 (read exactly as float)
 *
 * The transform, in order (contract §2; NaN and hidden keys: §1):
 *   logit   x * MUL, or with a softcap CAP tanh(x * MUL) (MUL = scale / softcap)
 *   ALiBi   minus SLOPE |qpos - kpos| (DIST = qpos - kpos, an integer)
 *   hiding  a key outside the row's visible range [LO, HI] (causal, sliding window, the
 *           sequence's end: the kernel computes the range per row) becomes -inf; inside it, the
 *           mask element at MP hides it (bool) or is added (additive; -inf hides the key even
 *           where its k holds NaN: the score is assigned, never summed).
 *   Attention sinks and the empty row belong to the epilogue (epilogue.h).
 */
#ifndef ATTNLIB_SCORE_H
#define ATTNLIB_SCORE_H

#if !defined(SCORE_LOG2) || !defined(SCORE_SOFTCAP) || !defined(SCORE_ALIBI)
#error "SCORE_LOG2, SCORE_SOFTCAP and SCORE_ALIBI must be defined"
#endif
#ifndef SCORE_T
#define SCORE_T float
#endif
#ifndef MASK_KIND
#define MASK_KIND 0
#endif
#define SCORE_NEG_INF (-(SCORE_T)INFINITY)
#define SCORE_LOG2E 1.4426950408889634f

/* -- the logit. SCORE_FOLD (exp2 domain only): the scale is folded into the softmax (the row
 *    max scaled once, p = 2^(x MUL - m) one FMA) when the scores need no other transform and
 *    MUL > 0 (then max(x) MUL = max(x MUL)); SCORE_MAX / SCORE_P_ARG are the softmax's two
 *    uses of it. */
#if SCORE_LOG2 && SCALE_POS && !SCORE_SOFTCAP && !SCORE_ALIBI && MASK_KIND < 2
#define SCORE_FOLD 1
#else
#define SCORE_FOLD 0
#endif
#if SCORE_SOFTCAP
#define SCORE_CAP(X, CAP) ((CAP) * tanh(X))
#else
#define SCORE_CAP(X, CAP) (X)
#endif
#if SCORE_FOLD
#define SCORE_LOGIT(X, MUL, CAP) (X)
#define SCORE_MAX(MX, MUL) ((MX) * (MUL))
#define SCORE_P_ARG(X, M, MUL) fma((X), (MUL), -(M))
#else
#define SCORE_LOGIT(X, MUL, CAP) SCORE_CAP((X) * (MUL), CAP)
#define SCORE_MAX(MX, MUL) (MX)
#define SCORE_P_ARG(X, M, MUL) ((X) - (M))
#endif

/* -- ALiBi */
#if SCORE_ALIBI
#define SCORE_ALIBI_ADD(X, SLOPE, DIST) ((X) - (SLOPE) * fabs((SCORE_T)(DIST)))
#else
#define SCORE_ALIBI_ADD(X, SLOPE, DIST) (X)
#endif

/* -- the mask: MASK_T its element, MASK_SEES(MP) whether the row sees the key, MASK_SCORE(X, MP)
 *    applies it to the logit X of a key inside the row's range */
#if MASK_KIND == 2
#define MASK_T SCORE_T
#define MASK_VALUE(P) (*(P))
#elif MASK_KIND == 3
#define MASK_T half
#define MASK_VALUE(P) vload_half(0, P)
#elif MASK_KIND == 4
#define MASK_T ushort
#define MASK_VALUE(P) as_float((uint) * (P) << 16)
#else
#define MASK_T uchar
#endif
#if SCORE_LOG2
#define MASK_ADD(X, MV) fma((MV), SCORE_LOG2E, X)
#else
#define MASK_ADD(X, MV) ((X) + (MV))
#endif
#if MASK_KIND == 1
#define MASK_SEES(MP) (*(MP) != 0)
#define MASK_SCORE(X, MP)                                                                       \
    if (!*(MP)) X = SCORE_NEG_INF;
#elif MASK_KIND
#define MASK_SEES(MP) (MASK_VALUE(MP) != SCORE_NEG_INF)
#define MASK_SCORE(X, MP)                                                                       \
    {                                                                                           \
        const SCORE_T mv_ = MASK_VALUE(MP);                                                     \
        X = mv_ == SCORE_NEG_INF ? SCORE_NEG_INF : MASK_ADD(X, mv_);                            \
    }
#else
#define MASK_SEES(MP) 1
#define MASK_SCORE(X, MP)
#endif

/* -- hiding: on tiles that hide some keys (NM), key J outside [LO, HI] becomes -inf, the mask
 *    (at MP, evaluated only for a key in range) applies to the others */
#define SCORE_IN_RANGE(J, LO, HI) ((J) >= (LO) && (J) <= (HI))
#define SCORE_HIDE(X, J, LO, HI, MP, NM)                                                        \
    if (NM) {                                                                                   \
        if (!SCORE_IN_RANGE(J, LO, HI)) X = SCORE_NEG_INF;                                      \
        else { MASK_SCORE(X, MP) }                                                              \
    }

/* -- the whole transform of score X (the raw q.k; updated in place) */
#define SCORE_VARIANT(X, MUL, CAP, SLOPE, DIST, J, LO, HI, MP, NM)                              \
    X = SCORE_ALIBI_ADD(SCORE_LOGIT(X, MUL, CAP), SLOPE, DIST);                                 \
    SCORE_HIDE(X, J, LO, HI, MP, NM)

#endif /* ATTNLIB_SCORE_H */
