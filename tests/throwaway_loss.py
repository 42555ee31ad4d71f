"""A throwaway policy loss written into a temporary package, the way docs/adding-a-loss.md says (issue 37 item 3).

:func:`install` writes ONE module (its declaration, its function, its registration) plus the packaging metadata a
``pip install`` of it would leave (a ``*.dist-info`` with the ``recipe.losses`` entry point) into a directory. Put
that directory on ``PYTHONPATH`` and the runtime and every framework adapter find the loss, its parameter and its
metrics without any file of this repository being edited. The touch-list tests (one per CI lane) then run it
through the runtime and through each framework's own code path.

The loss: ``throwaway`` = ``tl_scale * (-A r)`` averaged like every loss (recipe.common.agg_loss), unclipped; its
parameter ``tl_scale`` (float > 0, default 1.0); its metrics ``throwaway/ratio_mean`` (token mean) and
``throwaway/num_tokens`` (a sum). With ``tl_scale = 1`` its loss equals the registered ``no_trust_region``'s, which
the tests use to check that the framework really ran it.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

NAME = "throwaway"
MODULE = "throwaway_loss_pkg"
PARAM = "tl_scale"

SOURCE = textwrap.dedent('''
    """A throwaway loss: its declaration, its function and its registration in one module."""
    import torch

    from recipe.common import agg_loss, check_inputs, clamp_log_ratio, global_batch_info, masked_log_ratio
    from recipe.declaration import MEAN, SUM, LossDeclaration, param
    from recipe.registry import register_policy_loss

    DECLARATION = LossDeclaration(
        name="throwaway",
        summary="tl_scale * (-A r), unclipped: a test of adding a loss in one file.",
        params=(param("tl_scale", 1.0, gt=0.0, help="throwaway: the loss's scale (> 0)."),),
        metrics={"throwaway/ratio_mean": MEAN, "throwaway/num_tokens": SUM},
    )


    @register_policy_loss(DECLARATION)
    def compute_policy_loss_throwaway(old_log_prob, log_prob, advantages, response_mask,
                                      loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
        p = DECLARATION.read(config)
        valid = check_inputs("throwaway", old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        ratio = torch.exp(clamp_log_ratio(masked_log_ratio(old_log_prob, log_prob, valid)))
        adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
        per_token = -adv * ratio * p.tl_scale
        if rollout_is_weights is not None:
            per_token = per_token * torch.where(valid, rollout_is_weights.detach().float(),
                                                torch.zeros_like(per_token))
        loss = agg_loss(per_token, valid, loss_agg_mode, **global_batch_info(config))
        with torch.no_grad():
            n = valid.sum()
            mean = torch.where(valid, ratio.detach(), torch.zeros_like(ratio)).sum() / n.clamp(min=1)
        return loss, {"throwaway/ratio_mean": float(mean), "throwaway/num_tokens": float(n)}
''')


def install(directory: os.PathLike) -> Path:
    """Write the loss module and its entry point into ``directory``; returns it (put it on PYTHONPATH)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{MODULE}.py").write_text(SOURCE)
    info = root / f"{MODULE}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[recipe.losses]\n{NAME} = {MODULE}\n")
    return root


def env_with(directory: os.PathLike, base: "dict[str, str] | None" = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``directory`` first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(directory), env.get("PYTHONPATH", "")) if p)
    return env
