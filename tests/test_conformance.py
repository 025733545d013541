"""The shipped conformance suite (attnlib.testing), run here over every backend under test.

Choose backends with ``--attnlib-backend numpy,numba`` or ``ATTNLIB_TEST_BACKENDS``; the default
is every available backend.
"""

from attnlib.testing.test_attention import *  # noqa: F401,F403
from attnlib.testing.test_edges import *  # noqa: F401,F403
from attnlib.testing.test_kvcache import *  # noqa: F401,F403
from attnlib.testing.test_kvcache_random import *  # noqa: F401,F403
from attnlib.testing.test_long import *  # noqa: F401,F403
from attnlib.testing.test_online import *  # noqa: F401,F403
from attnlib.testing.test_oracle import *  # noqa: F401,F403
from attnlib.testing.test_paged import *  # noqa: F401,F403
from attnlib.testing.test_paged_cascade import *  # noqa: F401,F403
from attnlib.testing.test_paged_random import *  # noqa: F401,F403
from attnlib.testing.test_quant_kv import *  # noqa: F401,F403
from attnlib.testing.test_random import *  # noqa: F401,F403
from attnlib.testing.test_rope import *  # noqa: F401,F403
from attnlib.testing.test_sinks import *  # noqa: F401,F403
from attnlib.testing.test_varlen import *  # noqa: F401,F403


def test_every_suite_module_is_run_here():
    """Each test module the package ships is imported above, so ``pytest tests`` runs it."""
    import pkgutil
    import sys

    import attnlib.testing

    shipped = {m.name for m in pkgutil.iter_modules(attnlib.testing.__path__)
               if m.name.startswith("test_")}
    here = {name.rsplit(".", 1)[1] for name in sys.modules
            if name.startswith("attnlib.testing.test_")}
    assert shipped <= here, sorted(shipped - here)
