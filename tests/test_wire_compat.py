"""Wire compatibility across releases: adapters and services of different versions meet
during every rolling upgrade, so both directions are exercised over real gRPC.

* ``buf breaking`` of ``proto/`` against the committed image of the previous release
  (``proto/baseline/``) passes, and demonstrably fails on breaking edits of a scratch copy;
* the **previous release** — its source tree (``git archive`` of the commit recorded next to
  the image) with protobuf code generated from the image at test time — runs in a
  subprocess (one descriptor pool cannot hold two revisions of the same .proto file;
  ``tests/wire_compat_peer.py``):

  a) the current adapter (``AdapterCore`` + ``GrpcBackend``) and ``SchedulerClient``
     against the old ``SchedulerServer``;
  b) the old ``SchedulerClient`` and raw old stubs against the current server;

  decisions must equal the in-process plans, reports must be accepted, and fields one side
  does not know (fields added since the baseline, plus an unknown field number in every
  request) must be ignored.
"""

from __future__ import annotations

import json
import selectors
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from engine_adapter.core import AdapterCore, AdapterSettings, IterationSample
from engine_adapter.remote import GrpcBackend
from scheduler_service.client import SchedulerClient
from scheduler_service.core import Plan, Snapshot, default_predictor, registry
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.wire.convert import plan_from_pb, snapshot_to_pb
from tests.grpc_support import make_server, mixed_snapshot
from tests.wire_compat_peer import UNKNOWN_FIELD, with_unknown_fields

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto"
BASELINE_DIR = PROTO / "baseline"
PEER = Path(__file__).resolve().parent / "wire_compat_peer.py"
BUF = ROOT / "tools" / "buf.sh"
PROTO_FILE = "slidingserve/v1/scheduler.proto"


# ------------------------------------------------------------------ baseline
def baseline_image() -> Path:
    """The single image in proto/baseline/ (rolling it forward replaces it)."""
    images = sorted(BASELINE_DIR.glob("*.binpb"))
    assert len(images) == 1, f"expected exactly one baseline image in {BASELINE_DIR}, found {images}"
    return images[0]


def baseline_commit() -> str:
    image = baseline_image()
    return image.with_suffix(".commit").read_text().strip()


def baseline_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fds = descriptor_pb2.FileDescriptorSet.FromString(baseline_image().read_bytes())
    (file,) = [f for f in fds.file if f.name == PROTO_FILE]
    return file


def current_descriptor() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(file)
    return file


def added_fields() -> dict[str, set[int]]:
    """Field numbers per message (full name) that the current schema has and the baseline
    lacks: what an old peer sees as unknown fields."""
    def numbers(file: descriptor_pb2.FileDescriptorProto) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}

        def walk(prefix: str, msg: descriptor_pb2.DescriptorProto) -> None:
            name = f"{prefix}.{msg.name}"
            out[name] = {f.number for f in msg.field}
            for nested in msg.nested_type:
                walk(name, nested)

        for m in file.message_type:
            walk(file.package, m)
        return out

    old, new = numbers(baseline_descriptor()), numbers(current_descriptor())
    return {name: nums - old.get(name, set()) for name, nums in new.items() if nums - old.get(name, set())}


