"""Serving a small decoder from a PagedKVCache: continuous batching, forks and rollback.

    python examples/serving.py                         # the CPU (numba), float32
    python examples/serving.py --backend opencl --dtype float16   # a GPU through OpenCL
    python examples/serving.py --tiny --backend numpy  # seconds, for a check

A decoder with random numpy weights (token embedding, per layer RMSNorm, q / k / v projections,
rotary embedding, attention, output projection and a GELU MLP; logits through the embedding)
serves ``--requests`` sequences. One ``PagedKVCache`` per layer holds every live sequence; each
step is one packed call per layer (``attention_with_paged_kvcache`` with ``cu_seqlens_q``) that
appends and attends the rows of every sequence in the batch at once:

* **continuous batching**: at most ``--batch`` sequences run at a time; a finished one leaves
  (its pages return to the pool) and a waiting request joins in the next step, its whole prompt
  as prefill rows beside the other sequences' single decode rows;
* **forks**: some requests sample a second continuation of their prompt; the fork shares the
  prompt's pages (no copy; a shared partial page is copied on its first append);
* **rollback**: some steps feed a sequence its sampled token and a draft token (speculative
  decoding's verify step), keep the logits of the first and drop the draft with ``truncate``.

At the end a few sequences (a fork, one that rolled back) are recomputed from their tokens alone
in fresh caches, one prefill each: the logits of their last step must match what the batched,
forked, rolled-back run produced. Prints tokens/s and the largest logit difference.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import attnlib


class Model:
    """Random-weight decoder: ``layers`` blocks of ``hq`` query / ``hkv`` kv heads of ``d``."""

    def __init__(self, rng, vocab, layers, hq, hkv, d, ffn):
        dm = hq * d
        self.hq, self.hkv, self.d, self.vocab = hq, hkv, d, vocab

        def w(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

        self.emb = rng.standard_normal((vocab, dm)).astype(np.float32)
        self.layers = [dict(wq=w(dm, hq * d), wk=w(dm, hkv * d), wv=w(dm, hkv * d),
                            wo=w(hq * d, dm), w1=w(dm, ffn), w2=w(ffn, dm))
                       for _ in range(layers)]
        self.rope = attnlib.RoPE()

    @staticmethod
    def _norm(x):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6)

    def forward(self, tokens, caches, ids, cu, dtype):
        """Logits (T, vocab) of the packed ``tokens`` (sequence b: rows cu[b]..cu[b+1], appended
        to the sequences ``ids[layer][b]`` of each layer's cache)."""
        x = self.emb[tokens]
        t = x.shape[0]
        for lw, cache, sids in zip(self.layers, caches, ids):
            h = self._norm(x)
            q = (h @ lw["wq"]).reshape(t, self.hq, self.d).astype(dtype)
            k = (h @ lw["wk"]).reshape(t, self.hkv, self.d).astype(dtype)
            v = (h @ lw["wv"]).reshape(t, self.hkv, self.d).astype(dtype)
            o = attnlib.attention_with_paged_kvcache(q, cache, sids, k, v, cu_seqlens_q=cu,
                                                     rope=self.rope)
            x = x + np.asarray(o, np.float32).reshape(t, -1) @ lw["wo"]
            h = self._norm(x) @ lw["w1"]
            x = x + (0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))) @ lw["w2"]
        return self._norm(x) @ self.emb.T


class Seq:
    """A live sequence: its id in each layer's cache, its tokens, what it still has to do."""

    def __init__(self, name, ids, tokens, pending, left, rng, fork=False):
        self.name, self.ids, self.tokens = name, ids, list(tokens)
        self.fork_after_prefill = fork  # sample a second continuation once the prompt is in
        self.pending = list(pending)  # rows to feed next step (a prompt, or the last token)
        self.left, self.rng = left, rng
        self.rolled_back = False
        self.last_logits = None

    def sample(self, logits):
        p = np.exp((logits - logits.max()) / 0.8)
        return int(self.rng.choice(logits.shape[0], p=p / p.sum()))


