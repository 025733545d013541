"""pytest plugin that runs attnlib's conformance suite against chosen backends.

Registered as the ``pytest11`` entry point ``attnlib``, so it loads in every pytest session of an
environment where attnlib is installed; it therefore imports nothing heavy at import time and only
touches tests that ask for the ``attnlib_backend`` argument.

Backends under test, first that applies:

1. ``--attnlib-backend NAME[,NAME...]`` (repeatable). A ``NAME`` may also be ``module:Class``
   (or ``module.sub:Class``): the class is imported and registered with
   :func:`attnlib.register_backend` under its ``name`` attribute, so a third party runs::

       python -m pytest --pyargs attnlib.testing --attnlib-backend mypkg.backend:MyBackend

2. the environment variable ``ATTNLIB_TEST_BACKENDS`` (same syntax, comma-separated);
3. :func:`attnlib.available_backends` (every backend that can run here).

``--attnlib-xfail FILE`` adds a file of known gaps (see :mod:`attnlib.testing.xfails`).
``ATTNLIB_TEST_EXAMPLES=N`` runs N Hypothesis examples per random test instead of 25 (the random
cases are derandomized, so a run is reproducible). With plugin autoloading disabled
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), load it by hand: ``pytest -p attnlib.testing.plugin``.
"""

from __future__ import annotations

import pytest

_STASH_KEY = pytest.StashKey[list]()
ENV_VAR = "ATTNLIB_TEST_BACKENDS"


def _env_backends() -> str:
    """ATTNLIB_TEST_BACKENDS as set ("" when unset), read in attnlib._config."""
    from attnlib._config import test_backends_value

    return test_backends_value()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnlib", "attnlib conformance suite")
    group.addoption(
        "--attnlib-backend",
        action="append",
        default=None,
        metavar="NAME",
        help="backend(s) to run the attnlib conformance suite on: registered names or "
        f"module:Class, comma-separated or repeated (default: ${ENV_VAR}, else every "
        "available backend)",
    )
    group.addoption(
        "--attnlib-xfail",
        action="append",
        default=None,
        metavar="FILE",
        help="file of known gaps: lines 'backend  test-name-substring  reason'",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slow: one of the few large conformance cases (1023x1024, S=2048, Sq = Sk = 10007); "
        "`attnlib check` deselects them with -m 'not slow'",
    )
    if config.getoption("--attnlib-backend", default=None) or _env_backends().strip():
        backends_under_test(config)  # a bad name is a usage error now, not one per test module


def _split(values: list[str]) -> list[str]:
    names: list[str] = []
    for value in values:
        names.extend(part.strip() for part in value.split(",") if part.strip())
    return names


def _resolve(spec: str) -> str:
    """Turn ``module:Class`` into a registered backend name; known plain names pass through (an
    unavailable one stays: its cases then fail, never skip)."""
    import importlib

    import attnlib
    from attnlib import registry

    if ":" not in spec:
        if spec not in registry.known_backends():
            raise pytest.UsageError(
                f"--attnlib-backend / ${ENV_VAR}: unknown backend {spec!r}; known: "
                f"{', '.join(registry.known_backends())}, or give module:Class"
            )
        return spec

    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise pytest.UsageError(f"--attnlib-backend {spec!r}: cannot import it ({err})") from err
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name in ("base", "auto"):
        name = spec
    if name in registry.known_backends():
        try:
            same = attnlib.get_backend(name).__class__ is cls
        except Exception:
            same = False
        if same:
            return name
        name = spec  # never shadow another backend of the same name
    attnlib.register_backend(name, cls)
    return name


def backends_under_test(config: pytest.Config) -> list[str]:
    """The backend names this session tests (resolved once, then cached on the config)."""
    if _STASH_KEY in config.stash:
        return config.stash[_STASH_KEY]
    option = config.getoption("--attnlib-backend", default=None)
    if option:
        specs = _split(option)
    elif _env_backends().strip():
        specs = _split([_env_backends()])
    else:
        import attnlib

        specs = list(attnlib.available_backends())
    names = list(dict.fromkeys(_resolve(spec) for spec in specs))
    config.stash[_STASH_KEY] = names
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "attnlib_backend" in metafunc.fixturenames:
        names = backends_under_test(metafunc.config)
        metafunc.parametrize("attnlib_backend", names, ids=[f"be={n}" for n in names])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("attnlib_backend" in getattr(item, "fixturenames", ()) for item in items):
        return
    from attnlib.testing.xfails import apply_xfails

    apply_xfails(config, items)


def pytest_report_header(config: pytest.Config) -> str | None:
    # only when asked for explicitly: resolving the default imports attnlib in every session
    if config.getoption("--attnlib-backend", default=None) or _env_backends():
        return f"attnlib backends under test: {', '.join(backends_under_test(config))}"
    return None
