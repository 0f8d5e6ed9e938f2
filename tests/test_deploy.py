"""Deployment artefacts: ``slidingserve health``, the container image definition, the
Kustomize overlays (rendered and validated by tools/validate_deploy.sh), the vLLM example,
and the operator's guide and dashboard that describe them.

The manifests are checked for the properties that make a rollout safe and the pieces fit
together (ports, names, labels, config), not for their exact text.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from grpc_health.v1 import health_pb2

import engine_adapter.vllm as vllm_adapter
from clients.cli import main
from engine_adapter.vllm.settings import RENAMED, VllmAdapterSettings
from scheduler_service.server import SchedulerServer, ServerConfig
from scheduler_service.server.app import SERVICE_NAME
from scheduler_service.server.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "validate_deploy.sh"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
K8S = ROOT / "deploy" / "kubernetes"
VLLM_EXAMPLE = K8S / "examples" / "vllm-deployment.yaml"
OPERATIONS = ROOT / "docs" / "operations.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "slidingserve-dashboard.json"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _server() -> SchedulerServer:
    return SchedulerServer(ServerConfig(host="127.0.0.1", port=0, log_level="warning", grace_s=0.5, max_workers=4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------ slidingserve health
@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    with _server() as srv:
        yield srv


@pytest.mark.parametrize("service", ["", SERVICE_NAME])
def test_health_serving_exits_0(server: SchedulerServer, capsys: pytest.CaptureFixture[str], service: str) -> None:
    code, out, err = _run(capsys, "health", "--address", server.target, "--service", service)
    assert (code, out, err) == (0, "SERVING\n", "")


def test_health_not_serving_exits_1_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with _server() as srv:
        # The state the server itself enters on SIGTERM (before the drain) and while loading.
        srv.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        code, out, err = _run(capsys, "health", "--address", srv.target, "--service", SERVICE_NAME)
        assert code == 1 and out == ""
        assert err.count("\n") == 1 and "NOT_SERVING" in err and SERVICE_NAME in err
        code, _, _ = _run(capsys, "health", "--address", srv.target)  # overall status is separate
        assert code == 0


def test_health_unknown_service_exits_1(server: SchedulerServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "health", "--address", server.target, "--service", "no.such.Service")
    assert code == 1 and out == ""
    assert err == f"unhealthy: {server.target} service 'no.such.Service': unknown service\n"


def test_health_nothing_listening_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    code, out, err = _run(capsys, "health", "--address", address, "--timeout", "5")
    assert time.monotonic() - t0 < 4.0, "a refused connection is an answer, not a reason to wait"
    assert code == 1 and out == ""
    assert err.startswith(f"unhealthy: {address}: UNAVAILABLE") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["health"], "--address"),
        (["health", "--address", ""], "--address must not be empty"),
        (["health", "--address", "127.0.0.1:1", "--timeout", "0"], "--timeout must be a positive"),
        (["health", "--address", "127.0.0.1:1", "--timeout", "nan"], "--timeout must be a positive"),
        (["health", "--address", "127.0.0.1:1", "--timeout", "soon"], "invalid float value"),
    ],
)
def test_health_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 needle: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


# ------------------------------------------------- a rolling update, seen by an engine
def _decisions(srv: SchedulerServer) -> float:
    return sum(s.value for m in srv.metrics.registry.collect() if m.name == "slidingserve_decisions"
               for s in m.samples if s.name.endswith("_total"))


def test_engine_moves_to_another_replica_when_one_drains() -> None:
    """What docs/operations.md promises for a rollout: two replicas on one port (127.0.0.1
    and 127.0.0.2, as two pod IPs behind the headless Service), an engine's adapter with a
    multi-address target; the replica it uses drains (stop with grace, as on SIGTERM). The
    engine keeps getting plans during the grace period, loses at most a few iterations to
    native fallback, and then gets its plans from the other replica."""
    from engine_adapter.core import AdapterCore, AdapterSettings
    from engine_adapter.remote import GrpcBackend
    from tests.grpc_support import mixed_snapshot

    a = SchedulerServer(ServerConfig(host="127.0.0.1", port=0, log_level="warning", grace_s=1.0, max_workers=4))
    a.start()
    try:
        b = SchedulerServer(ServerConfig(host="127.0.0.2", port=a.port, log_level="warning", max_workers=4)).start()
    except Exception:
        a.stop(0)
        raise
    settings = AdapterSettings(deadline_ms=2000, fallback_policy="vllm-fcfs", max_backoff_decisions=2)
    core = AdapterCore(GrpcBackend(f"ipv4:127.0.0.1:{a.port},127.0.0.2:{a.port}", settings), settings)
    snap = mixed_snapshot(n_decode=8, n_prefill=8)
    try:
        assert all(core.decide(snap).source == "remote" for _ in range(10))
        # round robin spreads streams at open; one engine's stream stays on one replica
        used, other = (a, b) if _decisions(a) == 10 else (b, a)
        assert (_decisions(used), _decisions(other)) == (10, 0), "one stream, one replica"
        drain = threading.Thread(target=used.stop, kwargs={"grace": 1.0})
        drain.start()
        sources = []
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end or len(sources) < 40:
            sources.append(core.decide(snap).source)
            time.sleep(0.02)
            assert len(sources) < 1000
        drain.join(10)
        assert not drain.is_alive()
        fallbacks = sources.count("fallback")
        assert fallbacks <= 5, f"{fallbacks} native iterations during the drain: {sources}"
        assert _decisions(used) > 10, "the draining replica kept serving its open stream"
        assert _decisions(other) >= 20 and sources[-20:] == ["remote"] * 20
    finally:
        core.close()
        b.stop(0)
        a.stop(0)


# ------------------------------------------------------------------- Dockerfile
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins, args in _dockerfile():
        if ins == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((ins, args))
    return stages


def _healthcheck_argv() -> list[str]:
    (hc,) = [a for i, a in _dockerfile() if i == "HEALTHCHECK"]
    cmd = hc[hc.index("CMD ") + 4:]
    return _exec_form(cmd)


def test_dockerfile_is_multi_stage_with_a_venv_copied_into_slim_python() -> None:
    ins = _dockerfile()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in ins if i == "ARG" and "=" in a}
    assert args.get("PYTHON_IMAGE") == "python:3.11-slim"
    builder, runtime = _stages()
    assert re.fullmatch(r"\$\{PYTHON_IMAGE\} AS builder", builder[0][1])
    assert re.fullmatch(r"\$\{PYTHON_IMAGE\} AS runtime", runtime[0][1])
    runs = " ".join(a for i, a in builder if i == "RUN")
    assert "python -m venv /opt/slidingserve" in runs
    assert re.search(r"pip install \.(\s|$)", runs), "installs the project itself, not editable"
    assert "vllm" not in runs, "the service image does not carry the vLLM extra"
    assert ("COPY", "--from=builder /opt/slidingserve /opt/slidingserve") in runtime
    assert not any(i == "RUN" and "pip" in a for i, a in runtime), "no installs in the runtime stage"


def test_dockerfile_runs_as_a_fixed_non_root_user_matching_the_pod_security_context(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    runtime = _stages()[-1]
    users = [a for i, a in runtime if i == "USER"]
    assert users, "the runtime stage must switch to an unprivileged user"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric uid, so that runAsNonRoot can verify it"
    for docs in rendered.values():
        pod = _deployment(docs)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == int(uid)
        assert pod["securityContext"]["runAsGroup"] == int(gid or uid)


def test_dockerfile_ports_entrypoint_and_config_path_match_the_deployment(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    ins = _dockerfile()
    exposed = {int(p) for i, a in ins if i == "EXPOSE" for p in a.split()}
    (entry,) = [_exec_form(a) for i, a in ins if i == "ENTRYPOINT"]
    assert entry[:2] == ["slidingserve", "serve"] and entry[2] == "--config"
    config_path = Path(entry[3])
    image_default = ServerConfig.from_file(ROOT / "deploy" / "examples" / "server.yaml")
    assert ("COPY", f"deploy/examples/server.yaml {config_path}") in ins
    assert exposed == {image_default.port, image_default.metrics_port}
    for docs in rendered.values():
        cfg = _server_config(docs)
        assert {cfg.port, cfg.metrics_port} == exposed
        container = _container(docs)
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert str(config_path.parent) in mounts and "subPath" not in mounts[str(config_path.parent)]


def test_dockerfile_copies_only_what_dockerignore_lets_through() -> None:
    allowed = [ln[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")]
    sources = [a.split()[:-1] for i, a in _dockerfile() if i == "COPY" and not a.startswith("--from")]
    assert sources
    for srcs in sources:
        for src in srcs:
            assert (ROOT / src).exists(), src
            assert any(src == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded by .dockerignore"


def test_dockerfile_healthcheck_command_reports_a_real_server(tmp_path: Path) -> None:
    """The HEALTHCHECK command line, as written, run against a live and a stopped server."""
    argv = _healthcheck_argv()
    assert argv[:2] == ["slidingserve", "health"] and argv[argv.index("--service") + 1] == SERVICE_NAME
    assert argv[argv.index("--address") + 1] == "127.0.0.1:50051"
    srv = _server().start()
    try:
        cmd = [sys.executable, "-m", "clients.cli", *argv[1:]]
        cmd[cmd.index("127.0.0.1:50051")] = srv.target
        ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert (ok.returncode, ok.stdout) == (0, "SERVING\n"), ok.stderr
    finally:
        srv.stop(0)
    down = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert down.returncode == 1, "Docker reads 1 as unhealthy (2 is reserved)"
    assert down.stderr.startswith("unhealthy:")


# ------------------------------------------------------- rendered Kustomize overlays
@pytest.fixture(scope="module")
def render_output(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("rendered")
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, "--no-install", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    if proc.returncode == 3:
        pytest.fail(f"no Kustomize renderer on this machine: run tools/validate_deploy.sh once (it installs "
                    f"one into .tools/kubectl) or `make deploy-check`.\n{proc.stderr}")
    assert proc.returncode == 0, f"tools/validate_deploy.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return out, proc.stdout


@pytest.fixture(scope="module")
def rendered(render_output: tuple[Path, str]) -> dict[str, list[dict[str, Any]]]:
    out, _ = render_output
    return {p.stem: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(out.glob("*.yaml"))}


def _all(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _all(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment", "slidingserve")


def _container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = _deployment(docs)["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _server_config(docs: list[dict[str, Any]]) -> ServerConfig:
    """The ConfigMap's server.yaml, loaded the way the container loads it (from a file)."""
    (cm,) = [d for d in _all(docs, "ConfigMap") if d["metadata"]["name"].startswith("slidingserve-config")]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "server.yaml"
        path.write_text(cm["data"]["server.yaml"])
        return ServerConfig.from_file(path)


