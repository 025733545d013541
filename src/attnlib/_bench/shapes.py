"""What ``attnlib bench`` measures: one frozen case per (task, shape, dtype), its FLOPs and bytes.

Counting conventions (the same for every backend, PyTorch included):

* prefill: ``4 * D * (visible query-key pairs)`` FLOPs per head and batch (two matmuls, 2 FLOPs per
  multiply-add); causal counts the visible pairs exactly (``S * (S + 1) / 2`` for ``Sq == Sk``).
  Bytes: q, k, v read once and out written once, the least any exact kernel must move.
* decode: one query token per sequence over a KV cache of ``L`` tokens (GQA): ``4 * B * Hq * L * D``
  FLOPs; bytes = the K and V cache read once, ``2 * B * L * Hkv * D * itemsize``.
* softmax: ``5`` FLOPs per element (max, subtract, exp, sum, scale); bytes = read + write.
* merge: ``n`` states merged, ``3`` FLOPs per element and state; bytes = every state read and
  one written (outputs and LSEs).

A *ladder* is a list of cases of one family, largest first, each about 4x less work than the one
before; ``attnlib bench`` climbs it from the bottom and stops where a backend gets too slow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "Case",
    "TASKS",
    "default_ladders",
    "parse_shape",
    "ladder",
]

TASKS = ("prefill", "decode", "softmax", "merge")
#: decode over a PagedKVCache (pages of PAGE_SIZE tokens from a shuffled free list), the same
#: counts as decode; asked for with ``--shape paged_decode=B,Hq,Hkv,L,D`` (not a default task)
PAGED_PAGE_SIZE = 16
DECODE_TASKS = ("decode", "paged_decode")


def _itemsize(dtype: str) -> int:
    return 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize


@dataclass(frozen=True)
class Case:
    """One benchmark case. Unused fields stay 0. ``S`` is the sequence (prefill, merge), ``L`` the
    cache length (decode); softmax uses ``rows`` x ``cols``; merge uses ``n`` states."""

    task: str
    dtype: str = "float32"
    B: int = 1
    H: int = 0
    Hkv: int = 0
    S: int = 0
    L: int = 0
    D: int = 0
    causal: bool = False
    rows: int = 0
    cols: int = 0
    n: int = 0
    kv_dtype: str = ""  # decode: the cache's kv_dtype (contract §10); "" stores dtype

    @property
    def kv_bytes(self) -> int:
        """Bytes of one cached K or V value (8-bit formats: 1)."""
        return 1 if self.kv_dtype else self.itemsize

    # ---- description ------------------------------------------------------------------------
    def dims(self) -> dict:
        """The fields that matter for this task (the JSON ``shape`` object)."""
        if self.task == "prefill":
            return {"B": self.B, "H": self.H, "Hkv": self.Hkv, "S": self.S, "D": self.D,
                    "causal": self.causal}
        if self.task in DECODE_TASKS:
            kv = {"kv_dtype": self.kv_dtype} if self.kv_dtype else {}
            return {"B": self.B, "Hq": self.H, "Hkv": self.Hkv, "L": self.L, "D": self.D, **kv}
        if self.task == "softmax":
            return {"rows": self.rows, "cols": self.cols}
        return {"n": self.n, "B": self.B, "S": self.S, "H": self.H, "D": self.D}

    def label(self) -> str:
        if self.task == "prefill":
            heads = f"H={self.H}" if self.Hkv == self.H else f"Hq={self.H} Hkv={self.Hkv}"
            c = " causal" if self.causal else ""
            return f"prefill B={self.B} {heads} S={self.S} D={self.D}{c} {self.dtype}"
        if self.task in DECODE_TASKS:
            name = self.task.replace("_", " ")
            kv = f" kv={self.kv_dtype}" if self.kv_dtype else ""
            return (f"{name} B={self.B} Hq={self.H} Hkv={self.Hkv} L={self.L} D={self.D} "
                    f"{self.dtype}{kv}")
        if self.task == "softmax":
            return f"softmax {self.rows}x{self.cols} {self.dtype}"
        return f"merge n={self.n} B={self.B} S={self.S} H={self.H} D={self.D} {self.dtype}"

    def ident(self) -> str:
        """The label as a test id that ``pytest -k`` accepts: ``prefill-B1-H8-S512-D64-float32``."""
        return self.label().replace("=", "").replace(" ", "-")

    # ---- work ---------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    def flops(self) -> float:
        if self.task == "prefill":
            pairs = self.S * (self.S + 1) / 2 if self.causal else float(self.S) * self.S
            return 4.0 * self.B * self.H * self.D * pairs
        if self.task in DECODE_TASKS:
            return 4.0 * self.B * self.H * self.L * self.D
        if self.task == "softmax":
            return 5.0 * self.rows * self.cols
        return 3.0 * self.n * self.B * self.S * self.H * self.D

    def nbytes(self) -> float:
        it = self.itemsize
        if self.task == "prefill":
            q_out = 2 * self.B * self.S * self.H * self.D
            kv = 2 * self.B * self.S * self.Hkv * self.D
            return float((q_out + kv) * it)
        if self.task in DECODE_TASKS:  # the cache read once (8-bit: its float32 scales too)
            scales = 4 if self.kv_dtype else 0
            return float(2 * self.B * self.L * self.Hkv * (self.D * self.kv_bytes + scales))
        if self.task == "softmax":
            return float(2 * self.rows * self.cols * it)
        states = (self.n + 1) * self.B * self.S * self.H
        return float(states * (self.D * it + 4))

    def input_bytes(self) -> int:
        """Host memory the inputs take (to keep --memory and the ladders honest)."""
        it = self.itemsize
        if self.task == "prefill":
            return self.B * self.S * (self.H + 2 * self.Hkv) * self.D * it
        if self.task in DECODE_TASKS:
            return 2 * self.B * self.L * self.Hkv * self.D * it
        if self.task == "softmax":
            return self.rows * self.cols * it
        return self.n * self.B * self.S * self.H * (self.D * it + 4)

    def naive_scores_bytes(self) -> int:
        """The size of the full score matrix a naive softmax(QK^T)V would materialise (float32)."""
        if self.task == "prefill":
            return self.B * self.H * self.S * self.S * 4
        if self.task in DECODE_TASKS:
            return self.B * self.H * self.L * 4
        return 0

    def family(self) -> str:
        """Cases of one family differ only in size (one ladder, one table section per size)."""
        c = " causal" if (self.task == "prefill" and self.causal) else ""
        return f"{self.task}{c} {self.dtype}"

    # ---- shrinking ----------------------------------------------------------------------------
    def smaller(self) -> Case | None:
        """The next case down the ladder (about 4x less work), or None at the bottom."""
        if self.task == "prefill":
            return replace(self, S=self.S // 2) if self.S >= 256 else None
        if self.task in DECODE_TASKS:
            if self.L >= 1024:
                return replace(self, L=self.L // 4)
            return replace(self, B=self.B // 2) if self.B >= 2 else None
        if self.task == "softmax":
            return replace(self, rows=self.rows // 4) if self.rows >= 64 else None
        return replace(self, S=self.S // 4) if self.S >= 64 else None


def ladder(top: Case, steps: int = 6) -> list[Case]:
    """``top`` and up to ``steps - 1`` smaller cases, largest first."""
    out = [top]
    while len(out) < steps:
        nxt = out[-1].smaller()
        if nxt is None:
            break
        out.append(nxt)
    return out


# ---- default sizes --------------------------------------------------------------------------
# CPU: sized so the fast CPU paths (numba, PyTorch) take tens of milliseconds a call and the
# memory-bound tasks move well over the last-level cache. GPU: about 100x the work.
_TOPS = {
    "cpu": {
        "prefill": dict(B=1, H=8, Hkv=8, S=2048, D=64),
        "decode": dict(B=1, H=32, Hkv=8, L=16384, D=128),
        "softmax": dict(rows=4096, cols=4096),
        "merge": dict(n=2, B=1, S=2048, H=32, D=128),
    },
    "gpu": {
        "prefill": dict(B=4, H=16, Hkv=16, S=4096, D=128),
        "decode": dict(B=8, H=32, Hkv=8, L=32768, D=128),
        "softmax": dict(rows=65536, cols=4096),
        "merge": dict(n=2, B=4, S=8192, H=32, D=128),
    },
    # tiny: a smoke test (the test suite, --size tiny) that runs in well under a second
    "tiny": {
        "prefill": dict(B=1, H=2, Hkv=2, S=128, D=32),
        "decode": dict(B=1, H=4, Hkv=2, L=256, D=32),
        "softmax": dict(rows=64, cols=256),
        "merge": dict(n=2, B=1, S=64, H=2, D=32),
    },
}


def default_ladders(
    profile: str, tasks: list[str], dtypes: list[str], causal: list[bool], steps: int = 6
) -> list[list[Case]]:
    """One ladder per (task, dtype, causal) for the machine ``profile`` ("cpu", "gpu", "tiny")."""
    out = []
    tops = _TOPS[profile]
    for task in tasks:
        for dtype in dtypes:
            flags = causal if task == "prefill" else [False]
            for c in flags:
                top = Case(task=task, dtype=dtype, causal=c, **tops[task])
                out.append(ladder(top, 1 if profile == "tiny" else steps))
    return out


_FIELDS = {
    "prefill": ("B", "H", "S", "D"),
    "decode": ("B", "H", "Hkv", "L", "D"),
    "paged_decode": ("B", "H", "Hkv", "L", "D"),
    "softmax": ("rows", "cols"),
    "merge": ("n", "B", "S", "H", "D"),
}
SHAPE_HELP = (
    "TASK=DIMS, repeatable: prefill=B,H,S,D[,causal] (or B,Hq,Hkv,S,D[,causal]), "
    "decode=B,Hq,Hkv,L,D, paged_decode=B,Hq,Hkv,L,D, softmax=ROWS,COLS, merge=N,B,S,H,D"
)


def parse_shape(text: str, dtype: str) -> Case:
    """Parse one ``--shape`` value (see SHAPE_HELP); raises ValueError with the reason."""
    task, sep, rest = text.partition("=")
    task = task.strip()
    if not sep or task not in _FIELDS:
        raise ValueError(f"--shape {text!r}: expected {SHAPE_HELP}")
    parts = [p.strip() for p in rest.split(",") if p.strip()]
    causal = False
    if parts and parts[-1].lower() in ("causal", "c", "noncausal", "nc"):
        causal = parts.pop().lower() in ("causal", "c")
    fields = list(_FIELDS[task])
    if task == "prefill" and len(parts) == 5:
        fields = ["B", "H", "Hkv", "S", "D"]
    if len(parts) != len(fields):
        raise ValueError(f"--shape {text!r}: {task} takes {','.join(fields)}; see --help")
    try:
        vals = {f: int(p) for f, p in zip(fields, parts)}
    except ValueError:
        raise ValueError(f"--shape {text!r}: sizes must be integers") from None
    if any(v < 1 for v in vals.values()):
        raise ValueError(f"--shape {text!r}: sizes must be >= 1")
    if task == "prefill":
        vals.setdefault("Hkv", vals["H"])
    if task in ("prefill", *DECODE_TASKS) and vals["H"] % vals["Hkv"]:
        raise ValueError(f"--shape {text!r}: Hq must be a multiple of Hkv")
    return Case(task=task, dtype=dtype, causal=causal, **vals)
