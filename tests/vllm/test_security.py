"""vLLM's scheduler with the adapter configured only through its environment for a secured
service: mutual TLS plus a token file.  Decisions are remote and reports land in the
token's tenant (the settings → GrpcBackend wiring, end to end)."""

from __future__ import annotations

import json
from pathlib import Path

from engine_adapter.vllm import RemoteSyncScheduler
from scheduler_service.server.security import hash_token, scoped_key
from tests.grpc_support import make_server
from tests.test_security import CA

from .support import Driver, FakeClock, build_scheduler, make_request, scheduler_class, workload


def test_vllm_adapter_over_mutual_tls_with_a_token_file(mdir: str, tmp_path: Path) -> None:
    ca = CA(tmp_path, "ca")
    server, engine = ca.issue("server", server=True), ca.issue("engine-v", server=False)
    token = "vllm-engine-token-" + "q" * 30
    (tmp_path / "token").write_text(token + "\n")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": {"engine-v": {"sha256": hash_token(token), "tenant": "team-v"}}}))
    with make_server(tls_cert_file=str(server.cert), tls_key_file=str(server.key),
                     tls_client_ca_file=str(ca.pem), auth_tokens_file=str(tokens), require_auth=True) as srv:
        env = {"SLIDINGSERVE_ADDRESS": srv.target, "SLIDINGSERVE_DEADLINE_MS": "2000",
               "SLIDINGSERVE_TLS_CA": str(ca.pem), "SLIDINGSERVE_TLS_CERT": str(engine.cert),
               "SLIDINGSERVE_TLS_KEY": str(engine.key), "SLIDINGSERVE_TOKEN_FILE": str(tmp_path / "token"),
               "SLIDINGSERVE_PROFILE_MODEL": "m", "SLIDINGSERVE_PROFILE_HARDWARE": "h",
               "SLIDINGSERVE_PROFILE_TP": "1", "SLIDINGSERVE_REPORT_BATCH": "4"}
        clock = FakeClock()
        s = build_scheduler(scheduler_class(RemoteSyncScheduler, env, clock), mdir, async_scheduling=False)
        for p, o in workload(30, 3):
            s.add_request(make_request(p, o))
        res = Driver(s, clock, async_scheduling=False, seed=3, wall_ms=2.0).run()
        st = s.slidingserve_stats()
        s.slidingserve_close()
        assert srv.predictors is not None
        state = srv.predictors.state(scoped_key("team-v", "m|h|tp1"))
    assert len(res.finished) == 30
    assert st["core"]["remote_decisions"] > 0.8 * st["iterations"], st
    assert not set(st["fallbacks"]) & {"error", "deadline", "circuit_open"}, st
    assert state is not None and state.accepted > 0
