"""contract §5: which backend a call runs on, first that applies: ``backend=``, the innermost
``use_backend``, ``set_backend``, ``ATTNLIB_BACKEND`` (read at call time), ``"auto"``."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import attnlib
from attnlib.backends.numpy_backend import NumpyBackend
from attnlib.errors import ArgumentError, BackendUnavailableError, UnsupportedError

RAN: list[str] = []


def _spy(label):
    class Spy(NumpyBackend):
        name = label

        @classmethod
        def is_available(cls):
            return True

        @classmethod
        def auto_priority(cls):
            return 0  # never picked by "auto"

        def attention(self, call):
            RAN.append(label)
            return super().attention(call)

    return Spy


for _label in ("sel_arg", "sel_ctx", "sel_ctx_inner", "sel_global", "sel_env"):
    attnlib.register_backend(_label, _spy(_label))


class _Gone(NumpyBackend):
    name = "sel_gone"

    @classmethod
    def is_available(cls):
        return False


class _Refuses(NumpyBackend):
    name = "sel_refuses"

    @classmethod
    def is_available(cls):
        return True

    def unsupported_dtype_reason(self, dtype):
        return "this test backend runs no float16" if dtype == np.float16 else None


attnlib.register_backend("sel_gone", _Gone)
attnlib.register_backend("sel_refuses", _Refuses)

Q = np.random.default_rng(3).standard_normal((1, 3, 2, 4)).astype(np.float32)


def ran_on(**kw) -> str:
    RAN.clear()
    attnlib.attention(Q, Q, Q, **kw)
    return RAN[-1] if RAN else "not a spy"


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("ATTNLIB_BACKEND", raising=False)
    attnlib.set_backend(None)
    yield
    attnlib.set_backend(None)


def test_precedence_chain(monkeypatch):
    monkeypatch.setenv("ATTNLIB_BACKEND", "sel_env")
    assert ran_on() == "sel_env"
    attnlib.set_backend("sel_global")
    assert ran_on() == "sel_global"
    with attnlib.use_backend("sel_ctx"):
        assert ran_on() == "sel_ctx"
        with attnlib.use_backend("sel_ctx_inner"):
            assert ran_on() == "sel_ctx_inner"
            assert ran_on(backend="sel_arg") == "sel_arg"
        assert ran_on() == "sel_ctx"
    assert ran_on() == "sel_global"
    attnlib.set_backend(None)
    assert ran_on() == "sel_env"


def test_environment_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("ATTNLIB_BACKEND", "sel_env")
    assert ran_on() == "sel_env"
    monkeypatch.setenv("ATTNLIB_BACKEND", "sel_global")
    assert ran_on() == "sel_global"
    monkeypatch.delenv("ATTNLIB_BACKEND")
    assert ran_on() == "not a spy"  # "auto" never picks a priority-0 backend


def test_auto_follows_available_backends_order():
    avail = attnlib.available_backends()
    assert "numpy" in avail and "sel_gone" not in avail
    assert attnlib.get_backend("auto") is attnlib.get_backend(avail[0])
    if "numba" in avail:
        assert avail.index("numba") < avail.index("numpy")


def test_backend_instances_and_options():
    inst = attnlib.get_backend("sel_arg")
    assert attnlib.get_backend("sel_arg") is inst, "one default instance per name"
    assert ran_on(backend=inst) == "sel_arg"
    with attnlib.use_backend(inst):
        assert ran_on() == "sel_arg"


def test_use_backend_is_per_thread():
    seen = {}
    entered = threading.Event()
    release = threading.Event()

    def worker():
        with attnlib.use_backend("sel_ctx"):
            entered.set()
            release.wait(10)
            RAN.clear()
            attnlib.attention(Q, Q, Q)
            seen["worker"] = RAN[-1]

    attnlib.set_backend("sel_global")
    t = threading.Thread(target=worker)
    t.start()
    entered.wait(10)
    seen["main"] = ran_on()  # the worker's use_backend must not leak here
    release.set()
    t.join(10)
    assert seen == {"main": "sel_global", "worker": "sel_ctx"}


def test_use_backend_is_per_asyncio_task():
    async def task(label, delay):
        with attnlib.use_backend(label):
            await asyncio.sleep(delay)
            return ran_on()

    async def main():
        return await asyncio.gather(task("sel_ctx", 0.02), task("sel_ctx_inner", 0.0))

    assert asyncio.run(main()) == ["sel_ctx", "sel_ctx_inner"]


def test_unknown_names_list_the_valid_ones(monkeypatch):
    for fn in (lambda: attnlib.attention(Q, Q, Q, backend="nope"),
               lambda: attnlib.set_backend("nope"),
               lambda: attnlib.use_backend("nope").__enter__()):
        with pytest.raises(ArgumentError) as info:
            fn()
        assert "nope" in str(info.value) and "numpy" in str(info.value)
    monkeypatch.setenv("ATTNLIB_BACKEND", "nope")
    with pytest.raises(ArgumentError, match="numpy"):
        attnlib.attention(Q, Q, Q)


def test_unavailable_backend_is_an_error_not_a_fallback():
    assert "sel_gone" not in attnlib.available_backends()
    with pytest.raises(BackendUnavailableError):
        attnlib.attention(Q, Q, Q, backend="sel_gone")


def test_explicit_backend_never_falls_back():
    with pytest.raises(UnsupportedError, match="float16"):
        attnlib.attention(*(Q.astype(np.float16),) * 3, backend="sel_refuses")
    with attnlib.use_backend("sel_refuses"), pytest.raises(UnsupportedError):
        attnlib.softmax(Q.astype(np.float16))


def test_register_backend_rejects_what_is_not_a_backend():
    with pytest.raises(ArgumentError):
        attnlib.register_backend("sel_bad", object)
    with pytest.raises(ArgumentError):
        attnlib.register_backend("", _Refuses)


THIRD_PARTY = """
from attnlib.backends.numpy_backend import NumpyBackend


