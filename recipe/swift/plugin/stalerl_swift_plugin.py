"""ms-swift plugin: ``swift rlhf --rlhf_type grpo --loss_type m2po --external_plugins $(python -m recipe.swift)``.

Imported by path by ms-swift while it parses its arguments. It

1. checks the installed ms-swift against the tested range (``recipe.versions``; one line outside it, unless
   ``STALERL_ALLOW_UNTESTED_FRAMEWORKS`` lets it through) and the ``STALERL_M2*`` / ``STALERL_FIPO_*`` /
   ``STALERL_SWIFT_*`` environment variables (unknown names, bad values: one line);
2. points ms-swift's GRPO trainer (``TrainerFactory.TRAINER_MAPPING['grpo']``) at
   :class:`recipe.swift.trainer.GRPOTrainer`, which adds every ``recipe.registry`` loss as a ``--loss_type``
   (``m2po``, ``fipo_ref``, ...) and leaves every other loss type to ms-swift;
3. adds the adapter's argument checks to ``RLHFArguments._check_grpo``, which ms-swift runs after importing the
   plugins and before it loads the model, so unsupported flag combinations fail before any work;
4. in a Megatron-SWIFT run, refuses the recipe losses when the trainer is built (not supported there yet).

Importing it again (dataloader workers replay plugins) changes nothing.
"""

import sys

from recipe.swift.config import check_environment, check_swift_args, swift_loss_types
from recipe.versions import check_framework_version

check_framework_version("ms-swift", where="recipe.swift")
check_environment()

from swift.arguments import RLHFArguments  # noqa: E402  (ms-swift is there: it is importing this file)
from swift.trainers import TrainerFactory  # noqa: E402

TRAINER = "recipe.swift.trainer.GRPOTrainer"
TrainerFactory.TRAINER_MAPPING["grpo"] = TRAINER

if not getattr(RLHFArguments._check_grpo, "_stalerl_checks", False):
    _swift_check_grpo = RLHFArguments._check_grpo

    def _check_grpo(self) -> None:
        _swift_check_grpo(self)
        if getattr(self, "rlhf_type", None) == "grpo":
            check_swift_args(self)

    _check_grpo._stalerl_checks = True
    RLHFArguments._check_grpo = _check_grpo

# Megatron-SWIFT (`megatron rlhf`) imports the plugins too, with its own GRPO trainer: the recipe losses are not
# implemented there (docs/integrations/swift.md). Refuse them when the trainer is built instead of letting
# Megatron's loss fail with "Unknown loss type" at the first step.
_megatron = sys.modules.get("swift.megatron.pipelines.train.rlhf")
if _megatron is not None and not getattr(_megatron.MegatronRLHF.prepare_trainer, "_stalerl_checks", False):
    _megatron_prepare_trainer = _megatron.MegatronRLHF.prepare_trainer

    def _prepare_trainer(self):
        if getattr(self.args, "loss_type", None) in swift_loss_types():
            raise ValueError(f"--loss_type {self.args.loss_type} is not supported by Megatron-SWIFT yet (only by "
                             "`swift rlhf`, ms-swift's HF trainer; see docs/integrations/swift.md). Fix: use "
                             "`swift rlhf --rlhf_type grpo`, or one of Megatron's own loss types")
        return _megatron_prepare_trainer(self)

    _prepare_trainer._stalerl_checks = True
    _megatron.MegatronRLHF.prepare_trainer = _prepare_trainer
