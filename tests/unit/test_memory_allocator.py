"""stalerl.core.launch_env.configure_allocator: a fixed glibc mmap threshold, so freed tensor buffers go back to the
kernel instead of staying in malloc's arenas (bench/real_model_memory.py measures the effect on the real model)."""

import json
import os
import subprocess
import sys

import pytest

from stalerl.core import launch_env
from stalerl.core.launch_env import (DEFAULT_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_ENV, MALLOC_MMAP_THRESHOLD_ENV,
                                     parse_mmap_threshold)

glibc = pytest.mark.skipif(launch_env._glibc() is None, reason="glibc malloc only")

# A fresh process: optionally configure, then import torch, allocate and write a 24 MiB tensor, free it, allocate
# and free it again (the second one is where glibc's dynamic threshold has moved to the heap), and report how much
# RSS the process still holds above its level before the tensors.
CHILD = r"""
import json, os, sys
from stalerl.core.launch_env import configure_allocator
phrase = configure_allocator() if sys.argv[1] == "configure" else ""
import torch

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

torch.ones(8).sum()
before = rss()
for _ in range(3):
    x = torch.empty(6 * 2**20).fill_(1.0)  # 24 MiB, every page written
    del x
print(json.dumps({"held": rss() - before, "phrase": phrase, "inherited": os.environ.get("MALLOC_MMAP_THRESHOLD_")}))
"""


def _child(mode: str, env_value=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (MALLOC_MMAP_THRESHOLD_ENV, GLIBC_MMAP_THRESHOLD_ENV)}
    if env_value is not None:
        env[MALLOC_MMAP_THRESHOLD_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=True,
                         timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_freed_tensor_buffers_go_back_to_the_kernel_only_with_the_fixed_threshold():
    default = _child("plain")
    fixed = _child("configure", str(DEFAULT_MMAP_THRESHOLD))  # an opt-in: it slows forward/backward
    # glibc's dynamic rule keeps the second 24 MiB buffer in the heap, where it stays after the free
    assert default["held"] >= 16 * 2**20, default
    assert fixed["held"] < 4 * 2**20, fixed
    assert f"{DEFAULT_MMAP_THRESHOLD // 1024} KiB" in fixed["phrase"]
    assert fixed["inherited"] == str(DEFAULT_MMAP_THRESHOLD)  # worker processes start under the same rule
    assert default["inherited"] is None


@glibc
def test_keep_or_unset_leaves_glibc_default_and_says_so():
    for value in ("keep", None):
        kept = _child("configure", value)
        assert kept["held"] >= 16 * 2**20, kept
        assert "keep" in kept["phrase"] and "default" in kept["phrase"]
        assert kept["inherited"] is None


def test_the_threshold_setting_is_checked_before_anything_changes():
    assert parse_mmap_threshold(None) is None  # unset: glibc's default
    assert parse_mmap_threshold("") is None
    assert parse_mmap_threshold(str(DEFAULT_MMAP_THRESHOLD)) == DEFAULT_MMAP_THRESHOLD
    assert parse_mmap_threshold(" keep ") is None
    assert parse_mmap_threshold("65536") == 65536
    for bad in ("0", "-5", "1MiB", str(64 * 2**20)):
        with pytest.raises(ValueError, match=MALLOC_MMAP_THRESHOLD_ENV):
            parse_mmap_threshold(bad)


def test_a_second_call_returns_the_first_phrase(monkeypatch):
    monkeypatch.setattr(launch_env, "_applied", "malloc: earlier")
    monkeypatch.setenv(MALLOC_MMAP_THRESHOLD_ENV, "not a number")  # not read again
    assert launch_env.configure_allocator() == "malloc: earlier"
