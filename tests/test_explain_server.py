"""``slidingserve explain --server`` and ``ScheduleRequest.explain`` over real loopback gRPC.

A request that asks for reasons always gets them, with the same decision as without; the
CLI prints, for a live service, the table the offline path prints with that service's
deployed policy version and learned predictor, and a line naming both; its failures are
one line and a non-zero exit."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from benchmarks.snapshots import busy_snapshot
from clients.cli import main
from clients.explain import decided_by, table
from scheduler_service.client import EngineProfile, IterationReport, SchedulerClient
from scheduler_service.core import Allocation, Snapshot, batch_features, default_predictor, registry
from scheduler_service.core.reasons import plan_explained
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler_service.server import SchedulerServer
from scheduler_service.wire.convert import plan_from_pb, snapshot_to_pb
from tests.grpc_support import UnknownId, inject, make_server, mixed_snapshot

PROFILE = EngineProfile("llama-3-8b", "a100", 1)
GAUGE = "slidingserve_requests_waiting_by_reason"
WINDOW = 50


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, out: str, err: str) -> None:
    """The CLI's failure: one line; the in-process server's JSON log lines aside."""
    assert code != 0 and out == "", (code, out)
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("{")]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def busy() -> Snapshot:
    return busy_snapshot(n_decode=64, n_queued=96, seed=4)


@pytest.fixture(scope="module")
def snap_file(tmp_path_factory: pytest.TempPathFactory, busy: Snapshot) -> Path:
    path = tmp_path_factory.mktemp("explain-server") / "busy.json"
    path.write_text(busy.to_json())
    return path


def _reports(n: int) -> list[IterationReport]:
    """Mixed batches whose latency is far from the bundled predictor's: a refit learns it."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        nd, npf = int(rng.integers(1, 64)), int(rng.integers(1, 4))
        c = np.concatenate([np.ones(nd, np.int64), rng.integers(16, 512, npf)])
        u = np.concatenate([rng.integers(10, 3000, nd), rng.integers(0, 1000, npf)])
        x, _ = batch_features(c, u)
        out.append(IterationReport(latency_ms=3.0 + 0.08 * x[3] + 2e-5 * x[4] + 0.02 * x[5], c=c, u=u,
                                   profile=PROFILE))
    return out


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerServer]:
    """A service with a policy config (default deployment ``tuned``: SlidingServe with
    non-default parameters) and a predictor it learned for PROFILE; it explains nothing on
    its own (``explain_every: 0``)."""
    conf = tmp_path_factory.mktemp("deploy") / "policies.json"
    conf.write_text(json.dumps({"default": "tuned", "deployments": {
        "tuned": {"policy": "slidingserve", "params": {"window": 3, "decode_skip_tbts": 2}},
        "fcfs": {"policy": "vllm-fcfs"}}}))
    with make_server(policy_config=str(conf), explain_every=0, refit_every=WINDOW, refit_window=WINDOW,
                     refit_holdout_fraction=0.2, refit_min_samples=30) as srv:
        with SchedulerClient(srv.target, timeout_s=10.0) as client:
            assert client.report(_reports(WINDOW)).accepted == WINDOW
            assert srv.predictors is not None and srv.predictors.wait_idle(10.0)
            assert client.get_predictor(PROFILE).version != default_predictor().version
        yield srv


def _gauge(srv: SchedulerServer) -> dict[tuple[str, str], float]:
    return {(s.labels["deployment"], s.labels["reason"]): s.value
            for fam in srv.metrics.registry.collect() if fam.name == GAUGE  # type: ignore[union-attr]
            for s in fam.samples}