def _normalized(file: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Without what differs between compilers (json_name, source info, buf's image metadata)."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(file)
    out.DiscardUnknownFields()
    out.ClearField("source_code_info")

    def strip(msg: descriptor_pb2.DescriptorProto) -> None:
        for f in msg.field:
            f.ClearField("json_name")
        for nested in msg.nested_type:
            strip(nested)

    for m in out.message_type:
        strip(m)
    return out


def _git(*args: str, **kw: Any) -> subprocess.CompletedProcess[Any]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False, **kw)


@pytest.fixture(scope="module")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source tree, generated stubs) of the previous release."""
    commit = baseline_commit()
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        pytest.fail(f"baseline source commit {commit} (proto/baseline/*.commit) is not in this clone; "
                    "fetch the history (git fetch --unshallow) to run the cross-version tests")
    source = tmp_path_factory.mktemp("old-release")
    archive = _git("archive", "--format=tar", commit, "scheduler_service", "clients", "engine_adapter")
    assert archive.returncode == 0, archive.stderr.decode()
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    stubs = tmp_path_factory.mktemp("old-stubs")
    from grpc_tools import protoc

    rc = protoc.main(["grpc_tools.protoc", f"--descriptor_set_in={baseline_image()}",
                      f"--python_out={stubs}", f"--grpc_python_out={stubs}", PROTO_FILE])
    assert rc == 0, "protoc could not generate Python code from the baseline image"
    return source, stubs


def test_baseline_image_is_the_recorded_commits_proto(tmp_path: Path) -> None:
    """The image and the recorded source commit describe the same schema, so the
    cross-version tests run the code that really spoke it."""
    show = _git("show", f"{baseline_commit()}:proto/{PROTO_FILE}", text=True)
    assert show.returncode == 0, show.stderr
    (tmp_path / PROTO_FILE).parent.mkdir(parents=True)
    (tmp_path / PROTO_FILE).write_text(show.stdout)
    from grpc_tools import protoc

    out = tmp_path / "set.binpb"
    assert protoc.main(["grpc_tools.protoc", f"-I{tmp_path}", f"--descriptor_set_out={out}", PROTO_FILE]) == 0
    (compiled,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert _normalized(compiled) == _normalized(baseline_descriptor())


# ---------------------------------------------------------------------- buf
def _buf(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("bash") is None:
        pytest.fail("bash is required to run tools/buf.sh")
    return subprocess.run([str(BUF), *args], capture_output=True, text=True, timeout=300, check=False)


def _append_to_block(text: str, header: str, snippet: str) -> str:
    """Insert ``snippet`` just before the closing brace of the block ``header {...}``
    (braces of nested oneofs counted), wherever later edits have moved it."""
    start = text.index(header + " {")
    depth = 0
    for i in range(text.index("{", start), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[:i] + snippet + text[i:]
    raise AssertionError(f"unbalanced block {header}")


def _scratch_proto(tmp_path: Path, edit: Mapping[str, str], append: Mapping[str, str] | None = None) -> Path:
    """A copy of proto/ (module config + .proto files) with text replacements applied and
    snippets appended to the named blocks."""
    dst = tmp_path / "proto"
    shutil.copytree(PROTO, dst, ignore=shutil.ignore_patterns("baseline", "*.md"))
    path = dst / PROTO_FILE
    text = path.read_text()
    for old, new in edit.items():
        assert text.count(old) == 1, f"scratch edit target not found exactly once: {old!r}"
        text = text.replace(old, new)
    for header, snippet in (append or {}).items():
        text = _append_to_block(text, header, snippet)
    path.write_text(text)
    return dst


def test_current_proto_is_compatible_with_the_baseline() -> None:
    """What `make buf-breaking` checks in CI."""
    res = _buf("breaking", "--against", str(baseline_image()))
    assert res.returncode == 0, res.stdout + res.stderr


BREAKING_EDITS: dict[str, tuple[dict[str, str], str]] = {
    # Every old peer would read max_num_seqs from the wrong field.
    "renumbered field": ({"  int64 max_num_seqs = 3;": "  int64 max_num_seqs = 33;"},
                         'field "3" with name "max_num_seqs"'),
    # int64 -> string changes the wire type: old decoders fail or misread.
    "retyped field": ({"  int64 token_budget = 5;": "  string token_budget = 5;"}, "token_budget"),
    # Every old client of the RPC would get UNIMPLEMENTED (WIRE_JSON alone misses this).
    "removed RPC": ({"  rpc GetPredictor(GetPredictorRequest) returns (GetPredictorResponse);\n": ""},
                    'RPC "GetPredictor"'),
    # Same number, new name: the JSON mapping (grpcurl, reflection clients) breaks.
    "renamed field": ({"  string engine_id = 7;": "  string engine_name = 7;"}, "engine_name"),
}


@pytest.mark.parametrize("name", list(BREAKING_EDITS))
def test_buf_breaking_rejects_a_breaking_edit(tmp_path: Path, name: str) -> None:
    edit, expected = BREAKING_EDITS[name]
    scratch = _scratch_proto(tmp_path, edit)
    res = _buf("breaking", str(scratch), "--against", str(baseline_image()))
    assert res.returncode != 0, f"buf breaking accepted a {name}"
    assert expected.lower() in (res.stdout + res.stderr).lower(), res.stdout + res.stderr


def test_wire_json_rules_would_miss_a_removed_rpc(tmp_path: Path) -> None:
    """Why buf.yaml uses FILE (proto/README.md): WIRE_JSON lets an RPC deletion through,
    though every old caller of it would then get UNIMPLEMENTED."""
    scratch = _scratch_proto(tmp_path, BREAKING_EDITS["removed RPC"][0])
    config = scratch / "buf.yaml"
    text = config.read_text()
    assert text.count("    - FILE\n") == 1
    config.write_text(text.replace("    - FILE\n", "    - WIRE_JSON\n"))
    res = _buf("breaking", str(scratch), "--against", str(baseline_image()))
    assert res.returncode == 0, res.stdout + res.stderr


def test_buf_breaking_accepts_additive_edits(tmp_path: Path) -> None:
    """New fields (with fresh numbers), a new enum value and a new RPC keep old peers working."""
    scratch = _scratch_proto(tmp_path, {}, append={
        "message ScheduleRequest": "  // Added later.\n  string wire_compat_added = 9001;\n",
        "message Plan": "  // Added later.\n  optional int64 wire_compat_count = 9002;\n",
        "enum Scenario": "  // Added later.\n  SCENARIO_WIRE_COMPAT = 9003;\n",
        "service SchedulerService": "  // Added later.\n  rpc WireCompatPing(ListPoliciesRequest) returns (ListPoliciesResponse);\n",
    })
    res = _buf("breaking", str(scratch), "--against", str(baseline_image()))
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------ shared cases
@dataclass(frozen=True)
class Case:
    snapshot: Snapshot
    policy: str
    params: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot.to_json(), "policy": self.policy, "params": self.params}

    def in_process(self) -> Plan:
        """The current in-process decision (bootstrap predictor, like a fresh server)."""
        return registry.create(self.policy, self.params).plan(self.snapshot, default_predictor())


CASES = (
    Case(mixed_snapshot(1, n_decode=8, n_prefill=16), "slidingserve", {}),
    Case(mixed_snapshot(2, n_decode=4, n_prefill=24, max_batch_tokens=512, profile="wire-model|h100|tp2"),
         "slidingserve", {}),
    Case(mixed_snapshot(3, n_decode=12, n_prefill=12), "slidingserve", {"window": "1"}),
    Case(mixed_snapshot(4, n_decode=6, n_prefill=10), "sarathi-edf", {}),
)


def key(plan: Plan | Mapping[str, Any]) -> tuple[Any, ...]:
    """Decision identity, with the JSON form's rounding applied to both sides."""
    p = Plan.from_dict(plan) if isinstance(plan, Mapping) else Plan.from_dict(plan.to_dict())
    return p.decision_key()


