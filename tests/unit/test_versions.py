"""recipe.versions: the one version guard every adapter calls, and the CI pins it holds."""

import warnings

import pytest

from recipe import versions
from recipe.versions import (ALLOW_ENV, FRAMEWORKS, UntestedFrameworkVersion, check_framework_version, in_range,
                             parse_version)


@pytest.mark.parametrize("text, expected", [
    ("1.16.0", (1, 16, 0)), ("1.16", (1, 16)), ("1.17.0rc1", (1, 17, 0)), ("2.13.0+cpu", (2, 13, 0)),
    ("v0.10.1.dev3", (0, 10, 1)),
])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_parse_version_rejects_text():
    with pytest.raises(ValueError, match="not a version"):
        parse_version("latest")


@pytest.mark.parametrize("version, spec, ok", [
    ("1.16.0", ">=1.16,<1.17", True), ("1.16.9", ">=1.16,<1.17", True), ("1.17.0", ">=1.16,<1.17", False),
    ("1.15.2", ">=1.16,<1.17", False), ("1.0.4", ">=1.0.4,<1.1", True), ("1.0.3", ">=1.0.4,<1.1", False),
    ("1.17.0rc1", ">=1.16,<1.17", False), ("0.10", "==0.10.0", True), ("0.10.1", "!=0.10.1", False),
    ("3", ">2,<=3", True),
])
def test_in_range(version, spec, ok):
    assert in_range(version, spec) is ok


def test_every_ci_pin_is_inside_its_tested_range():
    for framework in FRAMEWORKS.values():
        assert in_range(framework.ci, framework.tested), framework


def test_refuses_an_untested_version_in_one_line(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UntestedFrameworkVersion) as err:
        check_framework_version("trl", "1.17.0", where="recipe.trl")
    text = str(err.value)
    assert "\n" not in text
    assert "trl 1.17.0" in text and ">=1.16,<1.17" in text and ALLOW_ENV in text and "recipe.trl" in text


@pytest.mark.parametrize("value", ["1", "trl", "verl, trl"])
def test_override_warns_and_passes(monkeypatch, value):
    monkeypatch.setenv(ALLOW_ENV, value)
    versions._warned.clear()
    with pytest.warns(RuntimeWarning, match="outside the tested range"):
        assert check_framework_version("trl", "1.18.2") == "1.18.2"
    with warnings.catch_warnings():  # once per process and version
        warnings.simplefilter("error")
        check_framework_version("trl", "1.18.2")


def test_override_for_another_framework_does_not_apply(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "verl")
    with pytest.raises(UntestedFrameworkVersion):
        check_framework_version("trl", "1.18.2")


def test_tested_version_and_absent_framework_pass(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert check_framework_version("areal", "1.0.4") == "1.0.4"
    monkeypatch.setattr(versions, "installed_version", lambda key: None)
    assert check_framework_version("areal") is None


def test_cli_prints_the_ci_pin(capsys):
    assert versions._main(["ci", "trl"]) == 0
    assert capsys.readouterr().out.strip() == f"trl=={FRAMEWORKS['trl'].ci}"
    assert versions._main(["bogus"]) == 2