class MyBackend(NumpyBackend):
    name = "my_backend"
"""


def test_third_party_two_lines(tmp_path):
    """The README's second line, on a backend class that lives outside attnlib."""
    import os
    import subprocess
    import sys

    (tmp_path / "mypkg_sel").mkdir()
    (tmp_path / "mypkg_sel" / "__init__.py").write_text("")
    (tmp_path / "mypkg_sel" / "backend.py").write_text(THIRD_PARTY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    env.pop("ATTNLIB_TEST_BACKENDS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
           "attnlib.testing", "--attnlib-backend", "mypkg_sel.backend:MyBackend",
           "-k", "test_gqa_mqa or test_merge_of_empty_states"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "6 passed" in res.stdout, res.stdout[-2000:]


def test_entry_point_group_adds_backends_and_a_broken_one_only_warns(tmp_path):
    """Backends from the ``attnlib.backends`` entry-point group appear by name; a plug-in that
    fails to import warns and every other backend still works."""
    import os
    import subprocess
    import sys

    (tmp_path / "mypkg_ep.py").write_text(THIRD_PARTY)
    info = tmp_path / "mypkg_ep-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg-ep\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[attnlib.backends]\nmy_ep = mypkg_ep:MyBackend\nbroken_ep = mypkg_missing:Nope\n")
    code = (
        "import warnings, numpy as np, attnlib\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    names = attnlib.available_backends()\n"
        "x = np.ones((1, 2, 1, 4), np.float32)\n"
        "out = attnlib.attention(x, x, x, backend='my_ep')\n"
        "print('my_ep' in names, 'broken_ep' in names, 'numpy' in names,\n"
        "      any('broken_ep' in str(m.message) for m in w), out.shape)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True", "False", "True", "True", "(1,", "2,", "1,", "4)"], (
        res.stdout + res.stderr[-2000:])


def test_known_gaps_file(tmp_path):
    """--attnlib-xfail FILE: one gap per line, comments allowed."""
    from attnlib.testing.xfails import Gap, read_gaps

    f = tmp_path / "gaps.txt"
    f.write_text("# backend  match  reason\nmy_backend  test_alibi  ALiBi not yet built  # soon\n")
    assert read_gaps(str(f)) == [Gap("my_backend", "test_alibi", "ALiBi not yet built")]


NO_FP64 = """
from attnlib.backends.numpy_backend import NumpyBackend


class NoFp64(NumpyBackend):
    name = "no_fp64"

    def unsupported_dtype_reason(self, dtype):
        return "no cl_khr_fp64 here" if dtype.name == "float64" else None


class NoFp16(NumpyBackend):
    name = "no_fp16"

    def unsupported_dtype_reason(self, dtype):
        return "no half" if dtype.name == "float16" else None
"""


def test_suite_accepts_unsupported_float64_and_nothing_else(tmp_path):
    """The suite lets a backend refuse float64 with UnsupportedError (the contract allows it) and
    fails one that refuses float16 (the contract does not): no silent skip either way."""
    import os
    import subprocess
    import sys

    (tmp_path / "mypkg_dt.py").write_text(NO_FP64)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    env.pop("ATTNLIB_TEST_BACKENDS", None)
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
            "attnlib.testing", "-k", "test_dtypes_and_layouts or test_varlen_dtypes"]
    ok = subprocess.run(base + ["--attnlib-backend", "mypkg_dt:NoFp64"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "12 passed" in ok.stdout, ok.stdout[-2000:] + ok.stderr[-2000:]
    bad = subprocess.run(base + ["--attnlib-backend", "mypkg_dt:NoFp16"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "3 failed" in bad.stdout, bad.stdout[-2000:]


def test_queue_is_short_for_the_opencl_backend_on_that_queue():
    """contract §4: ``KVCache(queue=q, ...)`` then ``cache.update(k, v, start_pos=0)`` runs as
    written on the caller's own pyopencl queue: the cache lives in that queue's context, the
    attention over it gives the reference's result; ``to_device(x, queue=q)`` too, and
    ``backend=get_backend("opencl", queue=q)`` beside ``queue=q`` is the same choice."""
    cl = pytest.importorskip("pyopencl")
    if "opencl" not in attnlib.available_backends():  # pragma: no cover - CI has PoCL
        pytest.skip("no OpenCL device")
    from attnlib.testing._helpers import qkv, rng_for
    from attnlib.testing.reference import reference_attention

    queue = cl.CommandQueue(cl.Context([attnlib.get_backend("opencl").device]))
    cache = attnlib.KVCache(queue=queue, max_batch_size=1, max_seq_len=2048, n_kv_heads=4,
                            head_dim=64)
    assert cache.backend.name == "opencl" and cache.backend.queue is queue
    assert cache.k.context == queue.context
    query, k_step, v_step = qkv(rng_for("queue="), 1, 1, 37, 8, 4, 64)
    cache.update(k_step, v_step, start_pos=0)
    out, lse = attnlib.attention_with_kvcache(query, cache, return_lse=True)
    ref, ref_lse = reference_attention(query, k_step, v_step, causal=True)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5, rtol=0)
    assert cache.lengths[0] == 37
    dev = attnlib.to_device(k_step, queue=queue)
    assert dev.queue is queue and np.array_equal(attnlib.to_numpy(dev), k_step)
    same = attnlib.KVCache(1, 16, 4, 64, queue=queue,
                           backend=attnlib.get_backend("opencl", queue=queue))
    assert same.backend.queue is queue
