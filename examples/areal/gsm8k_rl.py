"""AReaL's GSM8K RL example script (``examples/math/gsm8k_rl.py`` of areal 1.0.4), switched to the exact losses.

The one change to AReaL's script: its two imports

    from areal import PPOTrainer
    from areal.api.cli_args import GRPOConfig, load_expr_config

become the import of ``PPOTrainer`` and ``GRPOConfig`` from ``recipe.areal`` (below). Those are AReaL's classes with
``actor.loss`` / ``actor.fipo_*`` added; with ``actor.loss`` unset the run is AReaL's own. The config then chooses
the loss (``gsm8k_m2po.yaml`` next to this file). In single-controller mode AReaL builds the actor engine in its
worker processes from the class's import path (``recipe.areal.fsdp.ExactLossFSDPPPOActor``), so ``stalerl`` must be
installed in the workers' environment too (it is, when they share this one).
"""

from __future__ import annotations

import sys

from areal.api.cli_args import load_expr_config

from recipe.areal import GRPOConfig, PPOTrainer  # the one change: AReaL's PPOTrainer and GRPOConfig, extended


def load_config(argv: list[str]) -> GRPOConfig:
    """AReaL's own loader and command line: ``--config FILE`` then ``key=value`` overrides."""
    config, _ = load_expr_config(argv, GRPOConfig)
    return config


def main(argv: list[str]) -> None:
    from areal.dataset import get_custom_dataset
    from areal.utils.hf_utils import load_hf_tokenizer

    config = load_config(argv)
    tokenizer = load_hf_tokenizer(config.tokenizer_path)
    train_dataset = get_custom_dataset(split="train", dataset_config=config.train_dataset, tokenizer=tokenizer)
    valid_dataset = get_custom_dataset(split="test", dataset_config=config.valid_dataset, tokenizer=tokenizer)
    workflow_kwargs = dict(reward_fn="areal.reward.gsm8k.gsm8k_reward_fn", gconfig=config.gconfig,
                           tokenizer=config.tokenizer_path, enable_thinking=False)
    eval_workflow_kwargs = dict(workflow_kwargs, gconfig=config.gconfig.new(temperature=0.6))
    with PPOTrainer(config, train_dataset=train_dataset, valid_dataset=valid_dataset) as trainer:
        trainer.train(workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=workflow_kwargs,
                      eval_workflow="areal.workflow.rlvr.RLVRWorkflow", eval_workflow_kwargs=eval_workflow_kwargs)


if __name__ == "__main__":
    main(sys.argv[1:])
