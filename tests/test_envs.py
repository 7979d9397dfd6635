from __future__ import annotations

import pytest

from vllm_moe_graphs import envs
from vllm_moe_graphs.killswitch import KillSwitch


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("TRUE", True),
                                          ("0", False), ("false", False), ("", False)])
def test_disable_accepts(monkeypatch, raw, expected):
    monkeypatch.setenv("MOE_GRAPHS_DISABLE", raw)
    assert envs.MOE_GRAPHS_DISABLE is expected


def test_disable_unset_is_false(monkeypatch):
    monkeypatch.delenv("MOE_GRAPHS_DISABLE", raising=False)
    assert envs.MOE_GRAPHS_DISABLE is False


@pytest.mark.parametrize("raw", ["yes please", "2", "on", "enabled"])
def test_disable_rejects_with_name_value_and_accepted(monkeypatch, raw):
    monkeypatch.setenv("MOE_GRAPHS_DISABLE", raw)
    with pytest.raises(ValueError) as err:
        envs.validate_all()
    msg = str(err.value)
    assert "MOE_GRAPHS_DISABLE" in msg and repr(raw) in msg and "accepted" in msg


def test_kill_file_resolves_to_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOE_GRAPHS_KILL_FILE", "kill")
    assert envs.MOE_GRAPHS_KILL_FILE == str(tmp_path / "kill")


def test_kill_file_unset_is_none(monkeypatch):
    monkeypatch.delenv("MOE_GRAPHS_KILL_FILE", raising=False)
    assert envs.MOE_GRAPHS_KILL_FILE is None


def test_kill_file_missing_directory_rejected(monkeypatch, tmp_path):
    bad = str(tmp_path / "nope" / "kill")
    monkeypatch.setenv("MOE_GRAPHS_KILL_FILE", bad)
    with pytest.raises(ValueError, match="MOE_GRAPHS_KILL_FILE.*does not exist"):
        envs.validate_all()


def test_kill_file_directory_rejected(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GRAPHS_KILL_FILE", str(tmp_path))
    with pytest.raises(ValueError, match="names a directory"):
        envs.validate_all()


def test_unknown_attribute():
    with pytest.raises(AttributeError):
        envs.MOE_GRAPHS_NOT_A_VARIABLE  # noqa: B018


def test_no_vllm_prefixed_names():
    assert all(not name.startswith("VLLM_") for name in envs.environment_variables)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_kill_switch_follows_file_with_bounded_staleness(tmp_path):
    path = tmp_path / "kill"
    clock = FakeClock()
    switch = KillSwitch(str(path), interval_s=0.1, clock=clock)
    assert switch.active() is False
    path.touch()
    clock.now = 0.05
    assert switch.active() is False  # within the staleness bound: not re-checked yet
    clock.now = 0.11
    assert switch.active() is True
    path.unlink()
    clock.now = 0.15
    assert switch.active() is True
    clock.now = 0.25
    assert switch.active() is False
    assert switch.flips == 2


def test_kill_switch_real_clock(tmp_path):
    path = tmp_path / "kill"
    switch = KillSwitch(str(path), interval_s=0.0)
    assert not switch.active()
    path.touch()
    assert switch.active()
    path.unlink()
    assert not switch.active()


def test_kill_switch_without_path_never_active():
    switch = KillSwitch(None)
    assert switch.active() is False


def test_kill_switch_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_GRAPHS_KILL_FILE", str(tmp_path / "k"))
    assert KillSwitch.from_env().path == str(tmp_path / "k")


def test_kill_switch_rejects_negative_interval():
    with pytest.raises(ValueError, match="interval_s"):
        KillSwitch("x", interval_s=-1)


def test_unproven_names_parse(monkeypatch):
    monkeypatch.delenv("MOE_GRAPHS_UNPROVEN", raising=False)
    assert envs.MOE_GRAPHS_UNPROVEN == frozenset()
    monkeypatch.setenv("MOE_GRAPHS_UNPROVEN", " fp8_kv, fp8 ,")
    assert envs.MOE_GRAPHS_UNPROVEN == {"fp8", "fp8_kv"}


def test_unproven_rejects_unknown_names(monkeypatch):
    monkeypatch.setenv("MOE_GRAPHS_UNPROVEN", "fp8,awq")
    with pytest.raises(ValueError, match=r"MOE_GRAPHS_UNPROVEN='fp8,awq'.*\['awq'\] not known"):
        envs.validate_all()