@pytest.fixture(scope="module")
def cases_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cases") / "cases.json"
    path.write_text(json.dumps([c.to_json() for c in CASES]))
    return path


def _assert_old_release(modules: Mapping[str, str], old_release: tuple[Path, Path]) -> None:
    """The peer really ran the archived source with the stubs generated from the image."""
    source, stubs = old_release
    assert Path(modules["server"]).is_relative_to(source), modules
    assert Path(modules["pb"]).is_relative_to(stubs), modules


def _peer(old_release: tuple[Path, Path], cases_file: Path, role: str, *extra: str) -> list[str]:
    source, stubs = old_release
    return [sys.executable, str(PEER), "--stubs", str(stubs), "--source", str(source), role,
            "--snapshots", str(cases_file), *extra]


@pytest.fixture(scope="module")
def old_server(old_release: tuple[Path, Path], cases_file: Path) -> Iterator[dict[str, Any]]:
    """The previous release's SchedulerServer in a subprocess: {"target", "reference"}."""
    # stderr goes to a file: a pipe nobody reads could fill up and stall the server.
    log = cases_file.with_name("old-server.log")
    with log.open("w") as err:
        proc = subprocess.Popen(_peer(old_release, cases_file, "serve"), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=60)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            proc.wait()
            pytest.fail(f"the old-release server did not start: {log.read_text()[-3000:]}")
        hello = json.loads(line)
        _assert_old_release(hello["modules"], old_release)
        yield {"target": f"127.0.0.1:{hello['port']}", "reference": hello["reference"]}
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdout, proc.stdin):
            stream.close()


