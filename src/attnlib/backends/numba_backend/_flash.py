"""FlashAttention forward on the CPU with numba: query blocks x key blocks, online softmax.

One *task* is ``(sequence, kv head, block of packed query rows, key range)``. Packed rows put the
``G = Hq // Hkv`` query heads that share a kv head side by side (row ``r`` is query row ``r // G``
of head ``kvh * G + r % G``), so one K/V tile load serves the whole GQA group, and a decode step
(one query row) still gives BLAS an ``M = G`` matrix. Per key tile (FlashAttention-2, Alg. 1):

    S = Q_blk @ K_blk^T (BLAS gemm on contiguous float32 / float64 tiles)
    -> softcap, ALiBi, mask, positional (causal / window) masking
    -> m_new = max(m, rowmax S); P = exp(S - m_new); l = l * exp(m - m_new) + rowsum P
    -> O = O * exp(m - m_new) + P @ V_blk (gemm)

Key tiles that causal / window hide from every row of the block are never visited. Only
``BLOCK_M x BLOCK_N`` score tiles exist: no Sq x Sk buffer. Threads (the caller and helpers,
each running :func:`flash_forward` without the GIL) claim tasks costliest first through an atomic
counter; each output row is produced by exactly one task, in a fixed key order, so results are
bitwise reproducible. Split-key tasks (decode) write partial states ``(O, m, l)`` that
:func:`merge_partials` combines in a fixed order.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._cache import njit

# 'nnan' / 'ninf' stay off: -inf marks hidden keys and NaN must propagate from visible ones.
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

LOG2E = 1.4426950408889634
NEG_INF = -np.inf
BIG = 1 << 62  # "unbounded" for window sides and causal_hi


@intrinsic
def _fetch_add(typingctx, arr, val):
    """Atomically ``old = arr[0]; arr[0] += val; return old`` (int64): the shared task counter
    of the dynamic schedule."""
    sig = types.int64(arr, val)

    def codegen(context, builder, signature, args):
        arr_t = signature.args[0]
        ary = context.make_array(arr_t)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, arr_t, ary,
                                       [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, args[1], "seq_cst")

    return sig, codegen


def _call_address(n_args: int):
    """LLVM codegen of a call to the C function at the address in the first argument, with the
    other ``n_args`` int64 arguments passed as pointers."""

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p] * n_args)
        fptr = builder.inttoptr(args[0], fnty.as_pointer())
        builder.call(fptr, [builder.inttoptr(x, i8p) for x in args[1:]])
        return context.get_dummy_value()

    return codegen


@intrinsic
def _call_blas(typingctx, fn, ta, tb, m, n, kk, alpha, a, lda, b, ldb, beta, c, ldc):
    """Call the Fortran ``?gemm`` at address ``fn`` with the 13 argument addresses (all passed
    by reference, Fortran style). The address is a run-time argument, not a constant baked into
    the code, so the compiled kernel stays cacheable across processes."""
    sig = types.void(fn, ta, tb, m, n, kk, alpha, a, lda, b, ldb, beta, c, ldc)
    return sig, _call_address(13)


@intrinsic
def _call_jit(typingctx, fn, jitter, a, b, c):
    """Call an MKL JIT gemm kernel ``fn(jitter, a, b, c)`` (all addresses, int64)."""
    return types.void(fn, jitter, a, b, c), _call_address(4)


@njit()
def _gemm(fn, trans_a, trans_b, m, n, kk, alpha, a, lda, b, ldb, beta, c, ldc, bi, bf):
    """Column-major ``C (m x n) = alpha op(A) op(B) + beta C`` through BLAS, on addresses and
    leading dimensions, so tiles are used in place (no copy to a contiguous tile first).
    ``bi`` int32 (8,) and ``bf`` (2,) of the compute dtype are the by-reference scratch."""
    bi[0] = m
    bi[1] = n
    bi[2] = kk
    bi[3] = lda
    bi[4] = ldb
    bi[5] = ldc
    bi[6] = 84 if trans_a else 78  # 'T' / 'N' (the low byte of the int32)
    bi[7] = 84 if trans_b else 78
    bf[0] = alpha
    bf[1] = beta
    pi = np.int64(bi.ctypes.data)  # int64 (uint64 + int64 would type as float64)
    pf = np.int64(bf.ctypes.data)
    sz = bf.itemsize
    _call_blas(fn, pi + 24, pi + 28, pi, pi + 4, pi + 8, pf, a, pi + 12, b, pi + 16, pf + sz,
               c, pi + 20)


@intrinsic
def _wide_vectors(typingctx):
    """Let LLVM vectorise the calling function with 512-bit registers where the CPU has them.

    numba compiles for the host CPU, and LLVM's tuning for recent Xeons prefers 256-bit vectors
    (``prefer-256-bit``), so AVX-512 machines run the element-wise softmax passes at half width.
    This sets the two LLVM string attributes that lift it, on the function being compiled only
    (llvmlite's attribute set knows no string attributes, so it is added to the set directly);
    on CPUs without AVX-512 LLVM ignores them. On AVX-512 CPUs the exp pass of a tile then runs
    at full vector width, with the same bits."""

    def codegen(context, builder, signature, args):
        attrs = builder.function.attributes
        set.add(attrs, '"prefer-vector-width"="512"')
        set.add(attrs, '"min-legal-vector-width"="512"')
        return context.get_dummy_value()

    return types.void(), codegen


@njit(fastmath=FASTMATH)
def _col_max(st, n, nr, m_new):
    """m_new[r] = max(m_new[r], max_j st[j, r]) on the transposed (key-major) score tile.

    Elementwise across rows, so LLVM vectorises it (a per-row reduction does not vectorise
    without 'nnan'). A NaN score may be missed here; it still reaches its row through exp.
    """
    _wide_vectors()
    for j in range(n):
        col = st[j * nr : (j + 1) * nr]
        for r in range(nr):
            x = col[r]
            a = m_new[r]
            m_new[r] = x if x > a else a


@intrinsic
def _bits_to_f32(typingctx, bits):
    """The float32 whose bit pattern is the int32 ``bits`` (a register bitcast, vectorisable)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@njit(fastmath=FASTMATH, inline="always")
def _pow2(x):
    """``2**x`` for float32 ``x <= 0`` in registers (vectorisable when inlined in a loop):
    ``2**x = 2**k * p(f)``, ``k = rint(x)``, ``f = x - k`` (exact), ``p`` the degree-7 Taylor
    polynomial of ``exp(f ln2)`` on ``|f| <= 1/2`` (a few ulp); the ``2**k`` factor is built
    from exponent bits by a register bitcast. ``x < -126`` gives 0 (also -inf); NaN stays NaN.
    """
    xc = x if x > np.float32(-127.0) else np.float32(-127.0)  # NaN -> -127 (bits)
    fi = np.rint(xc)
    f = x - fi
    poly = np.float32(1.5252733804059838e-05)
    poly = poly * f + np.float32(0.00015403530393381606)
    poly = poly * f + np.float32(0.0013333558146428441)
    poly = poly * f + np.float32(0.009618129107628477)
    poly = poly * f + np.float32(0.055504108664821576)
    poly = poly * f + np.float32(0.2402265069591007)
    poly = poly * f + np.float32(0.6931471805599453)
    poly = poly * f + np.float32(1.0)
    y = poly * _bits_to_f32((np.int32(fi) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if x < np.float32(-126.0) else y


@njit(fastmath=FASTMATH)
def _exp2_f32(st, n, nr, mu, l_i):
    """In place ``st = 2**(st - mu[row])`` (scores in log2 units, :func:`_pow2`), ``l_i +=
    column sums``, in one vectorised pass over the tile."""
    _wide_vectors()
    for j in range(n):
        sc = st[j * nr : (j + 1) * nr]
        for r in range(nr):
            y = _pow2(sc[r] - mu[r])
            sc[r] = y
            l_i[r] += y


@njit(fastmath=FASTMATH)
def _exp_f64(st, n, nr, mu, l_i):
    """In place ``st = exp(st - mu[row])`` (natural units), ``l_i += column sums``."""
    for j in range(n):
        for r in range(nr):
            y = math.exp(st[j * nr + r] - mu[r])
            st[j * nr + r] = y
            l_i[r] += y


@njit(fastmath=FASTMATH)
def _load_rows(src, st, b, row0, nrows, ring, h, dst, width):
    """dst[t*width + d] = row ``row(t)`` of (batch ``b``, kv head ``h``) of the flat key / value
    array ``src`` with element strides ``st`` (batch, row, head); the row wraps at ``ring``
    (ring-buffer caches)."""
    base = b * st[0] + h * st[2]
    for t in range(nrows):
        r = row0 + t
        if ring > 0 and r >= ring:
            r -= ring
        off = base + r * st[1]
        row = src[off:off + width]
        out = t * width
        for d in range(width):
            dst[out + d] = row[d]


@njit(inline="always")
def _page_at(table, s, p, n_pages):
    """Pool page of logical page ``p`` of sequence ``s``, clamped into the pool (a device or
    caller table is not trusted: no read outside the pool, whatever it holds)."""
    x = table[s, min(p, table.shape[1] - 1)]
    return min(max(x, 0), n_pages - 1)


@njit()
def _paged_start(table, s, row, n, page_size, n_pages):
    """The pool row (``page * page_size + slot``) where logical rows ``[row, row + n)`` of
    sequence ``s`` start when their pages follow each other in the pool (the tile is then read
    in place), else -1 (the tile is gathered)."""
    p0 = row // page_size
    first = _page_at(table, s, p0, n_pages)
    for p in range(p0 + 1, (row + n - 1) // page_size + 1):
        if _page_at(table, s, p, n_pages) != first + p - p0:
            return -1
    return first * page_size + row % page_size


@njit(fastmath=FASTMATH)
def _load_paged(src, st, table, s, row0, nrows, page_size, n_pages, h, dst, width):
    """dst[t*width + d] = logical row ``row0 + t`` of sequence ``s`` of the paged pool ``src``
    (flat, element strides ``st``: page, slot, head), kv head ``h``; one table lookup per page."""
    t = 0
    while t < nrows:
        r = row0 + t
        slot = r % page_size
        run = min(page_size - slot, nrows - t)  # rows left in this page
        off = _page_at(table, s, r // page_size, n_pages) * st[0] + slot * st[1] + h * st[2]
        for u in range(run):
            row = src[off:off + width]  # slices: unit-stride copies the loop vectorises
            out = dst[(t + u) * width:(t + u + 1) * width]
            for d in range(width):
                out[d] = row[d]
            off += st[1]
        t += run


# storage formats of k / v (``kv_format``) and q (``q_format``) other than the compute dtype:
# the 8-bit codes (attnlib._quant.KVFormat.code) and the 16-bit floats
F8_E4M3, F8_E5M2, INT8 = 1, 2, 3
F16, BF16 = 4, 5


@intrinsic
def _f16_to_f32(typingctx, bits):
    """The float32 value of the float16 whose bits are the uint16 ``bits``: a register bitcast
    and ``fpext`` (exact, NaN and infinities kept; x86's F16C converts 8 or 16 lanes in one
    instruction)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _bf16_to_f32(typingctx, bits):
    """The float32 value of the bfloat16 whose bits are the uint16 ``bits``: the bits moved to
    a float32's upper half (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())

    return sig, codegen


@njit(fastmath=FASTMATH, inline="always")
def _widen_row(codes, wide, fmt, f, out):
    """``out[d] = f * value(code d)`` of one row: ``codes`` the row's bytes (8-bit formats),
    ``wide`` its uint16 elements (F16, BF16; ``f`` unused). Each branch is one branch-free loop
    that LLVM vectorises, every value exact: int8 a sign extension; the fp8 formats become the
    float16 of the same bits and go through ``fpext`` (F16C on x86, no float32 subnormal on
    the way, which would cost a microcode assist per element): e5m2 is float16's high byte,
    e4m3fn's exponent and mantissa land in a float16's, which reads them with bias 15 instead
    of 7 (the 2**8 folded into the row's scale; e4m3fn subnormals land on float16 subnormals
    of the same significand), and its NaN code 0x7f (the only one whose ``m + 1`` carries into
    bit 7) gets the float16 exponent's top bit, which makes it a NaN; float16 ``fpext``;
    bfloat16 a shift."""
    if fmt == INT8:
        for d in range(out.shape[0]):
            out[d] = np.float32(np.int8(codes[d])) * f
    elif fmt == F8_E4M3:
        f = f * np.float32(256.0)
        for d in range(out.shape[0]):
            c = np.int32(codes[d])
            m = c & 0x7F
            out[d] = _f16_to_f32(((c & 0x80) << 8) | (m << 7) | (((m + 1) & 0x80) << 7)) * f
    elif fmt == F8_E5M2:
        for d in range(out.shape[0]):
            out[d] = _f16_to_f32(np.int32(codes[d]) << 8) * f
    elif fmt == F16:
        for d in range(out.shape[0]):
            out[d] = _f16_to_f32(wide[d])
    else:
        for d in range(out.shape[0]):
            out[d] = _bf16_to_f32(wide[d])


@njit(fastmath=FASTMATH)
def _load_stored(src, st, sc, sst, fmt, table, s, b, row0, nrows, ring, page_size, n_pages, h,
                 dst, width):
    """Widening tile load: ``dst[t*width + d]`` = the float32 value of element ``d`` of logical
    row ``row0 + t`` of kv head ``h``, decoded as the tile loads (never a widened copy of the
    cache). ``src`` holds the stored bytes (flat uint8) of format ``fmt``: 8-bit codes (F8_E4M3,
    F8_E5M2, INT8; element strides ``st``), each row times its float32 scale from ``sc`` (flat,
    strides ``sst`` along batch / page, row / slot, head), read once per row; or 16-bit floats
    (F16, BF16; strides ``st`` in 16-bit elements, no scales). Paged (``page_size > 0``): the
    row lives in sequence ``s``'s pages (clamped into the pool); else in batch ``b``, wrapping
    at ``ring``."""
    wide = src[: src.size & ~1].view(np.uint16)
    f = np.float32(1.0)
    for t in range(nrows):
        r = row0 + t
        if page_size > 0:
            p = _page_at(table, s, r // page_size, n_pages)
            slot = r % page_size
            off = p * st[0] + slot * st[1] + h * st[2]
            so = p * sst[0] + slot * sst[1] + h * sst[2]
        else:
            if ring > 0 and r >= ring:
                r -= ring
            off = b * st[0] + r * st[1] + h * st[2]
            so = b * sst[0] + r * sst[1] + h * sst[2]
        if fmt < F16:
            f = sc[so]
        _widen_row(src[off:off + width], wide[off:off + width], fmt, f,
                   dst[t * width:(t + 1) * width])


@njit(fastmath=FASTMATH)
def _load_q(q, qc, qst, q_format, qb, qrow0, r0, nr, g, kvh, mult, qt, d_qk):
    """The query block, pre-scaled: ``qt[r*d_qk + d] = mult * q[qb, qrow0 + i, h, d]`` for
    packed row ``r`` (``i = (r0 + r) // g``, ``h = kvh * g + (r0 + r) % g``). ``q_format`` 0:
    ``q`` holds the compute dtype; F16 / BF16: ``qc`` holds q's bytes (flat uint8, element
    strides ``qst`` in 16-bit elements), widened as they load."""
    wide = qc[: qc.size & ~1].view(np.uint16)
    for r in range(nr):
        i = (r0 + r) // g
        h = kvh * g + (r0 + r) % g
        src = qb * qst[0] + (qrow0 + i) * qst[1] + h * qst[2]
        out = qt[r * d_qk:(r + 1) * d_qk]
        if q_format == F16:
            row16 = wide[src:src + d_qk]
            for d in range(d_qk):
                out[d] = _f16_to_f32(row16[d]) * mult
        elif q_format == BF16:
            row16 = wide[src:src + d_qk]
            for d in range(d_qk):
                out[d] = _bf16_to_f32(row16[d]) * mult
        else:
            qrow = q[src:src + d_qk]  # a slice: unit-stride loads the loop vectorises
            for d in range(d_qk):
                out[d] = qrow[d] * mult


@njit(fastmath=FASTMATH)
def _modify_scores(st, n, nr, s, kvh, r0, g, qpos0, kpos_lo, jb, wl, hi, softcap, alibi, mask,
                   full, unit):
    """Score modifiers on the key-major tile ``st[j * nr + r]`` (scores times ``unit``):
    softcap, ALiBi, additive mask, then causal / window; a hidden score becomes -inf
    (assigned, so a NaN in a hidden k never leaks)."""
    use_alibi = alibi.shape[0] > 0
    use_mask = mask.shape[0] > 0
    for j in range(n):
        kpos = kpos_lo + j
        base = j * nr
        if softcap > 0.0:
            for r in range(nr):
                st[base + r] = unit * softcap * math.tanh(st[base + r] / (unit * softcap))
        if use_alibi or use_mask:
            for r in range(nr):
                i = (r0 + r) // g
                h = kvh * g + (r0 + r) % g
                if use_alibi:
                    st[base + r] -= unit * alibi[s, h] * abs(qpos0 + i - kpos)
                if use_mask:
                    mv = mask[s, h, i, jb + j]
                    st[base + r] = NEG_INF if mv == NEG_INF else st[base + r] + unit * mv
        if not full:
            # visible iff kpos - hi <= qpos <= kpos + wl, qpos = qpos0 + (r0 + r) // g
            lo = 0
            if hi < BIG:
                lo = min(max((kpos - hi - qpos0) * g - r0, 0), nr)
            up = nr
            if wl < BIG:
                up = max(min((kpos + wl - qpos0 + 1) * g - r0, nr), 0)
            for r in range(lo):
                st[base + r] = NEG_INF
            for r in range(max(up, lo), nr):
                st[base + r] = NEG_INF


WORK_ALIGN = 16  # elements: every scratch tile starts 64-byte aligned (float32)


@njit()
def work_layout(block_m, block_n, d_qk, d_v):
    """int64 (12,): start offsets of the kernel's scratch tiles in ``work`` (Q block, K and V
    tile copies, scores, saved scores, O, then m, m_new, shift, l, alpha per row) and, last, the
    size ``work`` needs. Kept outside the kernel so one buffer per thread serves every call: a
    fresh ~0.6-1 MiB of tiles per call and thread was returned to the OS by malloc's trimming of
    the helper's arena and faulted back in on every call."""
    sizes = (block_m * d_qk, block_n * d_qk, block_n * d_v, block_m * block_n,
             block_m * block_n, block_m * d_v, block_m, block_m, block_m, block_m, block_m)
    lay = np.zeros(12, np.int64)
    for i in range(11):
        lay[i + 1] = lay[i] + -(-sizes[i] // WORK_ALIGN) * WORK_ALIGN
    return lay


@njit(fastmath=FASTMATH)
def _all_finite(x):
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            if not math.isfinite(x[i, d]):
                return False
    return True


@njit(nogil=True, fastmath=FASTMATH)
def flash_forward(q, k, v, qst, kst, vst, seq, tasks, g, scale, wl, wr, softcap, alibi, mask, ring,
                  sinks, block_m, block_n, counter, done, out, lse, part_o, part_ml, gemm_fn, jit,
                  table, page_size, n_pages, kc, vc, ksc, vsc, sst, kv_format, qc, q_format,
                  work):
    """Run every task; see the module docstring.

    ``q``, ``k``, ``v``: flat (1-D) query, key and value arrays; ``qst`` / ``kst`` / ``vst``
    int64 (4,) their element strides along (batch, row, head) and the row width (D, D, Dv
    contiguous elements): the (B, S, H, D) layout, or (B, H, S, D) memory seen through
    ``layout="bhsd"`` (rows of one head adjacent), which the tiles' BLAS calls read faster.
    ``seq`` int64 (n_seq, 9): q_batch, q_row0, q_len, k_batch, k_row0, k_len, q_pos0, k_pos0,
    causal_hi (BIG when not causal). Key / value tiles are read in place by BLAS
    (leading dimension: the row stride; no copy), except a tile that wraps around a ring buffer,
    which is copied first, and tiles stored in another dtype (``kv_format``), which are widened
    into the scratch tile. ``gemm_fn``: the address of BLAS ``sgemm`` / ``dgemm`` (the compute
    dtype's), called through :func:`_gemm`. ``jit`` int64 (4,): MKL JIT kernels (address,
    jitter) specialised to the full tile's ``Q K^T`` and ``P V`` shapes (0: none), used for full
    ``block_m x block_n`` tiles read in place.
    ``tasks`` int64 (n_tasks, 7): seq, kv head, first packed row, packed rows, first key, key
    end, partial-state slot (-1: write out / lse directly), costliest first: every thread
    running this function claims them in that order through the atomic ``counter[0]``
    (dynamic scheduling: a thread that another process delays takes fewer) and counts finished
    ones in ``done[0]``, which the caller waits for (never for a thread that found no task).
    ``alibi`` (n_seq, Hq) or (0, 0); ``mask`` additive (n_seq, Hq, Sq, Sk) view or (0, 0, 0, 0).
    ``sinks`` (Hq,) natural-log sink logits or (0,): folded into a row's final normalisation
    (:func:`_finish_row`), never into a partial state (merge_partials folds them after the
    merge).
    ``table`` int64 (n_seq, max_pages) and ``page_size`` > 0: k and v are page pools (flat,
    strides along page, slot, head) and logical key row ``r`` of sequence ``s`` is slot
    ``r % page_size`` of page ``table[s, r // page_size]`` (clamped into ``[0, n_pages)``); a
    tile whose pages follow each other in the pool is read in place, any other is gathered into
    the scratch tile first. ``page_size`` 0: not paged (``table`` (0, 0)).
    ``kv_format`` > 0: k and v are stored in another dtype than the compute dtype: a quantized
    cache (F8_E4M3, F8_E5M2, INT8) or float16 / bfloat16 (F16, BF16). ``kc`` / ``vc`` then hold
    their bytes (flat uint8, element strides ``kst`` / ``vst``; ``k`` and ``v`` are unused),
    ``ksc`` / ``vsc`` the 8-bit formats' float32 scales (flat, strides ``sst``), and every tile
    is widened (dequantized) into the scratch tile as it is loaded (:func:`_load_stored`),
    never as a copy of the whole input. 0: those are empty.
    ``q_format`` F16 / BF16: q is stored so; ``qc`` holds its bytes (``q`` unused) and the
    query block is widened as it loads (:func:`_load_q`). 0: ``q`` holds the compute dtype.
    ``work``: this thread's scratch, 1-D of the compute dtype, at least
    ``work_layout(block_m, block_n, D, Dv)[-1]`` elements, 64-byte aligned; no other thread
    uses it during the call.

    Scores are kept key-major (``S^T = K Q^T``) so the per-row softmax steps run elementwise
    across rows and vectorise. float32 scores are in log2 units (q pre-scaled by
    ``scale * log2(e)``, FlashAttention-2's exp2 trick); float64 in natural units.
    """
    _wide_vectors()  # the O rescale, Q load and epilogue loops
    d_qk = kst[3]
    d_v = vst[3]
    use_mask = mask.shape[0] > 0
    isz = out.itemsize
    k_ld = kst[1]  # the distance between rows of one kv head: BLAS's leading dimension
    v_ld = vst[1]
    k_base = np.int64(k.ctypes.data)
    v_base = np.int64(v.ctypes.data)
    f32 = out.itemsize == 4
    unit = LOG2E if f32 else 1.0
    n_tasks = tasks.shape[0]
    # scratch: every element is written before it is read (only [:rows] slices are used); it
    # lives in ``work``, the caller's per-thread buffer kept across calls (see work_layout)
    lay = work_layout(block_m, block_n, d_qk, d_v)
    qt = work[lay[0]:lay[1]]
    kt = work[lay[1]:lay[2]]
    vt = work[lay[2]:lay[3]]
    st = work[lay[3]:lay[4]]
    sb = work[lay[4]:lay[5]]
    ot = work[lay[5]:lay[6]]
    m_i = work[lay[6]:lay[7]]
    m_new = work[lay[7]:lay[8]]
    mu = work[lay[8]:lay[9]]
    l_i = work[lay[9]:lay[10]]
    alpha = work[lay[10]:lay[11]]
    bi = np.zeros(8, np.int32)
    bf = np.zeros(2, out.dtype)
    qt_addr = np.int64(qt.ctypes.data)  # BLAS operands by address (int64, not uint64)
    st_addr = np.int64(st.ctypes.data)
    ot_addr = np.int64(ot.ctypes.data)
    paged = page_size > 0
    # consecutive pages are consecutive rows only when the pool's page stride is page_size rows
    pool_flat = paged and kst[0] == page_size * k_ld and vst[0] == page_size * v_ld
    stored = kv_format > 0
    while True:
        t = _fetch_add(counter, 1)
        if t >= n_tasks:
            break
        s = tasks[t, 0]
        kvh = tasks[t, 1]
        r0 = tasks[t, 2]
        nr = tasks[t, 3]
        slot = tasks[t, 6]
        qb = seq[s, 0]
        qrow0 = seq[s, 1]
        qpos0 = seq[s, 6]
        kpos0 = seq[s, 7]
        hi = min(seq[s, 8], wr)
        # -- load the query block, pre-scaled; packed row r = i * G + head-in-group
        _load_q(q, qc, qst, q_format, qb, qrow0, r0, nr, g, kvh, scale * unit, qt, d_qk)
        qpos_lo = qpos0 + r0 // g
        qpos_hi = qpos0 + (r0 + nr - 1) // g
        # -- only key tiles that some row of the block can see (causal / window skipping)
        j_lo = tasks[t, 4]
        if wl < BIG:
            j_lo = max(j_lo, qpos_lo - wl - kpos0)
        j_hi = tasks[t, 5]
        if hi < BIG:
            j_hi = min(j_hi, qpos_hi + hi - kpos0 + 1)
        for r in range(nr):
            m_i[r] = NEG_INF
            l_i[r] = 0.0
        ot[: nr * d_v] = 0.0
        kb = seq[s, 3]
        for jb in range(j_lo, j_hi, block_n):
            n = min(block_n, j_hi - jb)
            row = seq[s, 4] + jb
            if ring > 0 and row >= ring:
                row -= ring
            copied = ring > 0 and row + n > ring  # the tile wraps: copy it
            if stored:
                # -- widen / dequantize as the tiles load: (scale *) value of each element
                lrow = seq[s, 4] + jb if paged else row
                _load_stored(kc, kst, ksc, sst, kv_format, table, s, kb, lrow, n, ring,
                             page_size, n_pages, kvh, kt, d_qk)
                _load_stored(vc, vst, vsc, sst, kv_format, table, s, kb, lrow, n, ring,
                             page_size, n_pages, kvh, vt, d_v)
                copied = True
                k_addr, k_lead = np.int64(kt.ctypes.data), d_qk
                v_addr, v_lead = np.int64(vt.ctypes.data), d_v
            elif paged:
                prow = _paged_start(table, s, row, n, page_size, n_pages) if pool_flat else -1
                copied = prow < 0
                if copied:
                    _load_paged(k, kst, table, s, row, n, page_size, n_pages, kvh, kt, d_qk)
                    _load_paged(v, vst, table, s, row, n, page_size, n_pages, kvh, vt, d_v)
                    k_addr, k_lead = np.int64(kt.ctypes.data), d_qk
                    v_addr, v_lead = np.int64(vt.ctypes.data), d_v
                else:
                    k_addr = k_base + (prow * k_ld + kvh * kst[2]) * isz
                    v_addr = v_base + (prow * v_ld + kvh * vst[2]) * isz
                    k_lead, v_lead = k_ld, v_ld
            elif copied:
                _load_rows(k, kst, kb, row, n, ring, kvh, kt, d_qk)
                _load_rows(v, vst, kb, row, n, ring, kvh, vt, d_v)
                k_addr, k_lead = np.int64(kt.ctypes.data), d_qk
                v_addr, v_lead = np.int64(vt.ctypes.data), d_v
            else:
                k_addr = k_base + (kb * kst[0] + row * k_ld + kvh * kst[2]) * isz
                v_addr = v_base + (kb * vst[0] + row * v_ld + kvh * vst[2]) * isz
                k_lead, v_lead = k_ld, v_ld
            # -- S^T (n x nr, row-major) = K_blk @ Q_blk^T: BLAS column-major
            #    S (nr x n) = Q^T' K^T', i.e. gemm('T', 'N'), K read in place
            full_tile = nr == block_m and n == block_n and not copied
            if full_tile and jit[0] != 0:
                _call_jit(jit[0], jit[1], qt_addr, k_addr, st_addr)
            else:
                _gemm(gemm_fn, True, False, nr, n, d_qk, 1.0, qt_addr, d_qk, k_addr, k_lead,
                      0.0, st_addr, nr, bi, bf)
            kpos_lo = kpos0 + jb
            kpos_hi = kpos_lo + n - 1
            full = kpos_hi - qpos_lo <= hi and kpos_lo - qpos_hi >= -wl and not use_mask
            if softcap > 0.0 or alibi.shape[0] > 0 or not full:
                _modify_scores(st, n, nr, s, kvh, r0, g, qpos0, kpos_lo, jb, wl, hi,
                               softcap, alibi, mask, full, unit)
            clean = full
            if not full:
                # a non-finite v in a partly hidden tile needs the -inf marks after exp
                if not copied and paged:
                    _load_paged(v, vst, table, s, row, n, page_size, n_pages, kvh, vt, d_v)
                elif not copied:
                    _load_rows(v, vst, kb, row, n, ring, kvh, vt, d_v)
                clean = _all_finite(vt[: n * d_v].reshape((n, d_v)))
                if not clean:
                    sb[: n * nr] = st[: n * nr]
            # -- online softmax: m_new = max(m, rowmax S), alpha = exp(m - m_new)
            m_new[:nr] = m_i[:nr]
            _col_max(st, n, nr, m_new)
            for r in range(nr):
                # a row that has seen only hidden keys keeps m = -inf: use 0 as its shift
                mu[r] = m_new[r] if m_new[r] != NEG_INF else 0.0
            if f32:
                for r in range(nr):
                    alpha[r] = _pow2(m_i[r] - mu[r])  # vectorised, unlike math.exp
            else:
                for r in range(nr):
                    alpha[r] = math.exp(m_i[r] - mu[r])
            for r in range(nr):
                l_i[r] *= alpha[r]
                m_i[r] = m_new[r]
            if f32:
                _exp2_f32(st, n, nr, mu, l_i)
            else:
                _exp_f64(st, n, nr, mu, l_i)
            # -- O = O * alpha + P @ V: rescale, then accumulate (gemm with beta = 1)
            for r in range(nr):
                a = alpha[r]
                for d in range(d_v):
                    ot[r * d_v + d] *= a
            if clean:
                # column-major O^T (d_v x nr) += V^T' P: gemm('N', 'T'), V in place
                if full_tile and jit[2] != 0:
                    _call_jit(jit[2], jit[3], v_addr, st_addr, ot_addr)
                else:
                    _gemm(gemm_fn, False, True, d_v, nr, n, 1.0, v_addr, v_lead, st_addr, nr,
                          1.0, ot_addr, d_v, bi, bf)
            else:
                # skip the hidden keys: never 0 * NaN
                for j in range(n):
                    for r in range(nr):
                        if sb[j * nr + r] != NEG_INF:
                            pj = st[j * nr + r]
                            for d in range(d_v):
                                ot[r * d_v + d] += pj * vt[j * d_v + d]
        # -- epilogue: out = O / l, lse = m + log(l); a row that saw nothing: 0, -inf
        for r in range(nr):
            i = (r0 + r) // g
            h = kvh * g + (r0 + r) % g
            li = l_i[r]
            if slot >= 0:
                for d in range(d_v):
                    part_o[slot, r, d] = ot[r * d_v + d]
                part_ml[slot, r, 0] = m_i[r] / unit
                part_ml[slot, r, 1] = li
            else:
                _finish_row(ot[r * d_v:(r + 1) * d_v], m_i[r] / unit, li, sinks, h,
                            out[qb, qrow0 + i, h], lse[qb, h, qrow0 + i:qrow0 + i + 1])
        _fetch_add(done, 1)  # the caller waits for this count, not for idle workers
    return 0


def empty_lse(bq, hq, sq, sinks, cdt):
    """``(bq, hq, sq)`` lse of rows that see no key: -inf, or their head's sink with ``sinks``
    (the empty-row rule of ``_finish_row``, for the rows no task reaches)."""
    if sinks.shape[0] == 0:
        return np.full((bq, hq, sq), -np.inf, cdt)
    return np.repeat(np.repeat(sinks[None, :, None], bq, 0), sq, 2)


@njit(fastmath=FASTMATH, inline="always")
def _finish_row(acc, m, li, sinks, h, out_row, lse_at):
    """out = acc / l, lse = m + log(l) of one row from its state (acc = sum p v, m in natural
    units, l = sum p); with ``sinks``, that state merged once with (0, sinks[h]): the sink's
    exp(sink - m) joins l. A row that saw nothing (l = 0): out 0, lse -inf (or the sink)."""
    d_v = out_row.shape[0]
    if sinks.shape[0] == 0:
        if li == 0.0:
            for d in range(d_v):
                out_row[d] = 0.0
            lse_at[0] = NEG_INF
            return
        inv = 1.0 / li
        for d in range(d_v):
            out_row[d] = acc[d] * inv
        lse_at[0] = m + math.log(li)
        return
    sk = float(sinks[h])
    if li == 0.0:
        for d in range(d_v):
            out_row[d] = 0.0
        lse_at[0] = sk
        return
    # m' = max(m, sink): one of the two exponentials is e^0 = 1 (one exp per row, not two)
    if m >= sk:
        mx, a, total = m, 1.0, li + math.exp(sk - m)
    else:
        mx, a = sk, math.exp(m - sk)
        total = li * a + 1.0
    inv = a / total
    for d in range(d_v):
        out_row[d] = acc[d] * inv
    lse_at[0] = mx + math.log(total)


@njit(fastmath=FASTMATH)
def merge_partials(seq, tasks, g, part_o, part_ml, out, lse, sinks):
    """Combine the split-key partial states ``(O, m, l)`` of each task, in slot order, and
    fold the sinks in once."""
    d_v = part_o.shape[2]
    acc = np.zeros(d_v, part_o.dtype)
    n_tasks = tasks.shape[0]
    t = 0
    while t < n_tasks:
        u = t
        while u + 1 < n_tasks and tasks[u + 1, 0] == tasks[t, 0] and \
                tasks[u + 1, 1] == tasks[t, 1] and tasks[u + 1, 2] == tasks[t, 2]:
            u += 1
        s = tasks[t, 0]
        kvh = tasks[t, 1]
        r0 = tasks[t, 2]
        qb = seq[s, 0]
        qrow0 = seq[s, 1]
        for r in range(tasks[t, 3]):
            i = (r0 + r) // g
            h = kvh * g + (r0 + r) % g
            m = NEG_INF
            for x in range(t, u + 1):
                mx = part_ml[tasks[x, 6], r, 0]
                m = mx if mx > m else m
            mu = m if m != NEG_INF else 0.0
            total = 0.0
            acc[:] = 0.0
            for x in range(t, u + 1):
                slot = tasks[x, 6]
                lx = part_ml[slot, r, 1]
                if lx == 0.0:
                    continue  # an empty partial state contributes nothing
                wgt = math.exp(part_ml[slot, r, 0] - mu)
                total += wgt * lx
                for d in range(d_v):
                    acc[d] += wgt * part_o[slot, r, d]
            _finish_row(acc, mu, total, sinks, h, out[qb, qrow0 + i, h],
                        lse[qb, h, qrow0 + i:qrow0 + i + 1])
        t = u + 1
