"""Plans are bit-identical across refactors: the corpus digest of every policy
configuration equals the pinned one (``tests/plan_corpus.py`` says what the corpus holds
and how to re-pin), on the compiled kernels and on the plain-Python path alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scheduler_service.core import kernels
from tests import plan_corpus as pc

PINNED: dict[str, str] = json.loads(pc.DIGESTS.read_text())


@pytest.fixture(scope="module")
def snaps() -> list:
    return pc.corpus()


def test_the_corpus_holds_the_awkward_inputs(snaps: list) -> None:
    """What the digests are worth depends on what they cover."""
    def some(pred) -> int:
        return sum(1 for s in snaps if len(s) and pred(s).any())

    assert len(snaps) >= 200
    assert some(lambda s: (s.computed_tokens > 0) & (s.computed_tokens < s.prompt_tokens)) >= 40  # partly prefilled
    assert some(lambda s: s.cached_tokens > 0) >= 20
    assert some(lambda s: s.priority > 0) >= 40  # classes
    assert some(lambda s: s.sheddable) >= 40
    assert some(lambda s: s.tpot_slo > 0) >= 20
    assert max(len(s) for s in snaps) >= 200
    assert set(PINNED) == {label for label, _, _ in pc.CONFIGS}


@pytest.mark.parametrize("label", [c[0] for c in pc.CONFIGS])
def test_plans_equal_the_pinned_ones(label: str, snaps: list) -> None:
    assert pc.config_digest(label, snaps) == PINNED[label], (
        f"{label}: a plan changed; a refactor must not change plans (re-pin only for a change meant to, "
        "with `python -m tests.plan_corpus --pin`, and say so in the commit)")


@pytest.mark.parametrize("label", ["slidingserve", "qoserve", "slidingserve:no-classes"])
def test_the_plain_python_path_plans_the_same(label: str, snaps: list) -> None:
    with kernels.using("numpy"):
        assert pc.config_digest(label, snaps) == PINNED[label]


def test_without_numba_the_kernels_run_as_plain_python_and_plan_the_same(snaps: list) -> None:
    """Where numba cannot be imported, every kernel, helpers too, runs as plain Python."""
    small = [s for s in snaps if len(s) <= 40][:60]
    want = {label: pc.config_digest(label, small) for label in ("slidingserve", "sarathi-edf+sc+mlps")}
    code = ("import sys, json\n"
            "sys.modules['numba'] = None  # not importable\n"
            "from scheduler_service.core import kernels\n"
            "from tests import plan_corpus as pc\n"
            "small = [s for s in pc.corpus() if len(s) <= 40][:60]\n"
            f"got = {{k: pc.config_digest(k, small) for k in {sorted(want)!r}}}\n"
            "print(json.dumps([kernels.backend(), got]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=pc.DATA.parents[1], check=True)
    backend, got = json.loads(out.stdout.strip().splitlines()[-1])
    assert backend == "numpy" and "numba is not importable" in out.stderr
    assert got == want
