"""The settings kit (scheduler_service/settings.py): typing, env and file loading, the one
bool parser, the file watcher every hot-reloaded file goes through, and the two users of it
(the server's config and the vLLM adapter's settings) naming the bad field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine_adapter.vllm.settings import SettingsError, SettingsWatcher, VllmAdapterSettings
from scheduler_service.core import ValidationError
from scheduler_service.server.config import ServerConfig
from scheduler_service.settings import (
    Checks,
    DocumentError,
    FileWatch,
    convert,
    env_values,
    field_types,
    file_stamp,
    load_document,
    parse_bool,
    read_document,
    type_violations,
    unknown_keys,
)


@dataclass(frozen=True)
class _Demo:
    n: int = 1
    x: float = 0.5
    name: str = "a"
    on: bool = False
    params: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errs = type_violations(self)
        if errs:
            raise ValidationError(errs)
        c = Checks(self)
        c.check("n", self.n >= 1, "must be >= 1")
        c.check("x", 0 <= self.x < 1, "must be in [0, 1)")
        c.raise_if_any()


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    t = time.time() + 1
    os.utime(path, (t, t))  # a new mtime even on coarse file systems


@pytest.mark.parametrize("raw,want", [(True, True), (False, False), ("1", True), (" Yes ", True), ("ON", True),
                                      ("true", True), ("0", False), ("no", False), ("Off", False),
                                      ("FALSE", False), (1, True), (0, False)])
def test_parse_bool(raw: object, want: bool) -> None:
    assert parse_bool(raw) is want


@pytest.mark.parametrize("raw", ["", "maybe", "2", "tru", None, 2])
def test_parse_bool_refuses(raw: object) -> None:
    with pytest.raises(ValueError):
        parse_bool(raw)


def test_field_types_and_convert() -> None:
    assert field_types(_Demo) == {"n": int, "x": float, "name": str, "on": bool, "params": Mapping}
    assert (convert(int, "7"), convert(int, 3.0), convert(float, "2.5"), convert(float, 2)) == (7, 3, 2.5, 2.0)
    assert (convert(bool, "yes"), convert(str, "  a b ")) == (True, "a b")
    for typ, raw in [(int, "1.5"), (int, 2.5), (int, True), (float, "fast"), (float, False), (bool, "x")]:
        with pytest.raises(ValueError):
            convert(typ, raw)


def test_type_and_range_violations_name_the_field() -> None:
    assert _Demo(x=0).x == 0.0 and isinstance(_Demo(x=0).x, float)  # an int passes for a float
    with pytest.raises(ValidationError) as e:
        _Demo(n="3")  # type: ignore[arg-type]
    assert [v.field for v in e.value.violations] == ["n"] and "must be of type int" in str(e.value)
    with pytest.raises(ValidationError) as e:
        _Demo(n=True)  # a bool is no number
    assert e.value.violations[0].field == "n"
    with pytest.raises(ValidationError) as e:
        _Demo(n=0, x=2.0)
    assert [v.field for v in e.value.violations] == ["n", "x"]
    assert str(e.value) == "n: must be >= 1, got 0; x: must be in [0, 1), got 2.0"


def test_env_values_and_unknown_keys() -> None:
    env = {"APP_N": "4", "APP_ON": "true", "APP_NAME": "", "OTHER_N": "9"}
    got = env_values(_Demo, env, "APP_", lambda name, raw: convert(field_types(_Demo)[name], raw))
    assert got == {"n": 4, "on": True}  # empty = unset; other prefixes ignored
    assert _Demo(**got) == _Demo(n=4, on=True)
    unknown, known = unknown_keys(_Demo, ["n", "nn", "params", "zz"], exclude=("params",))
    assert unknown == ["nn", "params", "zz"] and known == {"n", "x", "name", "on"}


def test_documents(tmp_path: Path) -> None:
    for name, text in [("a.yaml", "n: 2\n"), ("a.yml", "n: 2\n"), ("a.toml", "n = 2\n"), ("a.json", '{"n": 2}')]:
        p = tmp_path / name
        p.write_text(text)
        assert load_document(p) == {"n": 2}, name
    odd = tmp_path / "a.conf"
    odd.write_text("n: 2\n")
    assert load_document(odd, yaml_default=True) == {"n": 2}
    with pytest.raises(DocumentError) as e:
        load_document(odd)
    assert e.value.stage == "format"
    with pytest.raises(DocumentError) as e:
        load_document(tmp_path / "missing.yaml")
    assert e.value.stage == "read"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValidationError, match=r"^config: cannot parse .*bad\.json"):
        read_document(bad, "config")
    with pytest.raises(ValidationError, match=r"^config: cannot read .*missing"):
        read_document(tmp_path / "missing.toml", "config")


def test_file_watch_sees_changes_once(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("1")
    w = FileWatch(str(a), str(b), "")
    assert w.stamp[1] is None and w.stamp[2] is None and file_stamp("") is None
    assert not w.changed()
    _touch(a, "2")
    assert w.changed() and not w.changed()  # one caller sees each change
    b.write_text("new")  # a file that appears is a change
    assert w.changed()
    tmp = tmp_path / "a.new"
    tmp.write_text("2")
    t = a.stat().st_mtime_ns
    os.utime(tmp, ns=(t, t))
    os.replace(tmp, a)  # same size and mtime, new inode: an atomic swap is seen
    assert w.changed()


def test_file_watch_period(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.write_text("1")
    w = FileWatch(str(a), period_s=10.0)
    _touch(a, "2")
    now = time.monotonic()
    assert not w.changed(now)  # within the first period: not looked at
    assert w.changed(now + 11) and not w.changed(now + 12)
    _touch(a, "3")
    assert not w.changed(now + 15) and w.changed(now + 22)


def test_server_config_file_reload_of_policy_config_goes_through_the_watch(tmp_path: Path) -> None:
    from scheduler_service.server.deployments import PolicyConfig, PolicyConfigWatcher, PolicySet
    from scheduler_service.server.metrics import Metrics

    p = tmp_path / "policies.yaml"
    p.write_text("default: a\nversions:\n  a: {policy: slidingserve}\n")
    ps = PolicySet("slidingserve", cache=None, config=PolicyConfig.from_file(p))
    w = PolicyConfigWatcher(str(p), ps, Metrics())
    assert w.check() is None
    _touch(p, "default: b\nversions:\n  b: {policy: vllm-fcfs}\n")
    assert w.check() is True and ps.default == "b"
    _touch(p, "default: [broken\n")
    assert w.check() is False and ps.default == "b"  # the last good config keeps serving


def test_server_config_bad_values_name_the_field(tmp_path: Path) -> None:
    for bad, name in [({"port": 70000}, "port"), ({"grace_s": "5"}, "grace_s"), ({"require_auth": 1}, "require_auth"),
                      ({"log_level": "loud"}, "log_level"), ({"refit_evry": 3}, "refit_evry")]:
        with pytest.raises(ValidationError) as e:
            ServerConfig.from_mapping(bad)
        assert [v.field for v in e.value.violations] == [name] and "\n" not in str(e.value)
    p = tmp_path / "server.toml"
    p.write_text("port = 0\ngrace_s = 1\n")
    c = ServerConfig.from_file(p)
    assert (c.port, c.grace_s, type(c.grace_s)) == (0, 1.0, float)
    assert ServerConfig.from_mapping(c.to_dict()) == c


def test_adapter_env_file_and_watcher(tmp_path: Path) -> None:
    p = tmp_path / "live.yaml"
    p.write_text("deadline_ms: 5\npipeline: off\n")
    env = {"SLIDINGSERVE_CONFIG": str(p), "SLIDINGSERVE_DEADLINE_MS": "7", "SLIDINGSERVE_PIPELINE": "yes"}
    base = VllmAdapterSettings.from_env(env, apply_file=False)
    assert (base.deadline_ms, base.pipeline) == (7.0, True)  # the environment
    w = SettingsWatcher(base, period_s=0)
    assert (w.current.deadline_ms, w.current.pipeline) == (5.0, False)  # the file on top
    _touch(p, "deadline_ms: 9\n")
    new = w.poll()
    assert new is not None and (new.deadline_ms, new.pipeline) == (9.0, True) and w.reloads == 1
    with pytest.raises(SettingsError, match=r"^SLIDINGSERVE_PIPELINE must be true or false, got 'maybe'$"):
        VllmAdapterSettings.from_env({"SLIDINGSERVE_PIPELINE": "maybe"})
    with pytest.raises(SettingsError, match=r"^SLIDINGSERVE_REPORT_BATCH must be an integer, got 1\.5$"):
        VllmAdapterSettings().with_file(str(_write(tmp_path / "b.json", {"report_batch": 1.5})))


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_kit_imports_neither_grpc_nor_vllm() -> None:
    code = ("import sys; import scheduler_service.settings; "
            "print(sorted(m for m in ('grpc', 'vllm', 'scheduler_service.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_parse_errors_are_one_line(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("port: [\n")
    with pytest.raises(ValidationError) as e:
        ServerConfig.from_file(p)
    assert e.value.violations[0].field == "config" and "\n" not in str(e.value) and "cannot parse" in str(e.value)
    with pytest.raises(SettingsError) as s:
        VllmAdapterSettings().with_file(str(p))
    assert "does not parse" in str(s.value) and "\n" not in str(s.value)


def test_file_watch_forget_looks_again(tmp_path: Path) -> None:
    a = tmp_path / "a"
    w = FileWatch(str(a))
    w.forget()
    assert w.changed() and not w.changed()  # even a missing file: the first look after forget
    a.write_text("x")
    assert w.changed()
    w.forget()  # e.g. the read after that change failed: look again
    assert w.changed() and not w.changed()
