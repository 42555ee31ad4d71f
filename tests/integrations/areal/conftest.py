"""Shared by the AReaL tests: a tiny Qwen2 + the char tokenizer as a local HF directory (built, never downloaded),
and the single-rank gloo environment AReaL's FSDP engine reads."""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port()), "AREAL_SPMD_MODE": "1"}.items():
        os.environ.setdefault(key, value)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model("qwen2", tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path



def pytest_collection_modifyitems(config, items):
    """areal-marked tests need AReaL (its own virtual environment): skipped with the reason where it is missing (a
    marker, not a module-level skip, so runs that deselect them report nothing), an error with
    STALERL_REQUIRE_AREAL=1."""
    if importlib.util.find_spec("areal") is not None:
        return
    areal_items = [item for item in items if item.get_closest_marker("areal") is not None]
    reason = ("areal is not importable here; the AReaL tests run in their own virtual environment "
              "(bash scripts/ci_areal.sh)")
    if areal_items and os.environ.get("STALERL_REQUIRE_AREAL") == "1":
        raise pytest.UsageError("STALERL_REQUIRE_AREAL=1 but " + reason)
    for item in areal_items:
        item.add_marker(pytest.mark.skip(reason=reason))
