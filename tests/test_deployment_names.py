"""One word for a deployment (issue 38): an engine pins one with ``SLIDINGSERVE_DEPLOYMENT``
(file key ``deployment``); the old name ``SLIDINGSERVE_POLICY`` (``policy``) is an alias for one
release: alone it works with a deprecation warning, with the new name it must agree."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from engine_adapter.vllm.settings import RENAMED, SettingsError, SettingsWatcher, VllmAdapterSettings

ROOT = Path(__file__).resolve().parent.parent


def test_the_new_name_pins_a_deployment(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        s = VllmAdapterSettings.from_env({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_DEPLOYMENT": "v2"})
    assert s.policy == "v2" and "deprecated" not in caplog.text
    assert VllmAdapterSettings.from_env({"SLIDINGSERVE_DEPLOYMENT": "sarathi"}).policy == "sarathi"
    assert VllmAdapterSettings.from_env({"SLIDINGSERVE_DEPLOYMENT": ""}) == VllmAdapterSettings()  # empty = unset


def test_the_old_name_still_works_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        s = VllmAdapterSettings.from_env({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_POLICY": "v2"})
    assert s.policy == "v2"
    assert "SLIDINGSERVE_POLICY is deprecated" in caplog.text and "use SLIDINGSERVE_DEPLOYMENT" in caplog.text
    old = VllmAdapterSettings.from_env({"SLIDINGSERVE_POLICY": "sarathi", "SLIDINGSERVE_PARAMS": "chunk_size=128"})
    new = VllmAdapterSettings.from_env({"SLIDINGSERVE_DEPLOYMENT": "sarathi", "SLIDINGSERVE_PARAMS": "chunk_size=128"})
    assert old == new


def test_both_names_must_agree(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):  # the same value (a fleet mixing releases): fine, no warning
        s = VllmAdapterSettings.from_env({"SLIDINGSERVE_DEPLOYMENT": "sarathi", "SLIDINGSERVE_POLICY": " sarathi"})
    assert s.policy == "sarathi" and "deprecated" not in caplog.text
    with pytest.raises(SettingsError, match=r"SLIDINGSERVE_DEPLOYMENT='vllm-fcfs' and SLIDINGSERVE_POLICY="
                                            r"'sarathi' \(its old name\) differ; give SLIDINGSERVE_DEPLOYMENT only"):
        VllmAdapterSettings.from_env({"SLIDINGSERVE_DEPLOYMENT": "vllm-fcfs", "SLIDINGSERVE_POLICY": "sarathi"})


def test_a_bad_deployment_names_both_variables() -> None:
    for name in ("SLIDINGSERVE_DEPLOYMENT", "SLIDINGSERVE_POLICY"):
        with pytest.raises(SettingsError, match=r"SLIDINGSERVE_DEPLOYMENT \(alias SLIDINGSERVE_POLICY\)/PARAMS: .*nope"):
            VllmAdapterSettings.from_env({name: "nope"})


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "deployment: sarathi\n"),
    (".toml", "[slidingserve]\ndeployment = 'sarathi'\n"),
    (".json", '{"deployment": "sarathi"}'),
])
def test_the_settings_file_key(tmp_path: Path, suffix: str, text: str) -> None:
    p = tmp_path / f"a{suffix}"
    p.write_text(text)
    # the file overrides the environment, whichever name either uses
    for env in ({"SLIDINGSERVE_DEPLOYMENT": "vllm-fcfs"}, {"SLIDINGSERVE_POLICY": "vllm-fcfs"}):
        assert VllmAdapterSettings.from_env({**env, "SLIDINGSERVE_CONFIG": str(p)}).policy == "sarathi"


def test_the_old_file_key_and_a_conflict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "a.yaml"
    p.write_text("policy: sarathi\n")
    with caplog.at_level(logging.WARNING):
        assert VllmAdapterSettings().with_file(str(p)).policy == "sarathi"
    assert "policy is deprecated" in caplog.text and "use deployment" in caplog.text
    p.write_text("deployment: sarathi\npolicy: sarathi\n")
    assert VllmAdapterSettings().with_file(str(p)).policy == "sarathi"
    p.write_text("deployment: sarathi\npolicy: vllm-fcfs\n")
    with pytest.raises(SettingsError, match=r"a\.yaml: deployment='sarathi' and policy='vllm-fcfs' \(its old name\)"):
        VllmAdapterSettings().with_file(str(p))
    p.write_text("deploymnt: sarathi\n")
    with pytest.raises(SettingsError, match=r"unknown keys \['deploymnt'\] .*'deployment'"):
        VllmAdapterSettings().with_file(str(p))


def test_the_watcher_reloads_the_new_key(tmp_path: Path) -> None:
    p = tmp_path / "live.yaml"
    p.write_text("deployment: default\n")
    w = SettingsWatcher(VllmAdapterSettings.from_env({"SLIDINGSERVE_ADDRESS": "h:1", "SLIDINGSERVE_CONFIG": str(p)},
                                                     apply_file=False), period_s=0)
    assert w.current.policy == "default"
    p.write_text("deployment: v1\ndeadline_ms: 9\n")
    w._watch.forget()
    new = w.poll()
    assert new is not None and (new.policy, new.deadline_ms) == ("v1", 9)
    p.write_text("deployment: v2\npolicy: v1\n")  # a conflict is a bad file: the last good one stays
    w._watch.forget()
    assert w.poll() is None and w.errors == 1 and w.current.policy == "v1"


def test_renamed_settings_are_documented() -> None:
    """Every renamed setting's new and old names are in the operator's guide and the changelog."""
    fields = {f.name for f in dataclasses.fields(VllmAdapterSettings)}
    ops = (ROOT / "docs" / "operations.md").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for new, old in RENAMED.items():
        assert old in fields and new not in fields
        for text in (ops, changelog):
            assert f"SLIDINGSERVE_{new.upper()}" in text and f"SLIDINGSERVE_{old.upper()}" in text
    assert re.search(r"slidingserve_version_decisions", changelog)  # the metric change is noted
