/* attnlib: the epilogue of every attention kernel in kernels/ and of merge.cl: a row's final
 * softmax state (M the running max, L the sum of the exponentials against it, O the
 * unnormalised output) becomes out = O INV and the natural-log lse. Written once here (as
 * FlashInfer's variants end in one output transform); each kernel gathers (M, L) its own way.
 *
 * EPI_FINISH(D, T, M, L, SINK_ON, SK, INV, LSE) sets INV and LSE (type T) from (M, L) in domain
 * D: 0 natural units (exp / log), 1 the exp2 domain (M in log2 units: lse = (M + log2 L) ln 2,
 * ex2 from nv_warp.h). Contract §1: a row that saw no key (L = 0) gives INV 0 (out 0) and lse
 * -inf. With SINK_ON (a run-time value; SK, the natural-log sink logit, is read only then;
 * contract §10) the state is merged once with (out 0, lse SK): with s = SK in domain D,
 * m' = max(M, s), l' = L 2^(M - m') + 2^(s - m') (e^ in the natural domain), INV = 2^(M - m') / l',
 * lse from (m', l'); a row that saw no key gives INV 0 and lse = SK exactly. Partial states of
 * split keys never take the sink (the merge of the splits folds it in once).
 */
#ifndef ATTNLIB_EPILOGUE_H
#define ATTNLIB_EPILOGUE_H

#define EPI_EXP_0(X) exp(X)
#define EPI_LSE_0(M, L) ((M) + log(L))
#define EPI_IN_0(X) (X)
#define EPI_EXP_1(X) ex2(X)
#define EPI_LSE_1(M, L) (((M) + log2(L)) * 0.6931471805599453f)
#define EPI_IN_1(X) ((X) * 1.4426950408889634f)

#define EPI_FINISH(D, T, M, L, SINK_ON, SK, INV, LSE)                                           \
    {                                                                                           \
        INV = (L) == 0 ? (T)0 : (T)1 / (L);                                                     \
        LSE = (L) == 0 ? -(T)INFINITY : EPI_LSE_##D(M, L);                                      \
        if (SINK_ON) {                                                                          \
            const T sk_ = (T)(SK), s_ = EPI_IN_##D(sk_);                                        \
            const T mx_ = (L) == 0 ? s_ : fmax((M), s_);                                        \
            const T a_ = (L) == 0 ? (T)0 : EPI_EXP_##D((M) - mx_);                              \
            const T lt_ = (L) * a_ + EPI_EXP_##D(s_ - mx_);                                     \
            INV = a_ / lt_;                                                                     \
            LSE = (L) == 0 ? sk_ : EPI_LSE_##D(mx_, lt_);                                       \
        }                                                                                       \
    }

#endif /* ATTNLIB_EPILOGUE_H */
