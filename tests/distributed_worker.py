"""The MPI side of tests/test_distributed.py: one launch runs every case and reports per case.

    mpiexec -n P python -m mpi4py tests/distributed_worker.py OUT.jsonl BACKEND[,BACKEND...]

Every rank runs the cases in order (they are collective); rank 0 writes one JSON line per case to
``OUT.jsonl`` as soon as it is done: ``{"id": ..., "failures": [...]}``, so a case that hangs is
the first one without a line. Importing this module needs neither mpi4py nor MPI: the test reads
:func:`case_ids` from it.
"""

from __future__ import annotations

import json
import sys
import time
import zlib

import numpy as np

S = 40  # tokens: S / (2P) = 5 for P = 4, so zigzag chunks are odd-sized
B = 2

#: name -> (Hq, Hkv, D, Dv, dtype, layout, options); options as for attnlib.attention
ATTENTION = {
    "plain": (4, 2, 17, 17, "float32", "bshd", {}),
    "causal_dv": (4, 2, 19, 11, "float32", "bshd", {"causal": True}),
    "top_left_window": (2, 2, 16, 16, "float32", "bshd", {"causal": "top_left", "window": (6, 3)}),
    "window_mqa": (3, 1, 59, 8, "float32", "bshd", {"window": (5, 2)}),
    "softcap_alibi": (4, 2, 17, 17, "float32", "bshd",
                      {"causal": True, "softcap": 1.5, "scale": 0.3, "alibi": True}),
    "bhsd": (4, 2, 13, 9, "float32", "bhsd", {"causal": True, "window": (9, -1)}),
    "float16": (4, 2, 16, 16, "float16", "bshd", {"causal": True}),
    "bfloat16": (2, 1, 16, 16, "bfloat16", "bshd", {"causal": True, "alibi": True}),
    "float64": (2, 2, 17, 5, "float64", "bshd", {"causal": True, "window": (1, 0)}),
    "out_only": (2, 1, 8, 8, "float32", "bshd", {"causal": True, "return_lse": False}),
    "empty_sequence": (2, 2, 8, 8, "float32", "bshd", {"causal": True, "tokens": 0}),
}
#: ulysses_attention's cases (heads divide by 1, 2 and 4): name as for ATTENTION
ULYSSES = {
    "u_every_option": (8, 4, 13, 9, "float32", "bhsd",
                       {"causal": True, "window": (9, 3), "softcap": 1.5, "scale": 0.3,
                        "alibi": True}),
    "u_mqa_window": (4, 4, 17, 17, "float32", "bshd", {"window": (5, 2)}),
    "u_float16": (4, 4, 16, 16, "float16", "bshd", {"causal": True}),
    "u_bfloat16": (4, 4, 16, 16, "bfloat16", "bshd", {"causal": True, "alibi": True}),
}
#: device arrays (the opencl backend's, on each rank's device): ring and Ulysses cases
DEVICE = {
    "d_every_option": ULYSSES["u_every_option"],
    "d_bfloat16": ULYSSES["u_bfloat16"],
    "d_float16_out_only": (4, 4, 16, 16, "float16", "bshd",
                           {"causal": True, "return_lse": False}),
}
DEVICE_CASES = [f"d_every_option-{fn}-{sh}" for fn in ("ring", "ulysses")
                for sh in ("contiguous", "zigzag")] + [
    "d_bfloat16-ring-zigzag", "d_float16_out_only-ulysses-zigzag"]