# ------------------------------------------------------------ the CLI, against a live service
def test_explain_server_prints_the_offline_table_of_the_deployed_policy_and_learned_predictor(
        deployed: SchedulerServer, busy: Snapshot, snap_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with SchedulerClient(deployed.target, timeout_s=10.0) as client:
        learned = client.get_predictor(PROFILE).predictor
    policy = registry.create("slidingserve", {"window": "3", "decode_skip_tbts": "2"})
    want = plan_explained(policy, busy, learned)
    assert want.reasons, "the busy snapshot leaves requests waiting"
    assert learned.version != default_predictor().version
    code, out, err = run(capsys, "explain", "--server", deployed.target, "--snapshot", str(snap_file),
                         "--profile", PROFILE.key)
    assert code == 0, err
    first, rest = out.split("\n", 1)
    assert first == (f"decided by {deployed.target}: deployment tuned, policy slidingserve version "
                     f"{policy.version}, predictor version {learned.version}")
    assert first == decided_by(deployed.target, dataclasses.replace(want, deployment="tuned"))
    assert rest.rstrip("\n") == table(busy, want)
    # the same, as JSON: the explained plan
    code, out, err = run(capsys, "explain", "--server", deployed.target, "--snapshot", str(snap_file),
                         "--profile", PROFILE.key, "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["reasons"] == [{"id": r.id, "code": r.code, "value": r.value} for r in want.reasons]
    assert got["allocations"] == [{"id": a.id, "tokens": a.tokens} for a in want.allocations]
    assert (got["deployment"], got["policy_version"], got["predictor_version"]) == (
        "tuned", policy.version, learned.version)
    # the local defaults decide otherwise: another predictor version, another policy version
    offline = plan_explained(registry.create("slidingserve"), busy, default_predictor())
    assert (offline.policy_version, offline.predictor_version) != (want.policy_version, want.predictor_version)
    # asking does not set the gauge (explain_every: 0 explains nothing of the engines')
    assert _gauge(deployed) == {}


def test_explain_server_names_another_deployment_and_the_snapshots_own_profile(
        deployed: SchedulerServer, busy: Snapshot, snap_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = plan_explained(registry.create("vllm-fcfs"), busy, default_predictor())  # no reports for ""
    code, out, err = run(capsys, "explain", "--server", deployed.target, "--snapshot", str(snap_file),
                         "--policy", "fcfs")
    assert code == 0, err
    first, rest = out.split("\n", 1)
    assert first.startswith(f"decided by {deployed.target}: deployment fcfs, policy vllm-fcfs version ")
    assert first.endswith(f", predictor version {default_predictor().version}")
    assert rest.rstrip("\n") == table(busy, want)


# ------------------------------------------------------------------ the request field
@pytest.mark.parametrize("policy", ["slidingserve", "sarathi", "qoserve", "vllm-fcfs"])
def test_a_request_that_asks_always_gets_reasons_and_the_same_decision(policy: str, busy: Snapshot) -> None:
    light = mixed_snapshot(5, n_decode=8, n_prefill=6)
    with make_server(explain_every=0) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        for snap in (busy, light):
            want = plan_explained(registry.create(policy), snap, default_predictor())
            for _ in range(3):
                plain = client.schedule(snap, policy=policy)
                asked = client.schedule(snap, policy=policy, explain=True)
                assert not plain.reasons
                assert list(asked.reasons) == list(want.reasons)
                assert asked.decision_key() == plain.decision_key() == want.decision_key()
            assert want.reasons or snap is light
        assert _gauge(srv) == {}  # asked-for explanations leave the engines' gauge alone


def test_asked_and_sampled_together(busy: Snapshot) -> None:
    """With ``explain_every: 2`` every asked decision is explained and the sampling goes on
    as before: the 2nd, 4th, ... decisions, whichever asked."""
    with make_server(explain_every=2) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        asks = [True, False, False, False, True, True]
        carried = [bool(client.schedule(busy, explain=a).reasons) for a in asks]
        assert carried == [True, True, False, True, True, True]
        assert {c for (_, c), n in _gauge(srv).items() if n}  # the sampled ones set it


def test_the_stream_explains_what_asks(busy: Snapshot) -> None:
    want = plan_explained(registry.create("slidingserve"), busy, default_predictor())
    snap_pb = snapshot_to_pb(busy)
    with make_server(explain_every=0) as srv, grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.SchedulerServiceStub(channel)
        reqs = [pb.ScheduleRequest(request_id=f"s{k}", snapshot=snap_pb, explain=k % 2 == 1) for k in range(4)]
        resps = list(stub.ScheduleStream(iter(reqs), timeout=30.0))
    assert [r.request_id for r in resps] == ["s0", "s1", "s2", "s3"]
    plans = [plan_from_pb(r.plan) for r in resps]
    assert [bool(p.reasons) for p in plans] == [False, True, False, True]
    assert all(p.decision_key() == want.decision_key() for p in plans)
    assert list(plans[1].reasons) == list(want.reasons)
    for r in resps:  # the wire fields of the decision, whichever asked
        assert (list(r.plan.allocation_ids), list(r.plan.allocation_tokens), r.plan.path) == (
            list(resps[0].plan.allocation_ids), list(resps[0].plan.allocation_tokens), resps[0].plan.path)


def test_asking_never_fails_a_decision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An asked explanation keeps ``_explained``'s contract: a plan that cannot be explained
    goes back, unexplained; the CLI says so in one line."""
    snap = mixed_snapshot(3, n_decode=4, n_prefill=4)
    f = tmp_path / "s.json"
    f.write_text(snap.to_json())
    with make_server(explain_every=0) as srv, SchedulerClient(srv.target, timeout_s=10.0) as client:
        inject(srv, UnknownId())  # type: ignore[arg-type]
        got = client.schedule(snap, policy="unknown-id", explain=True)
        assert got.allocations == (Allocation("not-a-request", 1),) and not got.reasons
        code, out, err = run(capsys, "explain", "--server", srv.target, "--snapshot", str(f),
                             "--policy", "unknown-id")
        one_line_error(code, out, err)
        assert "sent no reasons" in err


# ------------------------------------------------------------------------- CLI errors
def test_unreachable_server_is_one_line(snap_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(*run(capsys, "explain", "--server", "127.0.0.1:1", "--snapshot", str(snap_file),
                        "--timeout", "0.5"))


@pytest.mark.parametrize("content", [None, "{not json", '{"now": "x"}'])
def test_bad_snapshot_is_one_line_before_any_call(tmp_path: Path, content: str | None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "snap.json"
    if content is not None:
        path.write_text(content)
    one_line_error(*run(capsys, "explain", "--server", "127.0.0.1:1", "--snapshot", str(path)))


def test_the_servers_invalid_argument_names_the_field(deployed: SchedulerServer, snap_file: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needle in ((["--policy", "slidingserve", "--param", "window=0"], "params.window"),
                         (["--policy", "no-such-policy"], "INVALID_ARGUMENT")):
        code, out, err = run(capsys, "explain", "--server", deployed.target, "--snapshot", str(snap_file), *argv)
        one_line_error(code, out, err)
        assert needle in err, err


def test_offline_only_and_server_only_flags(snap_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "explain", "--server", "127.0.0.1:1", "--snapshot", str(snap_file),
                         "--predictor", str(snap_file))
    one_line_error(code, out, err)
    assert "--predictor applies offline only" in err
    code, out, err = run(capsys, "explain", "--snapshot", str(snap_file), "--profile", PROFILE.key)
    one_line_error(code, out, err)
    assert "--profile applies with --server only" in err
    for bad in ("0", "-1", "nan"):
        one_line_error(*run(capsys, "explain", "--server", "127.0.0.1:1", "--snapshot", str(snap_file),
                            "--timeout", bad))


def test_a_secured_service(tmp_path: Path, snap_file: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """TLS and a token from the SLIDINGSERVE_* variables, as for `plan` and `policies`."""
    from scheduler_service.server.security import hash_token
    from tests.test_security import CA

    ca = CA(tmp_path, "explain")
    server_cert = ca.issue("server", server=True)
    token = "tok-explain-" + "q" * 40
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {"ops": {"sha256": hash_token(token), "tenant": "t"}}}))
    with make_server(tls_cert_file=str(server_cert.cert), tls_key_file=str(server_cert.key),
                     auth_tokens_file=str(tokens), require_auth=True, explain_every=0) as srv:
        monkeypatch.setenv("SLIDINGSERVE_TLS_CA", str(ca.pem))
        code, out, err = run(capsys, "explain", "--server", srv.target, "--snapshot", str(snap_file))
        one_line_error(code, out, err)
        assert "UNAUTHENTICATED" in err
        monkeypatch.setenv("SLIDINGSERVE_TOKEN", token)
        code, out, err = run(capsys, "explain", "--server", srv.target, "--snapshot", str(snap_file))
        assert code == 0, err
        assert out.startswith(f"decided by {srv.target}: policy slidingserve version ")
