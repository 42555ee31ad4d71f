"""DPPO's declarations (torch-free): one loss per divergence, each with its trust-region radius delta.

The arithmetic is in recipe/dppo/algorithm.py. Names: ``dppo_tv`` / ``dppo_kl`` are the loss modes users know from
verl's DPPO page and the authors' scripts; verl 0.9.1 ships losses of those names (with a truncated ratio and the
log-prob form of the surrogate, docs/algorithms/dppo.md), so in verl these are ``stalerl_dppo_tv`` /
``stalerl_dppo_kl``. TRL 1.16 and ms-swift ship no DPPO ``loss_type``: there they keep their own names.

Each loss has its own delta key (not the PPO clip: a divergence radius is no ratio range, and the two divergences
want different radii): the defaults are the authors' (verl's ``examples/dppo_trainer``: 0.15 for TV, 0.05 for KL).
"""

from recipe.declaration import MAX, MEAN, SUM, LossDeclaration, param


def _metrics(name: str) -> dict:
    return {
        f"{name}/masked_fraction": MEAN,  # share of the valid tokens M_t drops
        f"{name}/num_masked_tokens": SUM,
        f"{name}/num_masked_pos_adv": SUM,  # dropped with A > 0 (the policy rose past delta)
        f"{name}/num_masked_neg_adv": SUM,  # dropped with A < 0 (the policy fell past delta)
        f"{name}/divergence_mean": MEAN,  # the binary divergence over the valid tokens
        f"{name}/divergence_max": MAX,
        f"{name}/ppo_kl": MEAN,  # mean log(pi_behaviour / pi_theta) over the valid tokens
    }


def _declaration(name: str, divergence: str, delta: float, summary: str) -> LossDeclaration:
    key = f"{name}_delta"
    return LossDeclaration(
        name=name,
        summary=summary,
        params=(param(key, delta, gt=0.0,
                      help=f"{name}: the trust-region radius delta of the binary {divergence} between the current "
                           f"and the behaviour policy (> 0); a token whose divergence exceeds it in the direction of "
                           f"its advantage is dropped."),),
        framework_names={"verl": f"stalerl_{name}"},  # verl ships its own dppo_tv / dppo_kl
        metrics=_metrics(name),
        diagnostics=(f"{name}/masked_fraction", f"{name}/num_masked_pos_adv", f"{name}/num_masked_neg_adv"),
    )


DPPO_TV = _declaration(
    "dppo_tv", "total variation |pi - mu|", 0.15,
    "DPPO-Binary-TV (arXiv 2602.04879): -M r A token-mean over the step; M drops a token whose |pi - mu| exceeds "
    "dppo_tv_delta with pi moved the way its advantage pushes (A > 0: up, A < 0: down).")
DPPO_KL = _declaration(
    "dppo_kl", "KL(mu || pi) of the sampled token vs the rest", 0.05,
    "DPPO-Binary-KL (arXiv 2602.04879): -M r A token-mean over the step; M drops a token whose binary KL(mu || pi) "
    "exceeds dppo_kl_delta with pi moved the way its advantage pushes (A > 0: up, A < 0: down).")

DECLARATIONS = (DPPO_TV, DPPO_KL)
