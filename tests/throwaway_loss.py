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


# ---------------------------------------------------------------------------------------------- bad neighbours
# Plugins installed beside the good one to show that each is refused alone (issue 44 item 1). ``clashing`` is named
# after a framework's own loss and is otherwise fine: torch-free declaration module + algorithm module, the layout
# docs/adding-a-loss.md gives (its entry point names the declaration; the arithmetic loads on first use).

CLASH_DECLARATION = textwrap.dedent('''
    """A loss named after {framework}'s own {name!r}: its declaration (torch-free)."""
    from recipe.declaration import MEAN, LossDeclaration, param

    DECLARATION = LossDeclaration(
        name={name!r},
        summary="cl_scale * (-A r): a plugin that forgot framework_names.",
        params=(param("cl_scale", 1.0, gt=0.0, help="{name}: the loss's scale (> 0)."),),
        metrics={{"{name}/ratio_mean": MEAN}},
        algorithm="{module}_algorithm",
    )
''')

CLASH_ALGORITHM = textwrap.dedent('''
    import torch

    from recipe.common import agg_loss, check_inputs, clamp_log_ratio, global_batch_info, masked_log_ratio
    from recipe.registry import register_policy_loss
    from {module} import DECLARATION


    @register_policy_loss(DECLARATION)
    def compute_policy_loss_clash(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                  config=None, rollout_is_weights=None):
        p = DECLARATION.read(config)
        valid = check_inputs({name!r}, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        ratio = torch.exp(clamp_log_ratio(masked_log_ratio(old_log_prob, log_prob, valid)))
        adv = torch.where(valid, advantages.detach().float(), torch.zeros((), device=valid.device))
        loss = agg_loss(-adv * ratio * p.cl_scale, valid, loss_agg_mode, **global_batch_info(config))
        n = valid.sum().clamp(min=1)
        return loss, {{"{name}/ratio_mean": float(torch.where(valid, ratio.detach(), 0.0).sum() / n)}}
''')

#: plugin name -> (module, source): one that fails to import, one that takes a built-in's name, one that takes the
#: shared PPO clip's key, one that redeclares another loss's parameter differently.
BROKEN = {
    "broken_import": ("broken_loss_pkg", "raise ImportError('this plugin is broken on purpose')\n"),
    "name_thief": ("name_thief_pkg", textwrap.dedent('''
        from recipe.declaration import LossDeclaration
        DECLARATION = LossDeclaration(name="m2po", summary="takes a built-in's name", algorithm="nowhere")
    ''')),
    "clip_thief": ("clip_thief_pkg", textwrap.dedent('''
        from recipe.declaration import LossDeclaration, param
        DECLARATION = LossDeclaration(name="clip_thief", summary="declares the PPO clip as its own",
                                      params=(param("eps_clip", 0.5, ge=0.0, help="mine"),), algorithm="nowhere")
    ''')),
    "tau_thief": ("tau_thief_pkg", textwrap.dedent('''
        from recipe.declaration import LossDeclaration, param
        DECLARATION = LossDeclaration(name="tau_thief", summary="redeclares m2po's tau",
                                      params=(param("m2_threshold", 0.5, ge=0.0, help="mine"),), algorithm="nowhere")
    ''')),
}


def _entry_point(root: Path, plugin: str, module: str) -> None:
    info = root / f"{module}-0.0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[recipe.losses]\n{plugin} = {module}\n")


def install_clashing(directory: os.PathLike, name: str, framework: str) -> str:
    """Write, beside whatever ``directory`` holds, a plugin whose loss is named ``name`` (one of ``framework``'s
    own losses), with parameter ``cl_scale``; returns the loss's name."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    module = f"clash_{name}_pkg"
    (root / f"{module}.py").write_text(CLASH_DECLARATION.format(name=name, framework=framework, module=module))
    (root / f"{module}_algorithm.py").write_text(CLASH_ALGORITHM.format(name=name, module=module))
    _entry_point(root, name, module)
    return name


def install_broken(directory: os.PathLike) -> tuple[str, ...]:
    """Write the :data:`BROKEN` plugins into ``directory``; returns their plugin names."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for plugin, (module, source) in BROKEN.items():
        (root / f"{module}.py").write_text(source)
        _entry_point(root, plugin, module)
    return tuple(BROKEN)
