"""AReaL config classes with the exact-loss keys: ``actor.loss`` and FIPO's ``actor.fipo_*``.

They subclass AReaL's own dataclasses, so AReaL's loader (``load_expr_config``) reads an AReaL yaml with the new keys,
refuses unknown ones as usual, and AReaL's RPC serialisation carries the subclass (by import path) to the remote
workers of single-controller mode. With ``actor.loss`` unset everything is AReaL's, including the meaning of
``actor.m2_threshold`` (AReaL's own M2PO variant); with ``actor.loss: m2po`` that key is Algorithm 1's tau.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal.api.cli_args import GRPOConfig as _AReaLGRPOConfig
from areal.api.cli_args import PPOActorConfig
from areal.api.cli_args import PPOConfig as _AReaLPPOConfig

from recipe.areal.rules import check_areal_version, check_exact_loss_config
from recipe.fipo.algorithm import (
    DEFAULT_CLIP_RATIO_C,
    DEFAULT_DECAY_RATE,
    DEFAULT_INFLUENCE_CLIP_RATIO,
    DEFAULT_SAFETY_THRESHOLD,
)
from recipe.registry import BUILTIN_POLICY_LOSSES


@dataclass
class ExactLossPPOActorConfig(PPOActorConfig):
    """AReaL's ``PPOActorConfig`` plus the keys of the exact losses (names as in stalerl's ``actor.*``)."""

    loss: str | None = field(
        default=None,
        metadata={"help": "Exact stale-rollout policy loss from recipe.registry that replaces AReaL's grpo_loss_fn "
                          "(m2po: the M2PO paper's Algorithm 1, tau = m2_threshold, default 0.04; fipo; vanilla; "
                          "no_trust_region). null = AReaL's own loss, m2_threshold keeping AReaL's meaning.",
                  "choices": list(BUILTIN_POLICY_LOSSES)},
    )
    fipo_decay_rate: float = field(default=DEFAULT_DECAY_RATE, metadata={
        "help": "FIPO: half-life in tokens of the Future-KL discount, gamma = 2^(-1/decay_rate)."})
    fipo_clip_ratio_c: float = field(default=DEFAULT_CLIP_RATIO_C, metadata={
        "help": "FIPO: dual-clip constant c (> 1 + the upper eps clip); an A<0 sequence with more than one token "
                "of ratio > c is dropped."})
    fipo_influence_clip_ratio: float = field(default=DEFAULT_INFLUENCE_CLIP_RATIO, metadata={
        "help": "FIPO: eps_f, the influence-weight clip; 0 = weights capped at 10 only."})
    fipo_influence_clip_high_only: bool = field(default=True, metadata={
        "help": "FIPO: clip influence weights to [1, 1+eps_f] (true) or [1-eps_f, 1+eps_f] (false)."})
    fipo_safety_threshold: float = field(default=DEFAULT_SAFETY_THRESHOLD, metadata={
        "help": "FIPO: for A<0 tokens with ratio above this, the influence weight is clamped into [0.8, 1]."})

    def __post_init__(self) -> None:
        check_areal_version()
        super().__post_init__()
        check_exact_loss_config(self)


@dataclass
class PPOConfig(_AReaLPPOConfig):
    """AReaL's ``PPOConfig`` whose ``actor`` accepts the exact-loss keys."""

    actor: ExactLossPPOActorConfig = field(default_factory=ExactLossPPOActorConfig)


@dataclass
class GRPOConfig(_AReaLGRPOConfig):
    """AReaL's ``GRPOConfig`` whose ``actor`` accepts the exact-loss keys (what ``gsm8k_rl.py`` loads)."""

    actor: ExactLossPPOActorConfig = field(default_factory=ExactLossPPOActorConfig)