#: decoding over caches sharded across ranks: name -> (Sq, options); rank r of P holds
#: 3 + 4 r prompt tokens of batch row 0 and 7 - r of row 1; the last rank appends Sq tokens
SHARDED_CACHE = {
    "kv_decode": (1, {}),
    "kv_window_alibi": (3, {"window": (6, 0), "alibi": True, "softcap": 2.0}),
}
MERGE = {  # name -> (dtype, layout, which ranks hold keys)
    "merge": ("float32", "bshd", "all"),
    "merge_bhsd_float16": ("float16", "bhsd", "all"),
    "merge_one_rank_holds_keys": ("float32", "bshd", "last"),
    "merge_no_keys": ("float32", "bshd", "none"),
}
#: error cases: name -> expected error class for P = 1 and for P > 1 (None: no error)
ERRORS = {
    "err_batch_differs": (None, "ShapeError"),
    "err_dtype_differs": (None, "DTypeError"),
    "err_causal_differs": (None, "ArgumentError"),
    "err_local_window": ("ArgumentError", "ArgumentError"),
    "err_unknown_backend": ("ArgumentError", "ArgumentError"),
    "err_odd_zigzag": ("ShapeError", "ShapeError"),
    "err_not_a_comm": ("ArgumentError", "ArgumentError"),
    "err_gather_differs": (None, "ShapeError"),
    "err_merge_local": ("ShapeError", "ShapeError"),
    "err_shard_uneven": ("ShapeError", "ShapeError"),
    "err_ulysses_heads": (None, "ShapeError"),
    "err_ulysses_window_differs": (None, "ArgumentError"),
    "err_kv_overflow": ("CacheOverflowError", "CacheOverflowError"),
}


def case_ids(backends: list[str]) -> list[str]:
    """Every case, in the order the worker runs them: errors first, so that the cases after
    them also show that a failed call leaves nothing behind."""
    ids = list(ERRORS) + ["shard_gather"]
    shardings = ("contiguous", "zigzag")
    for be in backends:
        ids += [f"{name}-{sh}-{be}" for name in ATTENTION for sh in shardings]
        ids += [f"{name}-{sh}-{be}" for name in ULYSSES for sh in shardings]
        ids += [f"{name}-{be}" for name in MERGE]
        ids += [f"{name}-{be}" for name in SHARDED_CACHE]
    if "opencl" in backends:
        ids += [f"{name}-device" for name in DEVICE_CASES]
        ids += ["shard_gather-device", "merge-device", "kv_decode-device"]
    return ids


def _rng(case: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case.encode()))  # the same data on every rank


def _dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _qkv(rng, hq, hkv, d, dv, dtype, layout, s=S, sq=None):
    shapes = [(B, s if sq is None else sq, hq, d), (B, s, hkv, d), (B, s, hkv, dv)]
    arrays = [rng.standard_normal(sh).astype(_dtype(dtype)) for sh in shapes]
    return [np.swapaxes(a, 1, 2) if layout == "bhsd" else a for a in arrays]


# ---- cases: each returns None (passed) or a failure message for this rank ---------------------
def run_attention(comm, case, config, sharding, backend, fn="ring", device=False):
    """``config`` of ATTENTION / ULYSSES / DEVICE through ``dist.<fn>_attention``; with
    ``device``, on device arrays of each rank's device (rank_backend), device arrays out."""
    import attnlib
    from attnlib import distributed as dist
    from attnlib.testing.reference import naive_attention, reference_attention
    from attnlib.testing.tolerance import check_attention

    hq, hkv, d, dv, dtype, layout, opts = config
    opts = dict(opts)
    return_lse = opts.pop("return_lse", True)
    rng = _rng(case)
    q, k, v = _qkv(rng, hq, hkv, d, dv, dtype, layout, s=opts.pop("tokens", S))
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, hq)).astype(np.float32)
    ref, ref_lse = reference_attention(q, k, v, layout=layout, **opts)
    naive, naive_lse = naive_attention(q, k, v, layout=layout, **opts)

    def mine(x):
        return dist.shard(x, comm, sharding=sharding, layout=layout)

    ins = [mine(x) for x in (q, k, v)]
    if device:  # sharded on the device, from the whole sequence there
        be = dist.rank_backend(comm)
        ins = [dist.shard(attnlib.to_device(x, backend=be), comm, sharding=sharding,
                          layout=layout) for x in (q, k, v)]
        backend = None
    attend = dist.ulysses_attention if fn == "ulysses" else dist.ring_attention
    got = attend(*ins, comm, sharding=sharding, layout=layout, return_lse=return_lse,
                 backend=backend, **opts)
    out, lse = got if return_lse else (got, None)
    kind = "Array" if device else "ndarray"
    if type(out).__name__ != kind or out.dtype != q.dtype:
        return f"out is {type(out).__name__} of {out.dtype}; expected {kind} of {q.dtype}"
    if device:
        if lse is not None and type(lse).__name__ != kind:
            return f"lse is {type(lse).__name__}; expected {kind}"
        out, lse = attnlib.to_numpy(out), None if lse is None else attnlib.to_numpy(lse)
    check_attention(out, lse, mine(ref), mine(naive), mine(ref_lse), mine(naive_lse))
    return None


