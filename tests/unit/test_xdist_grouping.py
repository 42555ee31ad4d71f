"""tests/conftest.py under pytest-xdist (scripts/test.sh: ``-n 2 --dist loadgroup``): every test that starts a cluster
service (Slurm, Ray) gets the one ``services`` group, so two clusters never run at once, and each worker hands the
longest tests out first, in the same order (xdist refuses workers whose collections differ)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import conftest


class _Item:
    def __init__(self, nodeid: str, markers=(), fixtures=()):
        self.nodeid, self._markers, self.fixturenames, self.added = nodeid, set(markers), list(fixtures), []

    def get_closest_marker(self, name):
        return object() if name in self._markers else None

    def add_marker(self, mark):
        self.added.append(mark)


def _config(xdist: bool = True):
    return SimpleNamespace(pluginmanager=SimpleNamespace(hasplugin=lambda name: xdist and name == "xdist"))


def _groups(item) -> list[str]:
    return [m.mark.args[0] for m in item.added if m.mark.name == "xdist_group"]


def _items():
    return [_Item("tests/unit/test_a.py::test_fast"),
            _Item("tests/integration/test_x.py::test_ray_job", markers={"ray"}),
            _Item("tests/integration/test_slurm.py::test_submit", markers={"slurm"}),
            _Item("tests/integration/test_y.py::test_uses_cluster", fixtures=["tmp_path", "slurm_cluster"]),
            _Item("tests/e2e/test_gpu_check_cpu.py::test_gpu_check_cpu_dry_mode_with_the_real_model_reports_every_figure"),
            _Item("tests/unit/test_fsdp.py::test_one")]


def test_service_tests_share_one_group_and_others_get_none(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = _items()
    conftest._group_for_xdist(_config(), items)
    assert [_groups(i) for i in items] == [[], ["services"], ["services"], ["services"], [], []]
    assert [i.nodeid for i in items] == [i.nodeid for i in _items()]  # not a worker: the order is the files'


def test_a_worker_hands_the_longest_tests_out_first_in_a_fixed_order(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    items = _items()
    conftest._group_for_xdist(_config(), items)
    assert [i.nodeid.split("::")[0] for i in items] == [
        "tests/e2e/test_gpu_check_cpu.py", "tests/integration/test_slurm.py", "tests/unit/test_fsdp.py",
        "tests/unit/test_a.py", "tests/integration/test_x.py", "tests/integration/test_y.py"]


def test_without_xdist_nothing_changes(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    items = _items()
    conftest._group_for_xdist(_config(xdist=False), items)
    assert all(not i.added for i in items) and [i.nodeid for i in items] == [i.nodeid for i in _items()]


@pytest.mark.parametrize("prefix", conftest._LONG_FIRST)
def test_every_long_first_entry_names_a_file_that_exists(prefix):
    assert (conftest.REPO / prefix.split("::")[0]).is_file(), prefix