def serve(args):
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    model = Model(rng, args.vocab, args.layers, args.hq, args.hkv, args.d, args.ffn)
    caches = [attnlib.PagedKVCache(args.pages, args.page_size, args.hkv, args.d, dtype=dtype,
                                   backend=args.backend) for _ in range(args.layers)]
    waiting = [(f"r{i}", rng.integers(0, args.vocab, rng.integers(*args.prompt)).tolist(),
                int(rng.integers(*args.new)), i % 4 == 1) for i in range(args.requests)]
    running, done = [], []
    generated, steps = 0, 0
    t0 = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < args.batch:  # join
            name, prompt, n_new, fork = waiting.pop(0)
            ids = [c.new_sequence() for c in caches]
            running.append(Seq(name, ids, [], prompt, n_new, np.random.default_rng(len(done)),
                               fork))
        draft = {}  # rollback: every 5th step, the oldest decoding sequence feeds a draft too
        if steps % 5 == 4:
            dec = [s for s in running if len(s.pending) == 1]
            if dec:
                draft[id(dec[0])] = int(rng.integers(0, args.vocab))
                dec[0].pending.append(draft[id(dec[0])])
        lens = [len(s.pending) for s in running]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        tokens = np.concatenate([s.pending for s in running])
        ids = [[s.ids[layer] for s in running] for layer in range(args.layers)]
        logits = model.forward(tokens, caches, ids, cu, dtype)
        steps += 1
        joined = []
        for b, s in enumerate(running):
            s.tokens += s.pending
            row = cu[b + 1] - 1
            if id(s) in draft:  # verify step: keep the first row's logits, drop the draft
                row -= 1
                for c, i in zip(caches, s.ids):
                    c.truncate(i, len(s.tokens) - 1)
                s.tokens.pop()
                s.rolled_back = True
            s.last_logits = logits[row]
            tok = s.sample(logits[row])
            s.pending, s.left = [tok], s.left - 1
            generated += 1
            if s.fork_after_prefill:  # a second continuation of the prompt
                s.fork_after_prefill = False
                child = Seq(s.name + "-fork", [c.fork(i) for c, i in zip(caches, s.ids)],
                            s.tokens, [s.sample(logits[row])], s.left, s.rng)
                child.last_logits = logits[row]
                joined.append(child)
                generated += 1
        for s in running:
            if s.left <= 0:  # leave: the pages go back to the pool
                for c, i in zip(caches, s.ids):
                    c.free(i)
                done.append(s)
        running = [s for s in running if s.left > 0] + joined
    elapsed = time.perf_counter() - t0
    return model, done, generated, steps, elapsed, caches


def check(model, done, args):
    """Recompute a fork's and a rolled-back sequence's last step from their tokens alone."""
    dtype = np.dtype(args.dtype)
    picks = [s for s in done if s.name.endswith("-fork")][:1]
    picks += [s for s in done if s.rolled_back][:1]
    worst = 0.0
    for s in picks:
        caches = [attnlib.PagedKVCache(args.pages, args.page_size, args.hkv, args.d, dtype=dtype,
                                       backend=args.backend) for _ in range(args.layers)]
        ids = [[c.new_sequence()] for c in caches]
        n = len(s.tokens)
        logits = model.forward(np.array(s.tokens), caches, ids,
                               np.array([0, n], np.int32), dtype)
        scale = np.abs(s.last_logits).max()
        worst = max(worst, float(np.abs(logits[-1] - s.last_logits).max() / scale))
    return len(picks), worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="sequences running at once")
    ap.add_argument("--tiny", action="store_true", help="small sizes (a quick check)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tiny:
        args.vocab, args.layers, args.hq, args.hkv, args.d, args.ffn = 64, 2, 4, 2, 16, 64
        args.prompt, args.new, args.page_size, args.pages = (3, 12), (3, 8), 4, 256
    else:
        args.vocab, args.layers, args.hq, args.hkv, args.d, args.ffn = 512, 4, 8, 2, 64, 1024
        args.prompt, args.new, args.page_size, args.pages = (32, 256), (16, 64), 16, 2048
    model, done, generated, steps, elapsed, caches = serve(args)
    free = [c.num_free_pages for c in caches]
    print(f"served {len(done)} sequences ({args.requests} requests and their forks) in {steps} "
          f"steps: {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tokens/s "
          f"[{args.backend}, {args.dtype}]")
    print(f"pages free after serving: {free[0]} of {args.pages} per layer")
    n, worst = check(model, done, args)
    print(f"recomputed {n} sequences from their tokens: max |logit diff| / max |logit| = "
          f"{worst:.2e}")
    return done, free, worst


if __name__ == "__main__":
    main()
