"""Old target of the ``stalerl-verl-config-path`` script (installs made before the move): :func:`recipe.verl.cli.main`,
which prints the packaged configs' directory, now ``recipe/verl/config``."""
# restructure: keep-old-paths (a compat module: /work/wt-tools/restructure.py neither moves nor rewrites it)

from recipe.verl.cli import main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
