"""The two error mappings, end to end over real gRPC on loopback.

* server (:mod:`scheduler_service.server.errors`): a core ``ValidationError`` — bad input
  or bytes that are no message — is INVALID_ARGUMENT naming the fields, anything else is
  INTERNAL with a reference id, on every RPC;
* client (:mod:`scheduler_service.client`, :mod:`clients.errors`): the status comes back as a
  ``SchedulerError`` with its code and fields, and the CLI prints it as one line, exit 2.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients.cli import main
from clients.errors import EXIT_USAGE, CliError, describe
from scheduler_service.client import SchedulerClient, SchedulerError
from scheduler_service.core import FieldViolation, ValidationError
from scheduler_service.gen.slidingserve.v1 import scheduler_pb2 as pb
from scheduler_service.server import SchedulerServer
from tests.grpc_support import InjectedPolicy, inject, make_server, mixed_snapshot

METHOD = "/slidingserve.v1.SchedulerService/"
NOT_A_MESSAGE = b"\xff\xff\xff"  # a truncated varint: no message decodes from it


@pytest.fixture(scope="module")
def server() -> Iterator[SchedulerServer]:
    with make_server() as srv:
        yield srv


@pytest.fixture()
def client(server: SchedulerServer) -> Iterator[SchedulerClient]:
    with SchedulerClient(server.target, timeout_s=10.0) as c:
        yield c


def _errors(server: SchedulerServer, code: str) -> float:
    assert server.servicer is not None
    value = server.servicer._metrics.registry.get_sample_value("slidingserve_decision_errors_total", {"code": code})
    return value or 0.0


def _raw_unary(target: str, method: str, data: bytes) -> SchedulerError:
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(METHOD + method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            call(data, timeout=10)
    return SchedulerError.from_rpc_error(exc.value)


# ------------------------------------------------------------------ server side
@pytest.mark.parametrize("method", ["Schedule", "ListPolicies", "GetPredictor"])
def test_undecodable_request_is_invalid_argument_on_every_unary_rpc(server: SchedulerServer, method: str) -> None:
    err = _raw_unary(server.target, method, NOT_A_MESSAGE)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.fields == ["request"]


def test_bad_input_is_invalid_argument_with_the_field(server: SchedulerServer, client: SchedulerClient) -> None:
    before = _errors(server, "INVALID_ARGUMENT")
    with pytest.raises(SchedulerError) as exc:
        client.schedule(mixed_snapshot(0, 4, 4), policy="slidingserve", params={"window": "-3"})
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert any(f.startswith("params") for f in exc.value.fields), exc.value.violations
    assert _errors(server, "INVALID_ARGUMENT") == before + 1  # decisions count their rejections
    bad_profile = pb.GetPredictorRequest(engine_profile=pb.EngineProfile(model="a|b"))  # the client refuses it
    err = _raw_unary(server.target, "GetPredictor", bad_profile.SerializeToString())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.fields == ["engine_profile"]
    assert _errors(server, "INVALID_ARGUMENT") == before + 1  # metadata RPCs do not


def test_any_other_failure_is_internal_with_a_reference(server: SchedulerServer, client: SchedulerClient) -> None:
    inject(server, InjectedPolicy(name="boom-errors", fail=True))
    before = _errors(server, "INTERNAL")
    with pytest.raises(SchedulerError) as exc:
        client.schedule(mixed_snapshot(0, 4, 4), policy="boom-errors")
    assert exc.value.code == grpc.StatusCode.INTERNAL and exc.value.violations == ()
    assert "ref " in exc.value.message and "secret" not in exc.value.message
    with client.stream() as s, pytest.raises(SchedulerError) as exc2:  # the same in a stream
        s.schedule(mixed_snapshot(0, 4, 4), policy="boom-errors")
    assert exc2.value.code == grpc.StatusCode.INTERNAL and "ref " in exc2.value.message
    assert _errors(server, "INTERNAL") == before + 2


def test_loading_server_is_unavailable_not_internal(server: SchedulerServer, client: SchedulerClient) -> None:
    assert server.servicer is not None
    server.servicer.ready.clear()
    try:
        with pytest.raises(SchedulerError) as exc:
            client.schedule(mixed_snapshot(0, 4, 4))
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        assert client.list_policies().default_policy  # metadata needs no loaded state
    finally:
        server.servicer.ready.set()
    assert client.schedule(mixed_snapshot(0, 4, 4)).policy == "slidingserve"


# ------------------------------------------------------------------ client side
def test_describe_maps_each_failure_to_one_line_and_exit_2() -> None:
    assert describe(CliError("--param expects KEY=VALUE")) == ("error: --param expects KEY=VALUE", EXIT_USAGE)
    line, code = describe(ValidationError([FieldViolation("requests[0].id", "must be unique")]))
    assert code == EXIT_USAGE and line.startswith("error: invalid input: ") and "requests[0].id" in line
    err = SchedulerError(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert describe(err) == ("error: UNAVAILABLE: connection refused", EXIT_USAGE)
    assert describe(OSError("disk full")) == ("error: OSError: disk full", EXIT_USAGE)


def _snapshot_file(tmp_path: Path) -> str:
    f = tmp_path / "s.json"
    f.write_text(mixed_snapshot(0, 4, 4).to_json())
    return str(f)


def test_cli_prints_the_servers_status(server: SchedulerServer, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    snap = _snapshot_file(tmp_path)
    code = main(["plan", "--snapshot", snap, "--server", server.target, "--policy", "nope"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith("error: INVALID_ARGUMENT: ") and "nope" in err
    assert len(err.strip().splitlines()) == 1
    inject(server, InjectedPolicy(name="boom-cli", fail=True))
    code = main(["plan", "--snapshot", snap, "--server", server.target, "--policy", "boom-cli"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.startswith("error: INTERNAL: ") and "secret" not in err


def test_cli_reports_an_unreachable_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["policies", "--server", f"127.0.0.1:{port}", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.startswith(("error: UNAVAILABLE: ", "error: DEADLINE_EXCEEDED: ")), err
    assert len(err.strip().splitlines()) == 1


def test_a_caller_that_ends_its_stream_is_no_internal_error(server: SchedulerServer,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """An engine that cancels its report stream or its schedule stream while the server
    reads it (an engine stopping, a deadline passing) is no INTERNAL failure and logs no
    error; the server goes on serving."""
    from scheduler_service.gen.slidingserve.v1 import scheduler_pb2_grpc as pb_grpc

    assert server.servicer is not None
    registry = server.servicer._metrics.registry
    before = _errors(server, "INTERNAL")
    gate = threading.Event()

    def blocked() -> Iterator[pb.IterationReport]:
        gate.wait(10.0)  # the server waits in its read of the stream
        return
        yield

    try:
        with grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.SchedulerServiceStub(ch)
            reports = stub.ReportIterations.future(blocked(), timeout=10)
            stream = stub.ScheduleStream(blocked(), timeout=10)
            end = time.monotonic() + 5.0
            while registry.get_sample_value("slidingserve_active_streams") != 1.0:
                assert time.monotonic() < end, "the schedule stream never reached the server"
                time.sleep(0.02)
            time.sleep(0.3)  # the report stream too
            reports.cancel()
            stream.cancel()
            while registry.get_sample_value("slidingserve_active_streams") != 0.0:
                assert time.monotonic() < end, "the schedule stream never ended on the server"
                time.sleep(0.02)
            time.sleep(0.5)  # the report handler ends as promptly
    finally:
        gate.set()
    assert _errors(server, "INTERNAL") == before
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    with SchedulerClient(server.target, timeout_s=10.0) as c:  # still serving
        assert c.schedule(mixed_snapshot(0, 4, 4)).allocations
