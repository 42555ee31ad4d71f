"""``stalerl-verl-config-path``: print the directory of the packaged verl config ``m2po_trainer.yaml``.

Launch verl's stock PPO entry point with it::

    python -m verl.trainer.main_ppo --config-path "$(stalerl-verl-config-path)" --config-name m2po_trainer ...
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0
    try:
        from recipe.verl import config_dir
    except ImportError as exc:
        print(f"stalerl-verl-config-path: {exc}", file=sys.stderr)
        return 1
    path = config_dir()
    if not (path / "m2po_trainer.yaml").is_file():
        print(f"stalerl-verl-config-path: {path / 'm2po_trainer.yaml'} is missing; reinstall stalerl",
              file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