def run_merge(comm, case, name, backend, device=False):
    import attnlib
    from attnlib import distributed as dist
    from attnlib.testing.reference import naive_attention, reference_attention
    from attnlib.testing.tolerance import check_attention

    dtype, layout, holders = MERGE[name]
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v = _qkv(_rng(case), 4, 2, 16, 12, dtype, layout, sq=3)
    axis = 2 if layout == "bhsd" else 1
    if holders == "all":  # a contiguous shard of the keys each, as in a sharded KV cache
        k_r, v_r = (dist.shard(x, comm, sharding="contiguous", layout=layout) for x in (k, v))
    else:
        keep = S if holders == "last" and rank == size - 1 else 0
        k_r, v_r = (np.take(x, np.arange(keep), axis=axis) for x in (k, v))
        if holders == "none":
            k, v = k_r, v_r
    if device:
        be = dist.rank_backend(comm)
        q_d, k_d, v_d = (attnlib.to_device(x, backend=be) for x in (q, k_r, v_r))
        o_r, lse_r = attnlib.attention(q_d, k_d, v_d, layout=layout, return_lse=True)
        out, lse = dist.merge_across(o_r, lse_r, comm, layout=layout)
        if type(out).__name__ != "Array" or type(lse).__name__ != "Array":
            return f"merge_across gave {type(out).__name__}, {type(lse).__name__}; expected Array"
        out, lse = attnlib.to_numpy(out), attnlib.to_numpy(lse)
    else:
        o_r, lse_r = attnlib.attention(q, k_r, v_r, layout=layout, return_lse=True,
                                       backend=backend)
        out, lse = dist.merge_across(o_r, lse_r, comm, layout=layout, backend=backend)
    ref, ref_lse = reference_attention(q, k, v, layout=layout)
    naive, naive_lse = naive_attention(q, k, v, layout=layout)
    if out.dtype != q.dtype or out.shape != q.shape[:3] + (12,):
        return f"out has {out.dtype} {out.shape}; expected {q.dtype} {q.shape[:3] + (12,)}"
    check_attention(out, lse, ref, naive, ref_lse, naive_lse)
    every = comm.allgather(out.tobytes() + lse.tobytes())
    if any(x != every[0] for x in every):
        return "merge_across gave different bits on different ranks"
    return None


def run_sharded_cache(comm, case, name, backend, device=False):
    """Two decode steps over caches sharded across ranks (uneven shards, a row empty on rank 0
    when P > 1), the last rank appending; against the reference over the whole sequence."""
    import attnlib
    from attnlib import distributed as dist
    from attnlib.testing.reference import naive_attention, reference_attention
    from attnlib.testing.tolerance import check_attention

    sq, opts = SHARDED_CACHE[name]
    opts = dict(opts)
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = _rng(case)
    hq, hkv, d = 4, 2, 16
    held = [[(3 + 4 * r) if (r or size == 1) else 0, 7 - r] for r in range(size)]
    prompt = [[rng.standard_normal((n, 2, hkv, d)).astype(np.float32) for n in row]
              for row in held]  # [rank][batch row]: (n, k and v, Hkv, D)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, hq)).astype(np.float32)
    be = dist.rank_backend(comm) if device else backend
    cache = attnlib.KVCache(B, 24, hkv, d, dtype="float32", backend=be)
    for b, kv in enumerate(prompt[rank]):
        if len(kv):
            cache.update(kv[None, :, 0], kv[None, :, 1], start_pos=0, batch_idx=np.array([b]))
    whole = [np.concatenate([prompt[r][b] for r in range(size)]) for b in range(B)]
    for _ in range(2):
        q = rng.standard_normal((B, sq, hq, d)).astype(np.float32)
        new = rng.standard_normal((B, sq, 2, hkv, d)).astype(np.float32)
        whole = [np.concatenate([w, new[b]]) for b, w in enumerate(whole)]
        kv = {"k": new[:, :, 0], "v": new[:, :, 1]} if rank == size - 1 else {}
        q_in = attnlib.to_device(q, backend=be) if device else q
        out, lse = dist.attention_with_sharded_kvcache(q_in, cache, comm, return_lse=True,
                                                       **kv, **opts)
        if device:
            out, lse = attnlib.to_numpy(out), attnlib.to_numpy(lse)
        for b in range(B):  # rows of different lengths: the reference per row
            k, v = whole[b][None, :, 0], whole[b][None, :, 1]
            kw = dict(opts, causal=True)
            if "alibi_slopes" in kw:
                kw["alibi_slopes"] = kw["alibi_slopes"][b]
            ref, ref_lse = reference_attention(q[b:b + 1], k, v, **kw)
            naive, naive_lse = naive_attention(q[b:b + 1], k, v, **kw)
            check_attention(out[b:b + 1], lse[b:b + 1], ref, naive, ref_lse, naive_lse)
    every = comm.allgather(out.tobytes() + lse.tobytes())
    if any(x != every[0] for x in every):
        return "attention_with_sharded_kvcache gave different bits on different ranks"
    return None


