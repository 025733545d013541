"""attnlib: exact attention that is fast on any hardware.

FlashAttention-style tiled attention with an online softmax (no Sq x Sk matrix in memory), the
online-softmax primitives, and KV caches (contiguous and paged) for decoding, behind one
backend-agnostic API.
"""

from ._api import (
    RoPE,
    attention,
    attention_varlen,
    logsumexp,
    merge_states,
    rope,
    softmax,
    to_device,
    to_numpy,
)
from ._online import OnlineAttention
from ._plans import forget_plans
from .errors import (
    ArgumentError,
    AttnlibError,
    BackendUnavailableError,
    CacheOverflowError,
    DTypeError,
    KernelBuildError,
    ShapeError,
    UnsupportedError,
)
from .kv_cache import KVCache, attention_with_kvcache
from .paged_cache import PagedKVCache, attention_with_paged_kvcache, paged_attention
from .registry import (
    available_backends,
    get_backend,
    register_backend,
    set_backend,
    use_backend,
)

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "softmax",
    "logsumexp",
    "merge_states",
    "OnlineAttention",
    "KVCache",
    "PagedKVCache",
    "attention_with_paged_kvcache",
    "paged_attention",
    "rope",
    "RoPE",
    "to_device",
    "to_numpy",
    "available_backends",
    "get_backend",
    "register_backend",
    "set_backend",
    "use_backend",
    "forget_plans",
    "AttnlibError",
    "ShapeError",
    "DTypeError",
    "ArgumentError",
    "UnsupportedError",
    "BackendUnavailableError",
    "CacheOverflowError",
    "KernelBuildError",
    "__version__",
]
