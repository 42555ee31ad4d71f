"""``GRPOConfig``: TRL's GRPOConfig plus M2PO's threshold and FIPO's keys (names and defaults as in stalerl)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import trl

from recipe.fipo.algorithm import (
    DEFAULT_CLIP_RATIO_C,
    DEFAULT_DECAY_RATE,
    DEFAULT_INFLUENCE_CLIP_RATIO,
    DEFAULT_SAFETY_THRESHOLD,
)
from recipe.m2po.algorithm import DEFAULT_M2_THRESHOLD
from recipe.trl.losses import check_no_shadowing, trl_loss_types_from_source, validate_grpo_args
from recipe.versions import check_framework_version

check_framework_version("trl", where="recipe.trl")
# TRL's own loss names, read from the installed TRL: if it gained one of ours, ours would silently take it over.
TRL_SOURCES = (inspect.getsource(inspect.getmodule(trl.GRPOTrainer)), inspect.getsource(inspect.getmodule(trl.GRPOConfig)))
check_no_shadowing(trl_loss_types_from_source(*TRL_SOURCES), trl.__version__)


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL's GRPOConfig; ``loss_type`` also accepts ``"m2po"`` and ``"fipo"`` (stalerl's exact losses).

    Checked at construction: an unknown ``loss_type``, ``m2_threshold < 0``, FIPO keys out of range, and TRL options
    that do not apply to m2po/fipo each fail with one line naming the field.
    """

    m2_threshold: float = field(default=DEFAULT_M2_THRESHOLD, metadata={
        "help": "M2PO: tau, the bound on the second moment of the kept trust-region tokens' log-ratios (>= 0)."})
    fipo_decay_rate: float = field(default=DEFAULT_DECAY_RATE, metadata={
        "help": "FIPO: half-life in tokens of the Future-KL discount (> 0)."})
    fipo_clip_ratio_c: float = field(default=DEFAULT_CLIP_RATIO_C, metadata={
        "help": "FIPO: dual-clip constant c (> 1 + epsilon_high)."})
    fipo_influence_clip_ratio: float = field(default=DEFAULT_INFLUENCE_CLIP_RATIO, metadata={
        "help": "FIPO: eps_f, the influence-weight clip (>= 0; 0 = weights only capped at 10)."})
    fipo_influence_clip_high_only: bool = field(default=True, metadata={
        "help": "FIPO: clip weights to [1, 1+eps_f] (True) or [1-eps_f, 1+eps_f] (False)."})
    fipo_safety_threshold: float = field(default=DEFAULT_SAFETY_THRESHOLD, metadata={
        "help": "FIPO: for A < 0 tokens with ratio above this, the weight is clamped to [0.8, 1] (> 0)."})

    def __post_init__(self) -> None:
        check_framework_version("trl", where="recipe.trl")  # also at import; here a faked version is seen too
        super().__post_init__()  # sets steps_per_generation, which the rules read
        validate_grpo_args(self)
