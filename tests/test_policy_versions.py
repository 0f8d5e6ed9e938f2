"""Deployments side by side (the file keeps its name from before the rename), the policy
config file (validated, hot-reloaded), shadow mode: over real gRPC on loopback against an
embedded server."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import ValidationError, default_predictor, registry
from scheduler_service.server import ServerConfig
from scheduler_service.server.deployments import PolicyConfig

from .grpc_support import make_server, mixed_snapshot

V1 = {"policy": "slidingserve", "params": {"window": 1}}
V2 = {"policy": "slidingserve", "params": {"window": 3, "margin": 1.2}}


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


def metric(srv: Any, name: str, labels: dict[str, str] | None = None) -> float:
    return srv.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def in_process(spec: dict[str, Any], snap: Any) -> Any:
    params = {k: str(v) for k, v in spec.get("params", {}).items()}
    return registry.create(spec["policy"], params or None).plan(snap, default_predictor())


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("data,fields", [
    ({"default": "v1"}, ["deployments"]),
    ({"default": "v9", "deployments": {"v1": V1}}, ["default"]),
    ({"default": "v1", "deployments": {"v1": {"policy": "nope"}}}, ["deployments.v1"]),
    ({"default": "v1", "deployments": {"v1": V1}, "shadow": {"deployment": "v2"}}, ["shadow.deployment"]),
    ({"default": "v1", "deployments": {"v1": V1}, "shadow": {"deplyoment": "v1"}}, ["shadow.deplyoment"]),
    # the pre-rename key is an alias: its errors name it as written
    ({"default": "v1", "versions": {}}, ["versions"]),
    ({"default": "v9", "versions": {"v1": V1}}, ["default"]),
    ({"versions": {"v1": V1}}, ["default"]),
    ({"default": "v1", "versions": {"v1": {"policy": "nope"}}}, ["versions.v1"]),
    ({"default": "v1", "versions": {"v1": {"policy": "slidingserve", "params": {"window": 99}}}},
     ["versions.v1.params.window"]),
    ({"default": "v1", "versions": {"v1": {"policy": "slidingserve", "parms": {}}}}, ["versions.v1.parms"]),
    ({"default": "v1", "versions": {"v1": V1}, "shadow": {"version": "v2"}}, ["shadow.version"]),
    ({"default": "v1", "versions": {"v1": V1, "v2": V2}, "shadow": {"version": "v2", "sample": 0}},
     ["shadow.sample"]),
    ({"default": "slidingserve", "versions": {"slidingserve": V1}}, ["versions.slidingserve"]),
    ({"default": "v1", "versions": {"v 1": V1}}, ["versions.v 1"]),
    ({"default": "v1", "versions": {"v1": V1}, "defualt": "v1"}, ["defualt"]),
    ([1, 2], ["policy_config"]),
])
def test_bad_policy_configs_name_the_field(data: Any, fields: list[str]) -> None:
    with pytest.raises(ValidationError) as e:
        PolicyConfig.from_mapping(data)
    got = [v.field for v in e.value.violations]
    for f in fields:
        assert any(g.startswith(f) for g in got), (f, got)


def test_policy_config_file_formats_and_digest(tmp_path: Path) -> None:
    j = PolicyConfig.from_file(write(tmp_path / "p.json", {"default": "v1", "versions": {"v1": V1, "v2": V2}}))
    (tmp_path / "p.yaml").write_text("default: v1\nversions:\n  v2: {policy: slidingserve, params: {window: 3, "
                                     "margin: 1.2}}\n  v1: {policy: slidingserve, params: {window: 1}}\n")
    y = PolicyConfig.from_file(tmp_path / "p.yaml")
    assert j.digest == y.digest and sorted(j.versions) == ["v1", "v2"]
    (tmp_path / "p.toml").write_text('default = "v1"\n[versions.v1]\npolicy = "vllm-fcfs"\n')
    assert PolicyConfig.from_file(tmp_path / "p.toml").versions["v1"].policy == "vllm-fcfs"
    (tmp_path / "bad.yaml").write_text("default: [unclosed\n")
    with pytest.raises(ValidationError, match="cannot parse"):
        PolicyConfig.from_file(tmp_path / "bad.yaml")
    with pytest.raises(ValidationError, match="cannot read"):
        PolicyConfig.from_file(tmp_path / "missing.yaml")


def test_server_refuses_to_start_with_a_bad_policy_config(tmp_path: Path) -> None:
    bad = write(tmp_path / "p.json", {"default": "v1", "versions": {"v1": {"policy": "nope"}}})
    with pytest.raises(ValidationError, match=r"versions\.v1"):
        make_server(policy_config=str(bad)).start()


# ------------------------------------------------------------------------- serving versions
def test_engines_pin_a_deployment_or_follow_the_default(tmp_path: Path) -> None:
    cfg = write(tmp_path / "p.json", {"default": "v2", "deployments": {"v1": V1, "v2": V2}})
    snap = mixed_snapshot(3)
    with make_server(policy_config=str(cfg)) as srv, SchedulerClient(srv.target, timeout_s=5) as c:
        lst = c.list_policies()
        assert lst.default_policy == "v2" and [v.name for v in lst.deployments] == ["v1", "v2"]
        assert lst.deployments[0].params == {"window": "1"} and lst.config_digest
        default = c.schedule(snap)
        pinned = c.schedule(snap, policy="v1")
        direct = c.schedule(snap, policy="sarathi-edf")
        override = c.schedule(snap, policy="v1", params={"window": 2})
        with pytest.raises(SchedulerError) as e:
            c.schedule(snap, policy="v7")
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert default.deployment == "v2" and default.decision_key() == in_process(V2, snap).decision_key()
    assert pinned.deployment == "v1" and pinned.decision_key() == in_process(V1, snap).decision_key()
    assert direct.deployment == "" and direct.policy == "sarathi-edf"
    want = in_process({"policy": "slidingserve", "params": {"window": 2}}, snap)
    assert override.deployment == "v1" and override.decision_key() == want.decision_key()
    assert metric(srv, "slidingserve_deployment_decisions_total", {"deployment": "v2"}) == 1
    assert metric(srv, "slidingserve_deployment_decisions_total", {"deployment": "v1"}) == 2
    # one word: the pre-rename alias series and label are gone (CHANGELOG.md)
    names = {mf.name for mf in srv.metrics.registry.collect()}
    assert "slidingserve_deployment_decisions" in names and "slidingserve_version_decisions" not in names
    info = srv.metrics.registry.get_sample_value(
        "slidingserve_policy_config_info", {"digest": lst.config_digest, "default": "v2", "shadow": "",
                                            "deployments": "v1,v2"})
    assert info == 1
    # the client's pre-rename names are aliases
    assert lst.versions == lst.deployments
    d = lst.to_dict()
    assert [x["name"] for x in d["deployments"]] == ["v1", "v2"] and d["versions"] == d["deployments"]


def test_config_reload_swaps_deployments_and_refuses_bad_files(tmp_path: Path) -> None:
    path = write(tmp_path / "p.json", {"default": "v1", "deployments": {"v1": V1, "v2": V2}})
    snap = mixed_snapshot(4)
    with make_server(policy_config=str(path), policy_config_poll_s=0.05) as srv, \
            SchedulerClient(srv.target, timeout_s=5) as c:
        assert c.schedule(snap).deployment == "v1"
        digest = c.list_policies().config_digest
        # v1 -> v2 as the default, by editing the file: no restart
        write(path, {"default": "v2", "deployments": {"v1": V1, "v2": V2}})
        deadline = time.monotonic() + 5
        while c.schedule(snap).deployment != "v2":
            assert time.monotonic() < deadline, "reload not picked up"
            time.sleep(0.02)
        assert metric(srv, "slidingserve_policy_config_reloads_total", {"result": "success"}) == 1
        assert c.list_policies().config_digest != digest
        # a bad file is refused, the last good config keeps serving
        path.write_text('{"default": "v3", "deployments": {"v3": {"policy": "slidingserve", "params": {"window": 0}}}}')
        deadline = time.monotonic() + 5
        while metric(srv, "slidingserve_policy_config_reloads_total", {"result": "failure"}) < 1:
            assert time.monotonic() < deadline, "bad file not noticed"
            time.sleep(0.02)
        assert c.schedule(snap).deployment == "v2"
        assert c.schedule(snap, policy="v1").deployment == "v1"
        # and a later good file is picked up again
        write(path, {"default": "v1", "deployments": {"v1": V1}})
        deadline = time.monotonic() + 5
        while c.schedule(snap).deployment != "v1" or c.list_policies().deployments[-1].name != "v1":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(SchedulerError):
            c.schedule(snap, policy="v2")  # removed with the reload: pinning engines get an error
    assert metric(srv, "slidingserve_policy_config_reloads_total", {"result": "success"}) == 2


def test_shadow_decides_and_is_compared_but_never_served(tmp_path: Path) -> None:
    shadow = {"policy": "qoserve"}
    path = write(tmp_path / "p.json", {"default": "v1", "deployments": {"v1": V1, "cand": shadow},
                                       "shadow": {"deployment": "cand", "sample": 1.0}})
    with make_server(policy_config=str(path)) as srv, SchedulerClient(srv.target, timeout_s=5) as c:
        assert c.list_policies().shadow == "cand"
        served = []
        for seed in range(12):
            snap = mixed_snapshot(seed)
            plan = c.schedule(snap)
            served.append(plan)
            assert plan.deployment == "v1" and plan.decision_key() == in_process(V1, snap).decision_key()
            assert srv.shadow is not None and srv.shadow.wait_idle(5)
        same = metric(srv, "slidingserve_shadow_decisions_total", {"deployment": "cand", "result": "same"})
        diff = metric(srv, "slidingserve_shadow_decisions_total", {"deployment": "cand", "result": "different"})
        assert same + diff == 12 and diff >= 1
        assert metric(srv, "slidingserve_shadow_token_delta_count", {"deployment": "cand"}) == 12
        # an engine pinned to the shadow deployment is served by it, and not compared with itself
        assert c.schedule(mixed_snapshot(1), policy="cand").deployment == "cand"
        assert srv.shadow.wait_idle(5)
        assert metric(srv, "slidingserve_shadow_decisions_total", {"deployment": "cand", "result": "same"}) + \
            metric(srv, "slidingserve_shadow_decisions_total", {"deployment": "cand", "result": "different"}) == 12


def test_slow_shadow_is_dropped_not_queued(tmp_path: Path) -> None:
    """The served path never waits for the shadow: while it is busy, snapshots are dropped."""
    path = write(tmp_path / "p.json", {"default": "v1", "deployments": {"v1": {"policy": "vllm-fcfs"},
                                                                     "v2": V2}, "shadow": "v2"})
    with make_server(policy_config=str(path)) as srv, SchedulerClient(srv.target, timeout_s=5) as c:
        import threading

        gate = threading.Event()
        assert srv.shadow is not None
        real = srv.shadow._shadow

        def blocked(job: Any) -> None:
            gate.wait(5)
            real(job)

        srv.shadow._shadow = blocked  # type: ignore[method-assign]
        t0 = time.perf_counter()
        for seed in range(20):
            c.schedule(mixed_snapshot(seed))
        elapsed = time.perf_counter() - t0
        gate.set()
        assert srv.shadow.wait_idle(5)
    dropped = metric(srv, "slidingserve_shadow_decisions_total", {"deployment": "v2", "result": "dropped"})
    assert dropped >= 18 and elapsed < 5


def test_server_config_knows_the_policy_config_fields() -> None:
    assert ServerConfig(policy_config="x.yaml", policy_config_poll_s=0.5).policy_config_poll_s == 0.5
    with pytest.raises(ValidationError, match="policy_config_poll_s"):
        ServerConfig(policy_config_poll_s=0)


def test_shipped_policy_config_loads() -> None:
    root = Path(__file__).resolve().parent.parent
    c = PolicyConfig.from_file(root / "deploy/kubernetes/base/policies.yaml")
    assert c.default in c.deployments


# ------------------------------------------------------------------- the "versions" alias
PRE_RENAME = {"default": "v2", "versions": {"v1": V1, "v2": V2, "fcfs": {"policy": "vllm-fcfs"}},
              "shadow": {"version": "v1", "sample": 0.5}}
RENAMED = {"default": "v2", "deployments": {"v1": V1, "v2": V2, "fcfs": {"policy": "vllm-fcfs"}},
           "shadow": {"deployment": "v1", "sample": 0.5}}


def test_versions_key_is_an_alias_of_deployments() -> None:
    """A config written before the rename (``versions:``, ``shadow: {version: …}``) gives the
    same policy set as one written after it, down to the digest and every resolution."""
    from scheduler_service.server.deployments import Deployment, PolicySet, VersionSpec
    from scheduler_service.server.servicer import PolicyCache

    old, new = PolicyConfig.from_mapping(PRE_RENAME), PolicyConfig.from_mapping(RENAMED)
    assert (old.default, dict(old.deployments), old.shadow, old.shadow_sample, old.digest) == \
        (new.default, dict(new.deployments), new.shadow, new.shadow_sample, new.digest)
    assert old.versions is old.deployments and VersionSpec is Deployment
    assert isinstance(new.deployments["v1"], Deployment) and new.deployments["v1"].params == {"window": "1"}
    a, b = PolicySet("slidingserve", PolicyCache(), old), PolicySet("slidingserve", PolicyCache(), new)
    snap = mixed_snapshot(2)
    for name, params in [("", {}), ("default", {}), ("v1", {}), ("v2", {}), ("fcfs", {}),
                         ("v1", {"window": "2"}), ("qoserve", {})]:
        (pa, da), (pb_, db) = a.resolve(name, params), b.resolve(name, params)
        assert da == db and pa.name == pb_.name and pa.version == pb_.version, name
        assert pa.plan(snap, default_predictor()).decision_key() == pb_.plan(snap, default_predictor()).decision_key()
    # shadow given as a bare name works under both spellings of the entries
    assert PolicyConfig.from_mapping({**PRE_RENAME, "shadow": "v1"}).digest == \
        PolicyConfig.from_mapping({**RENAMED, "shadow": "v1"}).digest


@pytest.mark.parametrize("data,field", [
    ({**RENAMED, "versions": RENAMED["deployments"]}, "versions"),
    ({**RENAMED, "shadow": {"deployment": "v1", "version": "v1"}}, "shadow.version"),
])
def test_both_spellings_at_once_is_an_error_naming_the_alias(data: Any, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        PolicyConfig.from_mapping(data)
    hits = [v for v in e.value.violations if v.field == field]
    assert hits and "not both" in hits[0].description, e.value.violations
