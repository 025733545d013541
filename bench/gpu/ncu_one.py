"""One tensor-core prefill call and one decode call, for a profiler to attach to
(``ncu --target-processes all python3 bench/gpu/ncu_one.py``): fp16, (1,16,8192,128) not
causal through ``_nvidia_mma.run`` (``--extra -DNAME=V`` adds build options), then a decode step
(B=1, 8192 tokens, 32 q / 8 kv heads, D=128) through ``attention_with_kvcache``.
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    import attnlib
    from attnlib import _spec
    from attnlib.backends.opencl import _nvidia_mma as nv

    be = attnlib.get_backend("opencl")
    queue, ctx, dev = be.queue, be.context, be.device
    rng = np.random.default_rng(0)
    b, h, s, d = 1, 16, 8192, 128
    x = [attnlib.to_device(rng.standard_normal((b, s, h, d), dtype=np.float32)
                           .astype(np.float16), backend=be) for _ in range(3)]
    call = _spec.dense_call(*x, scale=None, mask=None, layout="bshd", need_lse=False,
                            alibi_slopes=None, causal=False, window=None, softcap=None)
    for _ in range(2):
        nv.run(ctx, queue, dev, call, extra_options=tuple(args.extra))
    queue.finish()
    if not args.skip_decode:
        cache = attnlib.KVCache(1, 8192, 8, 128, dtype="float16", backend=be)
        kh = rng.standard_normal((1, 8192, 8, 128), dtype=np.float32).astype(np.float16)
        cache.update(kh, kh, 0)
        qd = attnlib.to_device(rng.standard_normal((1, 1, 32, 128), dtype=np.float32)
                               .astype(np.float16), backend=be)
        for _ in range(2):
            attnlib.attention_with_kvcache(qd, cache)
        queue.finish()
    print("done")


if __name__ == "__main__":
    main()
