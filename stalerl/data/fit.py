"""Does the data fit the run? Checked as soon as the examples are loaded, before the model, the warm start or any
worker: a training set too small for the batch or for the warm start's held-out problems, or a validation set too
small for the evaluation, is one line naming the keys to change (the real-data keys; the synthetic generator's size
only when the data is synthetic), exit code 2.
"""

from __future__ import annotations

from typing import Any, Sequence

from stalerl.core.errors import UserError
from stalerl.data.example import Example


class DataDoesNotFit(UserError):
    """The dataset is too small (or too repetitive) for what the config asks of it."""


def _is_synthetic(path: str) -> bool:
    return path == "synthetic" or path.startswith("synthetic:")


def _more_data(cfg: Any, section: str) -> str:
    """How to get more examples for ``section`` (train_dataset / valid_dataset)."""
    path = getattr(cfg, section).path
    if _is_synthetic(path):
        size = "train_size" if section == "train_dataset" else "test_size"
        return f"raise {section}.synthetic.{size}"
    return f"point {section}.path at a larger dataset"


def fit_problems(cfg: Any, train: Sequence[Example], valid: Sequence[Example], *, stage: str = "",
                 evaluation_size: bool = True) -> list[str]:
    """The ways ``train``/``valid`` are too small for ``cfg`` (empty when they fit). ``stage`` says which examples
    these are (e.g. after the prompt-length filter). ``evaluation_size``: also require ``evaluator.n_prompts``
    validation examples (checked on the file as loaded; the length filter may then evaluate on fewer)."""
    out = []
    where = f" ({stage})" if stage else ""
    td, n = cfg.train_dataset, len(train)
    src = f"train_dataset.path={td.path!r}"
    if n == 0:
        return [f"{src} has no training examples{where}; {_more_data(cfg, 'train_dataset')}"]
    if td.drop_last and td.batch_size > n:
        out.append(f"train_dataset.batch_size={td.batch_size} exceeds the {n} training examples of {src}{where} "
                   f"(train_dataset.drop_last=true: no batch could be drawn); lower train_dataset.batch_size to at "
                   f"most {n}, or {_more_data(cfg, 'train_dataset')}")
    ws = cfg.warm_start
    if ws.target_accuracy > 0 and ws.steps > 0:
        k = ws.eval_problems
        fixed = "or warm_start.target_accuracy=0 (a fixed-length warm start holds nothing out)"
        if k >= n:
            out.append(f"warm_start.eval_problems={k} holds out all {n} training examples of {src}{where}; lower "
                       f"warm_start.eval_problems below {n}, {fixed}, or {_more_data(cfg, 'train_dataset')}")
        else:
            held = {e.question for e in train[-k:]}
            left = sum(1 for e in train if e.question not in held)
            if left == 0:
                distinct = len({e.question for e in train})
                out.append(f"warm_start.eval_problems={k}: the last {k} rows of {src}{where} repeat every training "
                           f"problem ({distinct} distinct questions in {n} rows), so the supervised warm start would "
                           f"have nothing left to learn from; remove the duplicate rows, lower "
                           f"warm_start.eval_problems, {fixed}")
    ev, nv = cfg.evaluator, len(valid)
    if ev.freq_steps:  # (evaluations run only with freq_steps; at_start adds one at step 0)
        vsrc = f"valid_dataset.path={cfg.valid_dataset.path!r}"
        if nv == 0:
            out.append(f"{vsrc} has no validation examples{where}; {_more_data(cfg, 'valid_dataset')}, or "
                       "evaluator.freq_steps=0 evaluator.at_start=false to train without evaluation")
        elif evaluation_size and ev.n_prompts > nv:
            out.append(f"evaluator.n_prompts={ev.n_prompts} but {vsrc} has {nv} validation examples{where}; lower "
                       f"evaluator.n_prompts to at most {nv}, or {_more_data(cfg, 'valid_dataset')}")
    return out


def check_data_fits(cfg: Any, train: Sequence[Example], valid: Sequence[Example], *, stage: str = "",
                    evaluation_size: bool = True) -> None:
    problems = fit_problems(cfg, train, valid, stage=stage, evaluation_size=evaluation_size)
    if problems:
        raise DataDoesNotFit("the data does not fit this run: " + "; ".join(problems))
