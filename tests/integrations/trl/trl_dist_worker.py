"""One rank of a multi-process TRL run (launched by torch.distributed.run from test_trl_multiprocess.py): trains
m2po through recipe.trl.GRPOTrainer and saves what each micro-batch's loss call received, the weights and the log."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_trl_grpo import SGD, SPLIT_TAU, _capturing_trainer, _train  # noqa: E402


def main() -> None:
    per_device, ga, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    trainer = _train(Path(tempfile.mkdtemp()), _capturing_trainer(), loss_type="m2po", m2_threshold=SPLIT_TAU,
                     per_device_train_batch_size=per_device, gradient_accumulation_steps=ga, max_steps=2, **SGD)
    rank = int(os.environ["RANK"])
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.save({"calls": trainer.calls, "weights": state, "log": trainer.state.log_history,
                "num_processes": trainer.accelerator.num_processes}, f"{out}_rank{rank}.pt")


if __name__ == "__main__":
    main()