def test_every_overlay_renders_and_validates_against_the_kubernetes_schemas(
        render_output: tuple[Path, str], rendered: dict[str, list[dict[str, Any]]]) -> None:
    _, log = render_output
    assert set(rendered) == {"dev", "production"}
    assert re.search(r"deploy manifests: \d+ valid, 0 invalid", log)
    assert "ServiceMonitor/slidingserve (custom resource" in log, "the CRD kind is validated, and says how"
    for docs in rendered.values():
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == \
               {_one(docs, "Namespace")["metadata"]["name"]}


def test_probes_are_native_grpc_health_checks(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        c, port = _container(docs), _server_config(docs).port
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
            assert c[probe]["grpc"]["port"] == port
        assert "service" not in c["livenessProbe"]["grpc"], "liveness: the process answers"
        assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_pods_are_non_root_read_only_and_sized(rendered: dict[str, list[dict[str, Any]]]) -> None:
    requests = {}
    for name, docs in rendered.items():
        pod = _deployment(docs)["spec"]["template"]["spec"]
        c = _container(docs)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        res = c["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"]
        requests[name] = _cpu(res["requests"]["cpu"])
    assert requests["production"] > requests["dev"]


def _cpu(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_shutdown_fits_in_the_termination_grace_period(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        pod = _deployment(docs)["spec"]["template"]["spec"]
        sleep = _container(docs)["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep" and float(sleep[1]) > 0, "endpoints need time to drop the pod"
        grace_s = _server_config(docs).grace_s
        assert pod["terminationGracePeriodSeconds"] > float(sleep[1]) + grace_s


def test_rollouts_never_remove_a_ready_pod_first(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        spec = _deployment(docs)["spec"]
        assert spec["strategy"]["type"] == "RollingUpdate"
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert spec["strategy"]["rollingUpdate"]["maxSurge"] >= 1
        assert spec["revisionHistoryLimit"] >= 2, "kubectl rollout undo needs old ReplicaSets"


def test_configmap_is_a_valid_server_config_mounted_by_the_deployment(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    configs = {}
    for name, docs in rendered.items():
        cfg = configs[name] = _server_config(docs)
        (cm,) = [d for d in _all(docs, "ConfigMap") if d["metadata"]["name"].startswith("slidingserve-config")]
        assert re.fullmatch(r"slidingserve-config-[a-z0-9]{10}", cm["metadata"]["name"]), \
            "hash suffix: a config change rolls the pods"
        volumes = {v["name"]: v for v in _deployment(docs)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
        assert cfg.host == "0.0.0.0" and cfg.metrics_port > 0
    assert configs["production"].max_workers > configs["dev"].max_workers


def test_services_match_the_config_ports_and_select_the_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        cfg = _server_config(docs)
        dep = _deployment(docs)
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        ports = {p["name"]: p["containerPort"] for p in _container(docs)["ports"]}
        assert ports == {"grpc": cfg.port, "metrics": cfg.metrics_port}
        grpc_svc = _one(docs, "Service", "slidingserve-grpc")["spec"]
        metrics_svc = _one(docs, "Service", "slidingserve-metrics")["spec"]
        assert grpc_svc["clusterIP"] == "None", "headless: dns:/// targets see every ready pod"
        assert metrics_svc.get("type", "ClusterIP") == "ClusterIP" and "clusterIP" not in metrics_svc
        for svc, name, port in ((grpc_svc, "grpc", cfg.port), (metrics_svc, "metrics", cfg.metrics_port)):
            assert svc["selector"].items() <= pod_labels.items()
            (p,) = svc["ports"]
            assert (p["port"], p["targetPort"]) == (port, name)


def test_production_has_replicas_pdb_hpa_and_servicemonitor(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["production"]
    dep = _deployment(docs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["replicas"] >= 3
    pdb = _one(docs, "PodDisruptionBudget", "slidingserve")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb.get("maxUnavailable", 0) >= 1 or pdb["minAvailable"] < dep["spec"]["replicas"], \
        "a PDB that allows no eviction blocks node drains forever"
    hpa = _one(docs, "HorizontalPodAutoscaler", "slidingserve")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "slidingserve"}
    assert hpa["minReplicas"] >= 3 and hpa["maxReplicas"] > hpa["minReplicas"]
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    sm = _one(docs, "ServiceMonitor", "slidingserve")
    metrics_svc = _one(docs, "Service", "slidingserve-metrics")
    grpc_svc = _one(docs, "Service", "slidingserve-grpc")
    sel = sm["spec"]["selector"]["matchLabels"]
    assert sel.items() <= metrics_svc["metadata"]["labels"].items()
    assert not sel.items() <= grpc_svc["metadata"]["labels"].items(), "the gRPC port is not scraped"
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]


def test_dev_is_a_single_replica_without_hpa_pdb_or_crds(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["dev"]
    assert _deployment(docs)["spec"]["replicas"] == 1
    assert {d["kind"] for d in docs} == {"Namespace", "ConfigMap", "Service", "Deployment"}


def test_image_tags_are_the_project_version_everywhere(rendered: dict[str, list[dict[str, Any]]]) -> None:
    images = {name: _container(docs)["image"] for name, docs in rendered.items()}
    for image in images.values():
        repo, _, tag = image.rpartition(":")
        assert tag == VERSION and repo.rsplit("/", 1)[-1] == "slidingserve", image
    assert images["dev"] == f"slidingserve:{VERSION}"
    assert "/" in images["production"], "production pulls from a registry"
    assert f"slidingserve:{VERSION}" in DOCKERFILE.read_text(), "the build command in the Dockerfile"


def test_validator_rejects_unknown_fields_bad_custom_resources_and_unknown_kinds(
        tmp_path: Path, render_output: tuple[Path, str]) -> None:
    """The check can fail: a copy of the tree with three mistakes gives three FAIL lines."""
    (tmp_path / "tools").mkdir()
    shutil.copy(SCRIPT, tmp_path / "tools" / SCRIPT.name)
    shutil.copytree(K8S, tmp_path / "deploy" / "kubernetes")
    if (ROOT / ".tools" / "kubectl").exists():  # the renderer the fixture used, if installed there
        (tmp_path / ".tools").mkdir()
        (tmp_path / ".tools" / "kubectl").symlink_to(ROOT / ".tools" / "kubectl")
    base = tmp_path / "deploy" / "kubernetes" / "base"
    dep = base / "deployment.yaml"
    dep.write_text(dep.read_text().replace("            periodSeconds: 10\n", "            periodSecond: 10\n"))
    sm = base / "servicemonitor.yaml"
    sm.write_text(sm.read_text().replace("interval: 15s", "interval: 15 seconds"))
    (tmp_path / "deploy" / "kubernetes" / "examples" / "widget.yaml").write_text(
        "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n")
    proc = subprocess.run(["bash", str(tmp_path / "tools" / SCRIPT.name), "--python", sys.executable,
                           "--no-install"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    assert any("livenessProbe" in ln and "periodSecond" in ln for ln in fails), fails
    assert any("ServiceMonitor" in ln and "interval" in ln for ln in fails), fails
    assert any("Widget/w" in ln and "Couldn't find schema" in ln for ln in fails), fails


# ------------------------------------------------------------------ vLLM example
def _vllm_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(VLLM_EXAMPLE.read_text()) if d]


def test_vllm_example_uses_the_adapter_with_real_settings(tmp_path: Path,
                                                          rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = _vllm_docs()
    (c,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["vllm", "serve"]
    cls = cmd[cmd.index("--scheduler-cls") + 1]
    module, _, name = cls.rpartition(".")
    assert module == "engine_adapter.vllm" and name in vllm_adapter.__all__
    fields = {f"SLIDINGSERVE_{f.name.upper()}" for f in dataclasses.fields(VllmAdapterSettings)}
    fields = fields - {f"SLIDINGSERVE_{old.upper()}" for old in RENAMED.values()}  # old names: aliases only
    fields |= {f"SLIDINGSERVE_{new.upper()}" for new in RENAMED}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert set(env) <= fields, f"not adapter settings (or an old name): {set(env) - fields}"
    assert {"SLIDINGSERVE_ADDRESS", "SLIDINGSERVE_DEPLOYMENT", "SLIDINGSERVE_DEADLINE_MS"} <= set(env)
    literal = {k: v for k, v in env.items() if v is not None}
    settings = VllmAdapterSettings.from_env(literal, apply_file=False)  # validates every value
    # The address is the production overlay's headless Service, on its configured port.
    prod = rendered["production"]
    ns = _one(prod, "Namespace")["metadata"]["name"]
    assert settings.address == f"dns:///slidingserve-grpc.{ns}.svc.cluster.local:{_server_config(prod).port}"
    # The live settings file comes from the ConfigMap, mounted as a directory (updates arrive).
    cm = _one(docs, "ConfigMap")
    mount = next(m for m in c["volumeMounts"] if settings.config.startswith(m["mountPath"] + "/"))
    assert "subPath" not in mount
    (tmp_path / "adapter.yaml").write_text(cm["data"][Path(settings.config).name])
    live = settings.with_file(str(tmp_path / "adapter.yaml"))
    assert live.policy == "slidingserve" and math.isfinite(live.deadline_ms)


# ------------------------------------------------------------- docs and dashboard
def _metric_names() -> set[str]:
    m = Metrics()
    try:
        return {metric.name for metric in m.registry.collect()}
    finally:
        m.close()


def test_operations_guide_lists_every_metric_and_only_real_settings() -> None:
    text = OPERATIONS.read_text()
    missing = sorted(n for n in _metric_names()
                     if not re.search(rf"\b{n}(?:_total|_bucket|_info)?\b", text))
    assert not missing, f"docs/operations.md does not describe {missing}"
    fields = {f"SLIDINGSERVE_{f.name.upper()}" for f in dataclasses.fields(VllmAdapterSettings)}
    fields |= {f"SLIDINGSERVE_{new.upper()}" for new in RENAMED}  # a setting's new name (its field's is the alias)
    named = set(re.findall(r"SLIDINGSERVE_[A-Z_]+[A-Z]", text))
    assert named and named <= fields, f"not adapter settings: {named - fields}"
    config_keys = {f.name for f in dataclasses.fields(ServerConfig)}
    for key in ("grace_s", "max_workers", "refit_every"):
        assert key in config_keys and f"`{key}`" in text
    assert "## Fleet metrics" in text
    assert "docs/operations.md" in (ROOT / "README.md").read_text()


def test_grafana_dashboard_queries_only_defined_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 5
    names = _metric_names()
    suffixes = ("_total", "_bucket", "_count", "_sum", "_info", "")
    known = {n + s for n in names for s in suffixes}
    used = {tok for e in exprs for tok in re.findall(r"\bslidingserve_[a-z_]+", e)}
    assert used and used <= known, f"undefined metrics in the dashboard: {used - known}"
    for needle in ("slidingserve_decision_seconds_bucket", "slidingserve_decisions_total",
                   "slidingserve_decision_errors_total", "slidingserve_predictor_abs_error_ms_bucket",
                   "slidingserve_predictor_refits_total"):
        assert needle in used, needle
    assert any("0.99" in e for e in exprs) and any("0.5" in e for e in exprs)


def test_validate_script_is_wired_into_make() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^deploy-check:.*\n\ttools/validate_deploy\.sh ", makefile, re.M)
