"""constraints/cpu.txt: the default CPU environment's versions, which scripts/setup.sh installs from (beside its CPU
torch pin), so a fresh machine gets the versions the docs' results were made with; and the README's prediction
interval for one run, computed from the committed default study."""

from __future__ import annotations

import math
import re
import statistics

import pytest

from conftest import REPO

CONSTRAINTS = REPO / "constraints" / "cpu.txt"
SETUP = REPO / "scripts" / "setup.sh"
# The versions the committed results depend on: the README's numbers (transformers 5.10.4) and the figures' bytes
# (matplotlib 3.11.2 with pillow 13.0.0 write every committed PNG byte for byte with the code that made it).
KEY_PINS = {"transformers": "5.10.4", "matplotlib": "3.11.2", "pillow": "13.0.0", "gguf": "0.19.0"}
KEY_PACKAGES = ("transformers", "tokenizers", "safetensors", "numpy", "matplotlib", "pillow", "omegaconf", "pytest",
                "hypothesis", "pyarrow", "verl", "gguf", "accelerate")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        assert m, f"{CONSTRAINTS}: {line!r} is not an exact pin (name==version)"
        assert _norm(m[1]) not in pins, f"{m[1]} pinned twice"
        pins[_norm(m[1])] = m[2]
    return pins


def test_the_constraints_pin_the_key_packages_exactly():
    pins = _pins()
    for name in KEY_PACKAGES:
        assert name in pins, f"{name} is not pinned in {CONSTRAINTS}"
    for name, version in KEY_PINS.items():
        assert pins[name] == version


def test_the_constraints_cannot_drag_in_cuda_or_another_torch():
    pins = _pins()
    assert "torch" not in pins  # setup.sh pins torch itself (the CPU build; STALERL_TORCH_VERSION changes it)
    assert not [n for n in pins if n.startswith("nvidia-") or n in ("triton", "pytorch-triton")]
    assert not [v for v in pins.values() if "+cu" in v]


def test_the_default_extras_and_their_requirements_are_pinned():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins()
    wanted = list(project["dependencies"])
    for extra in ("test", "verl", "model"):
        wanted += project["optional-dependencies"].get(extra, [])
    names = {_norm(re.match(r"[A-Za-z0-9._-]+", req)[0]) for req in wanted}
    assert not sorted(names - set(pins) - {"torch"})


def test_setup_installs_the_default_extras_with_the_constraints_and_the_torch_pin():
    text = SETUP.read_text()
    assert "EXTRAS=${STALERL_EXTRAS:-test,verl,model}" in text
    assert "CONSTRAINTS=${STALERL_CONSTRAINTS:-constraints/cpu.txt}" in text
    install = next(line for line in text.splitlines() if 'pip install -q -e ".[${EXTRAS}]"' in line)
    assert '"${constraints[@]}"' in install
    assert 'constraints=(-c "$pin")' in text and 'constraints+=(-c "$CONSTRAINTS")' in text
    assert 'echo "torch==${TORCH_VERSION}" > "$pin"' in text


def test_readme_gives_the_prediction_interval_of_one_run_from_the_committed_default_study():
    from stalerl_study.report import load_summaries
    from stalerl_study.stats import t_quantile_975

    runs = [s for s in load_summaries([REPO / "docs" / "algorithms" / "results" / "default"])
            if s["status"] == "finished"]
    readme = " ".join((REPO / "README.md").read_text().split())

    def interval(key: str) -> str:
        x = [s["eval"][key] for s in runs]
        h = t_quantile_975(len(x) - 1) * statistics.stdev(x) * math.sqrt(1 + 1 / len(x))
        return f"{statistics.mean(x) - h:.2f}-{statistics.mean(x) + h:.2f}"

    assert f"mean ± t(0.975, {len(runs) - 1})·sd·√(1 + 1/{len(runs)})" in readme
    assert f"is **{interval('final')}** at step 300 ({interval('initial')} after the warm start)" in readme
