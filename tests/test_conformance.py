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
from attnlib.testing.test_random import *  # noqa: F401,F403
from attnlib.testing.test_rope import *  # noqa: F401,F403
from attnlib.testing.test_varlen import *  # noqa: F401,F403
