"""Context-parallel calls (contract §9): shardings, array kinds, head groups, sharded caches."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ArgumentError, DTypeError, ShapeError
from ._arrays import is_device_array

SHARDINGS = ("contiguous", "zigzag")


def check_sharding(sharding: Any) -> str:
    if sharding not in SHARDINGS:
        raise ArgumentError(
            f"sharding={sharding!r} is not supported; expected 'contiguous' or 'zigzag'"
        )
    return sharding


def check_dist_arrays(arrays: dict[str, Any]) -> bool:
    """The arrays of one distributed call are all numpy arrays or all device arrays (pyopencl);
    True for device arrays."""
    kinds = {name: is_device_array(x) for name, x in arrays.items()}
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray) and not kinds[name]:
            raise DTypeError(
                f"{name} must be a numpy array or a device array (pyopencl.array.Array), got "
                f"{type(x).__name__}"
            )
    if len(set(kinds.values())) > 1:
        dev = [n for n, d in kinds.items() if d]
        host = [n for n, d in kinds.items() if not d]
        raise DTypeError(
            f"{', '.join(dev)} are device arrays but {', '.join(host)} are numpy arrays; "
            "attnlib.distributed takes one kind per call (attnlib.to_device / to_numpy)"
        )
    return any(kinds.values())


def check_device_contiguous(x: Any, name: str) -> None:
    """A 3-D device array (an lse) is C-contiguous: it crosses MPI as one block of bytes."""
    if is_device_array(x) and len(x.shape) == 3 and not x.flags.c_contiguous:
        raise ShapeError(
            f"{name} is a strided device view of shape {tuple(x.shape)}; a 3-D device array "
            "must be C-contiguous here (as attnlib returns every lse)"
        )


def check_self_attention(q_shape: tuple, k_shape: tuple, sharding: str) -> None:
    """q, k and v are shards of one sequence: same (B, S_l); zigzag shards hold 2 equal chunks."""
    if tuple(k_shape[:2]) != tuple(q_shape[:2]):
        raise ShapeError(
            f"k_l holds (B, S_l) = {tuple(k_shape[:2])} but q_l holds {tuple(q_shape[:2])}; "
            "context-parallel attention is self-attention: q, k and v are shards of one sequence"
        )
    if sharding == "zigzag" and q_shape[1] % 2:
        raise ShapeError(
            f"q_l has {q_shape[1]} tokens; a zigzag shard holds two equal chunks, so the "
            "count must be even"
        )


def check_head_groups(hq: int, hkv: int, size: int) -> None:
    """Ulysses gives each of the ``size`` ranks ``Hq / P`` query and ``Hkv / P`` kv heads."""
    if hq % size or hkv % size:
        raise ShapeError(
            f"ulysses_attention splits heads over {size} ranks, but q_l has Hq={hq} and k_l "
            f"Hkv={hkv} heads; both must be multiples of {size} (ring_attention has no such "
            "limit)"
        )


def check_sharded_held(lengths: np.ndarray, sq: int) -> None:
    """Every sequence holds at least Sq tokens over all ranks together (``lengths (P, B)``)."""
    total = lengths.sum(axis=0)
    short = np.flatnonzero(total < sq)
    if short.size:
        b = int(short[0])
        raise ShapeError(
            f"q has Sq={sq} rows but batch row {b} holds only {int(total[b])} tokens over all "
            f"ranks ({lengths[:, b].tolist()} per rank); Sq must be <= each sequence's length"
        )


def check_no_rope(rope: Any) -> None:
    if rope is not None:
        raise ArgumentError(
            "rope= is not taken by attention_with_sharded_kvcache: each rank's cache does not "
            "know its tokens' global positions when it writes them; rotate q and k with "
            "attnlib.rope at their global positions before the call"
        )
