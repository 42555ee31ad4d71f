"""Fixtures shared by the AReaL tests: a tiny Qwen2 + the char tokenizer as a local HF directory (built, never
downloaded), and the single-rank gloo environment AReaL's FSDP engine reads.

The tests import them; a conftest.py here would shadow tests/conftest.py, which other test modules import as
``conftest``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from stalerl.core.model import build_char_tokenizer, build_tiny_model

    # MASTER_PORT=0: this one rank's env:// store binds a port the OS picks and holds it (no rank needs to know
    # it), so no other process can take it between choosing and binding (tests/_ports.py)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "0", "AREAL_SPMD_MODE": "1"}.items():
        os.environ.setdefault(key, value)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model("qwen2", tokenizer, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
