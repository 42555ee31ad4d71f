"""Did-you-mean for unknown keys: close keys, the same name in another section, and AReaL spellings renamed here."""

import difflib
from typing import Dict, List, Tuple

from stalerl.config.schema import ExperimentConfig, _schema


def _suggest(key: str, config_cls: type) -> List[str]:
    """Did-you-mean candidates for an unknown dotted key (at most 2), best first.

    A close key in the same section wins; then the same leaf name in another section (``actor.max_head_offpolicyness``
    -> ``rollout.max_head_offpolicyness``); then close keys or close leaf names anywhere.
    """
    schema = _schema(config_cls)
    keys = [k for k in schema if not k.startswith(key + ".")]
    parent, _, leaf = key.rpartition(".")

    def split(k: str) -> Tuple[str, str]:
        p, _, l = k.rpartition(".")
        return p, l

    siblings = {split(k)[1]: k for k in keys if split(k)[0] == parent}
    ranked = [k for n, k in siblings.items() if len(leaf) >= 3 and (n.startswith(leaf) or leaf.startswith(n))]
    ranked += [siblings[n] for n in difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.7)]
    ranked += [k for k in keys if split(k)[1] == leaf and split(k)[0] != parent]
    ranked += difflib.get_close_matches(key, keys, n=2, cutoff=0.8)
    by_leaf: Dict[str, List[str]] = {}
    for k in keys:
        by_leaf.setdefault(split(k)[1], []).append(k)
    for name in difflib.get_close_matches(leaf, list(by_leaf), n=2, cutoff=0.8):
        ranked += by_leaf[name]
    out: List[str] = []
    for k in ranked:
        if k not in out and k != parent:
            out.append(k)
    return out[:2]


# AReaL spellings that have a different name here.
_RENAMED = {
    "recompute_logprob": "actor.behavior_logp=recompute",
    "recompute_logprobs": "actor.behavior_logp=recompute",
    "kl_ctl": "actor.kl_coef",
    "allocation_mode": "rollout.backend and actor.backend (e.g. rollout.backend=sglang:d2 actor.backend=fsdp:d1)",
    "clip_ratio": "actor.eps_clip",
    "clip_ratio_c": "actor.c_clip",
    "loss_mode": "actor.loss",
}


def _unknown_key_message(key: str, config_cls: type, source: str) -> str:
    msg = f"unknown config key {key!r} ({source})"
    suggestions = _suggest(key, config_cls)
    renamed = _RENAMED.get(key.rpartition(".")[2])
    if renamed and config_cls is ExperimentConfig:
        msg += f"; this setting is called {renamed} here."
    elif suggestions:
        msg += "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
    else:
        msg += "."
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    schema = _schema(config_cls)
    if parent in schema or parent == "":
        siblings = [k.rsplit(".", 1)[-1] for k in schema if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
        where = f"'{parent}'" if parent else "the top level"
        msg += f" Valid keys in {where}: {', '.join(siblings)}."
    msg += " Run with --help to list every key."
    return msg