# -------------------------------------------------- new-field filling helpers
def _non_default(field: Any) -> Any:
    """A non-default value of a scalar field of any type (a FieldDescriptor)."""
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return "wire-compat"
    if t == FieldDescriptor.TYPE_BYTES:
        return b"wire-compat"
    if t == FieldDescriptor.TYPE_BOOL:
        return True
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return 0.5
    if t == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return field.enum_type.values[-1].number
    return 7


def fill_added_fields(msg: Message, added: Mapping[str, set[int]]) -> int:
    """Set every field the baseline lacks to a non-default value, in ``msg`` and in its
    set sub-messages; returns how many were set.  An old peer must ignore all of them."""
    desc = msg.DESCRIPTOR
    count = 0
    for field in desc.fields:
        is_new = field.number in added.get(desc.full_name, set())
        oneof = field.containing_oneof
        if is_new and oneof is not None and msg.WhichOneof(oneof.name) not in (None, field.name):
            is_new = False  # a new alternative of a oneof that is already set: keep the old one
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if field.type == FieldDescriptor.TYPE_MESSAGE and not is_map:
            if field.is_repeated:
                for item in getattr(msg, field.name):
                    count += fill_added_fields(item, added)
                continue
            if is_new:
                getattr(msg, field.name).SetInParent()
                count += 1
            if msg.HasField(field.name):
                count += fill_added_fields(getattr(msg, field.name), added)
        elif is_new:
            if is_map:
                continue  # a map's key/value types vary; none of ours is new yet
            if field.is_repeated:
                getattr(msg, field.name).append(_non_default(field))
            else:
                setattr(msg, field.name, _non_default(field))
            count += 1
    return count


def test_fill_added_fields_sets_exactly_the_added_fields() -> None:
    """The helper that plays "a newer engine" must really set what it is told is new
    (today's schema may have nothing new, so it is checked against a pretend set)."""
    case = CASES[1]
    request = pb.ScheduleRequest(request_id="x", snapshot=snapshot_to_pb(case.snapshot), policy=case.policy)
    pretend = {"slidingserve.v1.ScheduleRequest": {3}, "slidingserve.v1.Snapshot": {5, 7, 9},
               "slidingserve.v1.EngineProfile": {3}, "slidingserve.v1.RequestColumns": {8}}
    before = pb.ScheduleRequest()
    before.CopyFrom(request)
    assert fill_added_fields(request, pretend) == 5  # rows (9) is a oneof alternative of the set columns
    assert request.policy == "wire-compat" and request.snapshot.prefill_throughput == 0.5
    assert request.snapshot.engine_id == "wire-compat" and request.snapshot.engine_profile.tensor_parallel == 7
    assert request.snapshot.WhichOneof("requests") == "columns"
    assert list(request.snapshot.columns.protected)[-1] is True
    assert request.snapshot.columns.ids == before.snapshot.columns.ids


def _added_present(msg: Message, added: Mapping[str, set[int]]) -> list[int]:
    return sorted(f.number for f, _ in msg.ListFields() if f.number in added.get(msg.DESCRIPTOR.full_name, set()))


def _identity(b: bytes) -> bytes:
    return b


# ------------------------------------------- (a) current adapter, old service
def test_current_adapter_decides_through_the_previous_release_service(old_server: dict[str, Any]) -> None:
    target, reference = old_server["target"], old_server["reference"]
    for case, ref in zip(CASES, reference, strict=True):
        current = case.in_process()
        if current.policy_version == ref["policy_version"] and current.predictor_version == ref["predictor_version"]:
            # Same policy and predictor version: the contract promises the same decision.
            assert key(current) == key(ref), f"{case.policy}: in-process plans of the two releases differ"
        for unary in (False, True):
            settings = AdapterSettings(policy=case.policy, params=case.params, deadline_ms=10_000.0,
                                       fallback_policy="vllm-fcfs", engine_id="new-engine")
            core = AdapterCore(GrpcBackend(target, settings, unary=unary), settings)
            try:
                decision = core.decide(case.snapshot)
            finally:
                core.close()
            assert decision.source == "remote", core.stats()
            assert decision.plan is not None and key(decision.plan) == key(ref)
    with SchedulerClient(target, timeout_s=10.0, encoding="rows") as rows:
        for case, ref in zip(CASES, reference, strict=True):
            assert key(rows.schedule(case.snapshot, case.policy, case.params)) == key(ref)


