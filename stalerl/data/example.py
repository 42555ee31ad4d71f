"""The record every data source produces."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Example"]


@dataclass(frozen=True)
class Example:
    """One GSM8K-format problem.

    ``question``: the problem text (no prompt template applied).
    ``answer``: the full worked answer, ending in ``#### N`` exactly as GSM8K writes it.
    ``final``: ``N`` as a string (commas and ``$`` removed), the reference for the reward.
    """

    question: str
    answer: str
    final: str

    def to_dict(self) -> dict:
        return asdict(self)
