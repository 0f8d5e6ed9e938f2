"""Rolling upgrade (issue: fleet operation): simulated engines run through a default deployment change
(config reload, v1 -> v2) and a rolling restart of both service replicas (real processes) with
zero lost requests and a bounded number of fallback iterations.  The full-size figures come
from ``python -m benchmarks.rolling_upgrade``."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.rolling_upgrade import rolling_upgrade

pytestmark = pytest.mark.timeout(120)


def test_rolling_upgrade_loses_nothing_and_falls_back_briefly(tmp_path: Path) -> None:
    res = rolling_upgrade(tmp_path, engines=2, requests=60, rate=4.0, speedup=2.0, progress=False)
    assert res["lost"] == 0 and res["completed"] == res["submitted"] == 120
    for e in res["per_engine"]:
        assert e["error"] == "" and e["lost"] == 0
        phases = e["served_by_phase"]
        # before the reload only v1 served; from the first restart on (the reload is picked up
        # within a poll period) only v2, through both restarts
        assert set(phases["v1"]) == {"v1"}, phases
        later = [p for p in ("restart A", "after A", "restart B", "after B", "upgraded") if p in phases]
        assert all(set(phases[p]) == {"v2"} for p in later), phases
        assert sum(sum(phases[p].values()) for p in later) > 50, phases
        # each restart costs an engine a few native iterations (the failed call, one back-off)
        assert sum(e["fallbacks"].values()) <= 20, e
        assert e["longest_fallback_run"] <= 8, e
        assert set(e["fallbacks"]) <= {"error", "circuit_open", "deadline"}, e
    # both replicas were drained and restarted while the engines ran: a restart may cost an
    # engine a fallback or two, or none when its stream's drain ends cleanly and the channel
    # moves to the other replica before the next call
    msgs = [m for m, _ in res["events"]]
    for name in ("A", "B"):
        assert f"replica {name}: SIGTERM (drain)" in msgs and f"replica {name}: SERVING again" in msgs, msgs
    assert msgs.index("replica B: SERVING again") < msgs.index("all engines finished"), msgs
