"""Counting the examples of a property that reached its checks.

A property whose generator can skip its checks for some examples (an early ``return``, a
guard around the assertions) passes without checking anything when the generator stops
reaching them.  Such a property counts the examples that reached its checks, and a floor on
that count is asserted after the run:

* a Hypothesis property is a private ``@given`` function (not collected) that calls
  ``REACHED()`` (or ``REACHED("name")`` for each of several checks) where its checks run;
  the collected test runs every example by calling it and asserts the floor::

      REACHED = Reached()

      @settings(max_examples=150, deadline=None, derandomize=True, database=None)
      @given(st.integers(0, 100_000))
      def _decodes_keep_their_tokens(seed: int) -> None:
          ...
          if len(run) == 0:
              return
          REACHED()
          assert ...

      def test_decodes_keep_their_tokens() -> None:
          REACHED.floor(_decodes_keep_their_tokens, checked=70)

* seeded cases (``pytest.mark.parametrize("seed", ...)``) keep their check in a function
  that returns whether it reached its checks, and one more test counts those over the seeds.

Floors are about half the count measured on the (derandomized) examples, so a small change
of the generator does not trip them, but one that stops reaching the checks does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any


class Reached:
    """Per-check counts of the examples that reached it, for one property."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __call__(self, check: str = "checked") -> None:
        self.counts[check] += 1

    def run(self, prop: Callable[..., Any], *args: Any, **kwargs: Any) -> Counter[str]:
        """Run every example of ``prop`` (a ``@given`` function) and return the counts."""
        self.counts.clear()
        prop(*args, **kwargs)
        return Counter(self.counts)

    def floor(self, prop: Callable[..., Any], *args: Any, **floors: int) -> Counter[str]:
        """Run ``prop`` and assert each named check was reached at least its floor times."""
        got = self.run(prop, *args)
        low = {k: (got[k], n) for k, n in floors.items() if got[k] < n}
        assert not low, f"examples that reached each check (count, floor): {low}; all counts {dict(got)}"
        return got


def count_reached(check: Callable[[int], bool], seeds: range | list[int]) -> int:
    """How many of the seeded cases ``check(seed)`` reached its checks (it returns whether)."""
    return sum(bool(check(seed)) for seed in seeds)
