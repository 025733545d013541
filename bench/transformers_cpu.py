"""A Hugging Face transformers model on the CPU with attn_implementation "attnlib", "sdpa" and
"eager" (bench/RESULTS.md, "CPU: a transformers model").

    python bench/transformers_cpu.py                # prefill S=2048, then 128 generated tokens
    python bench/transformers_cpu.py --reps 5 --backend numba
    python bench/transformers_cpu.py --smoke        # tiny sizes, each path once (CI)

One process, one Llama-family model (random weights from its config: GQA, RoPE, causal; nothing
downloaded), the same inputs for each implementation. Prefill: one forward pass over a batch of
``--batch`` x ``--seq`` tokens. Generation: greedy ``generate`` of ``--new`` tokens after a
``--prompt``-token prompt (prefill of the prompt included; exactly ``--new`` tokens, no early
stop). The implementations alternate within each repeat, so load from other processes hits all
alike; the median of the repeats is printed, with each implementation's time over attnlib's
(> 1: attnlib faster). Before timing, the generated tokens of every implementation are compared
with eager's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

IMPLS = ("attnlib", "sdpa", "eager")


def _model(args):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, args.prompt
                                                                       + args.new) + 8)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048, help="prefill tokens (default 2048)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128, help="prompt before generation")
    p.add_argument("--new", type=int, default=128, help="generated tokens (default 128)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backend", default=None, help="attnlib backend (default: attnlib's choice)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.prompt, args.new, args.layers, args.hidden, args.heads = 33, 7, 5, 1, 64, 4
        args.vocab, args.reps = 97, 1

    import torch

    import attnlib
    import attnlib.integrations.transformers as attnlib_hf
    from attnlib import _config

    attnlib_hf.register(args.backend)
    backend = attnlib.get_backend(args.backend or "auto").name
    model = _model(args)
    gen = torch.Generator().manual_seed(1)
    prefill_ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=gen)
    prompt_ids = torch.randint(1, args.vocab, (1, args.prompt), generator=gen)

    def prefill():
        with torch.no_grad():
            model(input_ids=prefill_ids)

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=prompt_ids, max_new_tokens=args.new,
                                  min_new_tokens=args.new, do_sample=False)

    tokens = {}
    for impl in IMPLS:  # first calls (JIT compile) untimed; the tokens agree
        model.set_attn_implementation(impl)
        prefill()
        tokens[impl] = generate()
    for impl in IMPLS:
        if not torch.equal(tokens[impl], tokens["eager"]):
            print(f"generated tokens of {impl} differ from eager's", file=sys.stderr)
            return 1

    times = {(impl, task): [] for impl in IMPLS for task in ("prefill", "generate")}
    for _ in range(args.reps):
        for impl in IMPLS:
            model.set_attn_implementation(impl)
            times[impl, "prefill"].append(_time(prefill))
            times[impl, "generate"].append(_time(generate))

    # libgomp's spinning after each PyTorch op changes the result (bench/numba_vs_torch.py)
    omp = _config.shown_variables(("OMP_WAIT_POLICY",)).get("OMP_WAIT_POLICY", "unset")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), attnlib backend {backend}, "
          f"OMP_WAIT_POLICY={omp}")
    print(f"# Llama-family: {args.layers} layers, hidden {args.hidden}, {args.heads} heads / "
          f"{args.kv_heads} kv heads (head dim {args.hidden // args.heads}), float32; median of "
          f"{args.reps}")
    print(f"| task | {' | '.join(IMPLS)} | sdpa / attnlib | eager / attnlib |")
    print("|---|" + "---|" * (len(IMPLS) + 2))
    for task, what in (("prefill", f"prefill B={args.batch}, S={args.seq}"),
                       ("generate", f"generate {args.new} tokens (prompt {args.prompt})")):
        med = {impl: statistics.median(times[impl, task]) for impl in IMPLS}
        print(f"| {what} | " + " | ".join(f"{med[i]:.3f} s" for i in IMPLS)
              + f" | {med['sdpa'] / med['attnlib']:.2f} | {med['eager'] / med['attnlib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