def test_current_adapter_reports_to_the_previous_release_service(old_server: dict[str, Any]) -> None:
    target = old_server["target"]
    settings = AdapterSettings(deadline_ms=10_000.0, profile="wire-report|cpu|tp1", engine_id="new-engine")
    core = AdapterCore(GrpcBackend(target, settings), settings)
    try:
        for i in range(6):
            core.report(IterationSample(np.array([1, 1, 48]), np.array([300 + i, 90, 0]), 6.0 + i))
        assert core.flush(20.0)
    finally:
        core.close()
    assert core.reports_sent == 6 and core.report_errors == 0, core.stats()
    with SchedulerClient(target, timeout_s=10.0) as client:
        info = client.get_predictor("wire-report|cpu|tp1")
        assert info.reports_accepted == 6
        assert "slidingserve" in client.list_policies().names()


def test_previous_release_service_ignores_fields_it_does_not_know(old_server: dict[str, Any]) -> None:
    """A newer engine's request: every field added since the baseline set, and an unknown
    field number at the top level and inside the snapshot.  The old service must decide
    exactly as for the plain request."""
    target, reference = old_server["target"], old_server["reference"]
    added = added_fields()
    case = CASES[1]
    request = pb.ScheduleRequest(request_id="new-1", snapshot=snapshot_to_pb(case.snapshot),
                                 policy=case.policy, params=case.params)
    n_added = fill_added_fields(request, added)
    if any(name.endswith((".ScheduleRequest", ".Snapshot")) for name in added):
        assert n_added > 0, f"fields added since the baseline ({added}) were not set"
    payload = with_unknown_fields(request.SerializeToString(), nested_field=2)
    assert len(payload) > request.ByteSize()
    channel = grpc.insecure_channel(target)
    try:
        schedule = channel.unary_unary("/slidingserve.v1.SchedulerService/Schedule", request_serializer=_identity,
                                       response_deserializer=pb.ScheduleResponse.FromString)
        response = schedule(payload, timeout=10.0)
    finally:
        channel.close()
    assert response.request_id == "new-1"
    assert key(plan_from_pb(response.plan)) == key(reference[1])
    # The old release cannot set what it does not know: the current code reads defaults.
    assert _added_present(response, added) == [] and _added_present(response.plan, added) == []


# ------------------------------------------- (b) old client, current service
def test_previous_release_client_against_the_current_service(old_release: tuple[Path, Path],
                                                              cases_file: Path) -> None:
    added = added_fields()
    with make_server() as server:
        proc = subprocess.run(_peer(old_release, cases_file, "client", "--target", server.target),
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        _assert_old_release(seen["modules"], old_release)

        # What the current service puts into that response that the old schema lacks.
        case = CASES[0]
        request = pb.ScheduleRequest(request_id="raw-1", snapshot=snapshot_to_pb(case.snapshot),
                                     policy=case.policy, params=case.params)
        with grpc.insecure_channel(server.target) as channel:
            schedule = channel.unary_unary("/slidingserve.v1.SchedulerService/Schedule",
                                           request_serializer=_identity,
                                           response_deserializer=pb.ScheduleResponse.FromString)
            response = schedule(with_unknown_fields(request.SerializeToString(), nested_field=2), timeout=10.0)

    expected = [key(c.in_process()) for c in CASES]
    for mode in ("unary", "stream", "rows"):
        assert [key(p) for p in seen[mode]] == expected, f"old client, {mode}: plans differ from in-process"
    assert key(seen["raw_plan"]) == expected[0] == key(plan_from_pb(response.plan))
    assert seen["report"] == {"accepted": 4, "rejected": 0}
    assert seen["raw_report"] == {"accepted": 1, "rejected": 0}
    assert "slidingserve" in seen["policies"]
    assert seen["predictor_version"] == default_predictor().version
    # Fields added since the baseline that the current server sets arrive at the old client
    # as unknown fields, and nothing else does.
    assert seen["unknown_in_response"] == _added_present(response, added)
    assert seen["unknown_in_plan"] == _added_present(response.plan, added)
    assert UNKNOWN_FIELD not in seen["unknown_in_response"]  # the server never echoes junk
