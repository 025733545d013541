"""Hypothesis: random sequences of new / append / attend / fork / truncate / free on a
PagedKVCache against a plain-Python model of the pool (lengths, contents, which sequences share
which page, free pages) and plain attention over each sequence's tokens."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the random cases need hypothesis")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from attnlib.testing.strategies import SETTINGS  # noqa: E402
from attnlib.testing.test_paged import Paged  # noqa: E402

MAX_SEQS = 5


def _machine(backend: str):
    class PoolMachine(RuleBasedStateMachine):
        """The model names pages logically: fork shares the parent's logical pages; an append
        into a shared partial last page replaces it with a new one (copy-on-write); truncate
        and free drop pages. The real block tables must map logical pages one-to-one onto
        physical pages, and the free count is num_pages minus the logical pages held."""

        @initialize(cfg=st.fixed_dictionaries(dict(
            num_pages=st.integers(3, 14), page_size=st.sampled_from([1, 3, 4]),
            heads=st.sampled_from([(2, 1), (3, 3)]), dv=st.sampled_from([8, 5]),
            dtype=st.sampled_from(["float32", "float16"]), seed=st.integers(0, 2**31))))
        def start(self, cfg):
            hq, hkv = cfg["heads"]
            self.p = Paged(backend, cfg["num_pages"], cfg["page_size"], hq=hq, hkv=hkv, d=8,
                           dv=cfg["dv"], dtype=cfg["dtype"], seed=cfg["seed"])
            self.logical: dict[int, list[int]] = {}
            self.next_page = 0
            (s,) = self.p.new(1)
            self.logical[s] = []

        def ready(self):
            return hasattr(self, "p")

        def live(self):
            return list(self.logical)

        def _fresh(self):
            self.next_page += 1
            return self.next_page - 1

        def _holders(self, page):
            return sum(page in pages for pages in self.logical.values())

        def _need(self, sids, lens):
            """Pages an append of ``lens`` to ``sids`` needs, copies-on-write counted, and the
            logical page lists afterwards."""
            ps = self.p.page_size
            after = {s: list(pages) for s, pages in self.logical.items()}
            need = 0
            for s, n in zip(sids, lens):
                length = len(self.p.k[s])
                pages = after[s]
                if n and length % ps and sum(pages[-1] in x for x in after.values()) > 1:
                    pages[-1] = self._fresh()
                    need += 1
                extra = -(-(length + n) // ps) - len(pages)
                pages.extend(self._fresh() for _ in range(extra))
                need += extra
            return need, after

        @precondition(lambda self: hasattr(self, "p") and len(self.logical) < MAX_SEQS)
        @rule()
        def new(self):
            (s,) = self.p.new(1)
            self.logical[s] = []

        @precondition(lambda self: hasattr(self, "p") and self.logical)
        @rule(data=st.data())
        def append_or_attend(self, data):
            live = self.live()
            sids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live),
                                      unique=True))
            self._append_or_attend(data, sids)

        def _append_or_attend(self, data, sids):
            from attnlib.errors import CacheOverflowError

            lens = data.draw(st.lists(st.integers(0, 7), min_size=len(sids),
                                      max_size=len(sids)))
            attend = data.draw(st.booleans())
            need, after = self._need(sids, lens)
            free = self.p.num_pages - len({x for pages in self.logical.values() for x in pages})
            if need > free:
                before = self.p.state()
                with pytest.raises(CacheOverflowError):
                    self.p.append(sids, lens, packed=True)
                assert self.p.state() == before
                return
            if attend:
                kw = data.draw(st.sampled_from([{}, dict(window=(2, 0)), dict(softcap=3.0),
                                                dict(causal=False)]))
                self.p.attend(sids, lens, lens, **kw)
            else:
                self.p.append(sids, lens, packed=data.draw(st.booleans()) or len(set(lens)) > 1)
            self.logical = after

        @precondition(lambda self: hasattr(self, "p") and 0 < len(self.logical) < MAX_SEQS)
        @rule(data=st.data())
        def fork(self, data):
            s = data.draw(st.sampled_from(self.live()))
            child = self.p.fork(s)
            self.logical[child] = list(self.logical[s])
            if data.draw(st.booleans()):  # append to one of the two at once (copy-on-write)
                self._append_or_attend(data, data.draw(st.sampled_from([[s], [child],
                                                                        [child, s]])))

        @precondition(lambda self: hasattr(self, "p") and self.logical)
        @rule(data=st.data())
        def truncate(self, data):
            s = data.draw(st.sampled_from(self.live()))
            length = data.draw(st.integers(0, len(self.p.k[s])))
            self.p.truncate(s, length)
            del self.logical[s][-(-length // self.p.page_size):]

        @precondition(lambda self: hasattr(self, "p") and self.logical)
        @rule(data=st.data())
        def free(self, data):
            s = data.draw(st.sampled_from(self.live()))
            self.p.free(s)
            del self.logical[s]

        @invariant()
        def pool_matches_model(self):
            if not hasattr(self, "p"):
                return
            self.p.check()  # lengths, tables, free count, contents
            sids = self.live()
            if not sids:
                return
            table = self.p.cache.block_table(sids)
            to_phys: dict[int, int] = {}
            for b, s in enumerate(sids):
                for j, page in enumerate(self.logical[s]):
                    assert to_phys.setdefault(page, int(table[b, j])) == table[b, j]
            assert len(set(to_phys.values())) == len(to_phys)  # one-to-one
            held = len(to_phys)
            assert self.p.cache.num_free_pages == self.p.num_pages - held

    return PoolMachine


def test_random_pool_operations(attnlib_backend):
    cfg = dict(SETTINGS, stateful_step_count=12)
    run_state_machine_as_test(lambda: _machine(attnlib_backend)(), settings=settings(**cfg))