def run_shard_gather(comm, case, device=False):
    """Which tokens each rank holds, written out from the definition, and gather(shard(x)) == x
    for bshd, bhsd and lse arrays (``device``: device arrays in, device arrays out)."""
    import attnlib
    from attnlib import distributed as dist

    be = dist.rank_backend(comm) if device else None

    def kind(x):
        if device and type(x).__name__ != "Array":
            raise TypeError(f"a device array in gave {type(x).__name__}")
        return attnlib.to_numpy(x)

    rank, size = comm.Get_rank(), comm.Get_size()
    n = 2 * size
    c = S // n
    want = {"contiguous": list(range(rank * S // size, (rank + 1) * S // size)),
            "zigzag": list(range(rank * c, (rank + 1) * c))
            + list(range((n - 1 - rank) * c, (n - rank) * c))}
    tokens = np.arange(S, dtype=np.float32)
    arrays = {"bshd": np.broadcast_to(tokens[None, :, None, None], (B, S, 3, 2)),
              "bhsd": np.broadcast_to(tokens[None, None, :, None], (B, 3, S, 2)),
              "lse": np.broadcast_to(tokens[None, None, :], (B, 3, S))}
    for sharding, expected in want.items():
        for name, x in arrays.items():
            layout = "bhsd" if name == "bhsd" else "bshd"
            x = x + _rng(case).standard_normal(x.shape).astype(np.float32) * 1e-3
            x_in = attnlib.to_device(x, backend=be) if device else x
            part = dist.shard(x_in, comm, sharding=sharding, layout=layout)
            back = kind(dist.gather(part, comm, sharding=sharding, layout=layout))
            part = kind(part)
            held = np.rint(np.moveaxis(part, 1 if name == "bshd" else 2, 0)[:, 0, 0])
            if name != "lse":
                held = held[:, 0]
            if held.tolist() != expected:
                return f"{sharding} {name}: rank {rank} holds tokens {held.tolist()}"
            if not np.array_equal(back, x):
                return f"{sharding} {name}: gather(shard(x)) != x"
    return None


def run_error(comm, case, backend):
    """Each error case makes one rank (the last) or every rank call badly; returns the error
    this rank raised as (class name, message), or None."""
    import attnlib
    from attnlib import distributed as dist

    rank, size = comm.Get_rank(), comm.Get_size()
    odd = rank == size - 1
    heads = {"err_ulysses_heads": (6, 3), "err_ulysses_window_differs": (4, 4)}.get(case, (4, 2))
    q, k, v = _qkv(_rng(case), *heads, 8, 8, "float32", "bshd")
    q, k, v = (dist.shard(x, comm) for x in (q, k, v))
    kw = {"causal": True, "backend": backend}
    args = [q, k, v, comm]
    if case == "err_batch_differs" and odd:
        args[:3] = (x[:1] for x in args[:3])
    elif case == "err_dtype_differs" and odd:
        args[:3] = (x.astype(np.float64) for x in args[:3])
    elif case == "err_causal_differs" and odd:
        kw["causal"] = False
    elif case == "err_local_window" and odd:
        kw["window"] = (1.5, 2)
    elif case == "err_unknown_backend" and odd:
        kw["backend"] = "no-such-backend"
    elif case == "err_odd_zigzag":
        args[:3] = (x[:, :-1] for x in args[:3])
    elif case == "err_not_a_comm":
        args[3] = "COMM_WORLD"
    elif case == "err_ulysses_window_differs" and odd:
        kw["window"] = (3, 0)
    try:
        if case == "err_gather_differs":
            dist.gather(q[:, : 2 if odd else 4], comm)
        elif case == "err_merge_local":
            o, lse = attnlib.attention(q, k, v, return_lse=True, backend=backend)
            dist.merge_across(o, lse[:, :, :-1] if odd else lse, comm)
        elif case == "err_shard_uneven":
            dist.shard(np.ones((1, 2 * size + 1, 1, 1), np.float32), comm)
        elif case.startswith("err_ulysses"):
            dist.ulysses_attention(*args, **kw)
        elif case == "err_kv_overflow":  # the last rank's cache is full: no cache changes
            cache = attnlib.KVCache(1, 4, 2, 8, backend=backend)
            cache.update(k[:1, :4], v[:1, :4], start_pos=0)
            new = {"k": k[:1, :1], "v": v[:1, :1]} if odd else {}
            try:
                dist.attention_with_sharded_kvcache(q[:1, :1], cache, comm, **new)
            except attnlib.AttnlibError:
                if cache.lengths.tolist() != [4]:
                    return "CacheChanged", f"cache lengths {cache.lengths.tolist()}"
                raise
        else:
            dist.ring_attention(*args, **kw)
    except attnlib.AttnlibError as exc:
        return type(exc).__name__, str(exc)
    return None


def run(comm, case: str, backends: list[str]) -> list[str]:
    """The failures of one case, as rank 0 reports them (every rank returns its own list)."""
    size = comm.Get_size()
    failures: list[str] = []
    try:
        if case in ERRORS:
            want = ERRORS[case][0 if size == 1 else 1]
            got = run_error(comm, case, backends[0])
            if (got and got[0]) != want:
                failures.append(f"raised {got}; expected {want or 'no error'}")
            every = comm.allgather(got)
            if any(g != every[0] for g in every):
                failures.append(f"ranks raised different errors: {every}")
            return failures
        *name, backend = case.split("-") if "-" in case else (case, None)
        device = backend == "device"
        if device:
            backend = "opencl"
        if name[0] == "shard_gather":
            failure = run_shard_gather(comm, case, device)
        elif name[0] in MERGE:
            failure = run_merge(comm, case, name[0], backend, device)
        elif name[0] in SHARDED_CACHE:
            failure = run_sharded_cache(comm, case, name[0], backend, device)
        elif name[0] in ULYSSES:
            failure = run_attention(comm, case, ULYSSES[name[0]], name[1], backend, "ulysses")
        elif name[0] in DEVICE:
            failure = run_attention(comm, case, DEVICE[name[0]], name[2], backend, name[1],
                                    device=True)
        else:
            failure = run_attention(comm, case, ATTENTION[name[0]], name[1], backend)
    except Exception as exc:  # reported per case; the next case still runs
        failure = f"{type(exc).__name__}: {exc}"
    every = comm.allgather(failure)
    return [f"rank {r}: {f}" for r, f in enumerate(every) if f is not None]


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out_path, backends = sys.argv[1], sys.argv[2].split(",")
    with open(out_path, "w") if comm.Get_rank() == 0 else open("/dev/null", "w") as out:
        for case in case_ids(backends):
            t0 = time.perf_counter()
            failures = run(comm, case, backends)
            seconds = round(time.perf_counter() - t0, 3)
            out.write(json.dumps({"id": case, "failures": failures, "seconds": seconds}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
