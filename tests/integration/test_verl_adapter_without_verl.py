"""Without verl: recipe.m2po stays torch-only, and the verl adapter says how to install verl.

Runs with or without verl installed (verl is hidden from a child interpreter with ``sys.modules['verl'] = None``,
which makes every ``import verl`` fail as if it were absent).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

HIDE_VERL = "import sys; sys.modules['verl'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_VERL + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=180)


def test_recipe_works_without_verl_and_adapter_names_the_extra():
    out = _run("""
        import recipe.m2po, recipe.baselines, recipe.m2po.algorithm
        from recipe.registry import get_policy_loss_fn
        assert get_policy_loss_fn("m2po") is recipe.m2po.algorithm.compute_policy_loss_m2po
        assert not any(m == "verl" or m.startswith("verl.") for m in sys.modules if sys.modules[m] is not None)
        try:
            import recipe.verl
        except ImportError as exc:
            print("IMPORT-ERROR:", exc)
        else:
            raise SystemExit("recipe.verl imported without verl")
    """)
    assert out.returncode == 0, out.stderr
    assert 'IMPORT-ERROR:' in out.stdout
    # the hint names both ways to get the extra: a checkout and a built wheel (the package is on no index)
    assert 'pip install -e ".[verl]"' in out.stdout and '.whl[verl]' in out.stdout


def test_console_script_module_fails_with_the_install_hint():
    out = _run("""
        from recipe.verl.cli import main
        raise SystemExit(main([]))
    """)
    assert out.returncode != 0
    assert 'pip install -e ".[verl]"' in out.stderr and '.whl[verl]' in out.stderr
