"""One data-parallel rank for tests/integration/test_verl_plugin.py, run in a fresh interpreter.

    python _verl_rank_worker.py RANK WORLD PORT TAU OUT_PATH

1. Registration: nothing of ``recipe`` is imported before ``import verl``. With the default plugin policy, ``import
   verl`` alone must make ``get_policy_loss_fn(name)`` return the functions of ``recipe.registry``. A rank started
   with ``VERL_USE_EXTERNAL_PLUGINS=none`` checks the backstop instead: nothing is registered after ``import verl``,
   and instantiating the config class through Hydra (as verl's workers do) registers the losses.
2. verl's own ``ppo_loss`` on this rank's shard of the case (one micro-batch, nested layout), ``m2_scope: dp_group``
   over a gloo group, with verl's global batch info; backward. The parent compares with the whole-batch algorithm.
"""

from __future__ import annotations

import os
import sys
import time

RECIPE_BEFORE = sorted(m for m in sys.modules if m == "recipe" or m.startswith("recipe."))

import torch  # noqa: E402

import _verl_cases as C  # noqa: E402  (torch only)

NAMES = {"m2po": "m2po", "stalerl_vanilla": "vanilla", "no_trust_region": "no_trust_region", "fipo": "fipo"}


def main() -> None:
    rank, world, port, tau, out_path = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]),
                                        sys.argv[5])
    result: dict = {"pid": os.getpid(), "recipe_before": RECIPE_BEFORE,
                    "plugins_policy": os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto")}
    t0 = time.time()
    import verl  # noqa: F401
    from verl.trainer.ppo import core_algos

    result["import_verl_s"] = time.time() - t0
    result["plugin_loaded_by_verl"] = "recipe.verl.plugin" in sys.modules
    result["registered_after_import"] = sorted(n for n in NAMES if n in core_algos.POLICY_LOSS_REGISTRY)

    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    # what verl's worker does with actor_rollout_ref.actor.policy_loss (init_model -> omega_conf_to_dataclass)
    policy_loss = omega_conf_to_dataclass(OmegaConf.create({
        "_target_": "recipe.verl.config.M2POPolicyLossConfig",
        "loss_mode": "m2po", "m2_threshold": tau, "m2_scope": "dp_group",
    }))

    import recipe.verl

    result["identity_after_config"] = {
        n: core_algos.get_policy_loss_fn(n) is recipe.verl.loss_function(n) for n in NAMES
    }

    import torch.distributed as dist
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    # a client of the store the test process holds on the port (tests/_ports.py): no rank binds it
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank,
                            world_size=world)
    try:
        case = C.make_case()
        bsz = len(case["response_lens"])
        per_rank = bsz // world
        rows = list(range(rank * per_rank, (rank + 1) * per_rank))
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=per_rank,
                             policy_loss=policy_loss)
        flat = C.flat_for_rows(case, rows).requires_grad_(True)
        td = C.build_td(case, rows, "nested", dp_size=world, batch_num_tokens=C.num_tokens(case),
                        global_batch_size=bsz)
        loss, metrics = ppo_loss(config, C.model_output(flat, case, rows, "nested"), td)
        loss.backward()
        result.update(rows=rows, loss=loss.detach(), grad=flat.grad.detach(),
                      metrics={k: [float(v) for v in m.values] for k, m in metrics.items()})
    finally:
        dist.destroy_process_group()
    torch.save(result, out_path)


if __name__ == "__main__":
    main()
