"""A tiny Qwen2 with a byte-level tokenizer, a tiny prompt set and plugin files for ``swift rlhf`` tests on CPU.

Nothing is downloaded: the tokenizer is Qwen2's format (byte-level BPE) with the 256 byte symbols and no merges, so
every byte is one token and transformers' Qwen2 tokenizer class loads it as it is; the model is built from a config.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_model_dir(path: Path, *, seed: int = 0, hidden_size: int = 64, layers: int = 2) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    byte_symbols = sorted(ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(byte_symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    # Qwen2's chat template (ms-swift encodes with its own template; this one is for completeness)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(path)
    config = Qwen2Config(vocab_size=320, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None, attention_dropout=0.0)
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_dataset(path: Path, n: int = 64, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            row = {"messages": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
            f.write(json.dumps(row) + "\n")
    return path


REWARD_PLUGIN = '''
from swift.rewards import ORM, orms


class TinyParityReward(ORM):
    """Fraction of characters with an odd code point: varies between the sampled completions of a random model."""

    def __call__(self, completions, **kwargs):
        return [sum(ord(ch) % 2 for ch in c) / max(len(c), 1) for c in completions]


orms["tiny_parity"] = TinyParityReward
'''

CAPTURE_PLUGIN = '''
"""Test-only plugin: records what the recipe loss receives and returns, and the weights after training."""
import os

import torch

from recipe.swift.trainer import GRPOTrainer

_records = []
_policy_loss = GRPOTrainer._recipe_policy_loss
_train = GRPOTrainer.train


def _capture(self, **kwargs):
    loss, metrics = _policy_loss(self, **kwargs)
    record = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    record.update(loss=loss.detach().cpu().clone(), metrics=dict(metrics), global_step=int(self.state.global_step),
                  micro_step=int(self._step), accumulation=int(self._recipe_accumulation_steps()))
    _records.append(record)
    return loss, metrics


def _capture_path():
    path = os.environ["SWIFT_TEST_CAPTURE"]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun (NPROC_PER_NODE): one file per rank
        path = f"{path}.rank{os.environ['RANK']}"
    return path


def _train_and_dump(self, *args, **kwargs):
    out = _train(self, *args, **kwargs)
    state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
    torch.save({"records": list(_records), "state_dict": state, "log_history": list(self.state.log_history),
                "num_processes": int(self.accelerator.num_processes)}, _capture_path())
    _records.clear()  # several runs may share one process (tests/integrations/swift/_swift_runs.py)
    return out


GRPOTrainer._recipe_policy_loss = _capture
GRPOTrainer.train = _train_and_dump
'''


ROLLOUT_PLUGIN = '''
"""Test-only plugin: gives micro-batches vLLM-like rollout log-probs (ms-swift's old log-probs minus 0.05 on the
valid tokens), on every micro-batch (SWIFT_TEST_ROLLOUT=all), only on the generation batch's first one (=first),
as ms-swift's collation leaves them None for a completion whose log-prob count does not match, or on every
micro-batch of rank 0 only (=rank0; torchrun's RANK). SWIFT_TEST_TRUNCATE=alternate marks the generation batch's
even rows (in the batch's order, whatever the split) as truncated, so --overlong_filter has rows to leave out and
rows to keep (the tiny random model truncates nearly every completion at --max_completion_length)."""
import os

import torch

from recipe.swift.trainer import GRPOTrainer

_generate = GRPOTrainer._generate_and_score_completions


def _with_rollout(self, inputs):
    micro_batches = _generate(self, inputs)
    which = os.environ.get("SWIFT_TEST_ROLLOUT", "")
    for i, entry in enumerate(micro_batches):
        batch = entry["grpo_batch"]
        if which == "all" or (which == "first" and i == 0) or (which == "rank0" and os.environ.get("RANK") == "0"):
            batch.rollout_per_token_logps = (batch.old_per_token_logps - 0.05 * batch.completion_mask).detach()
    if os.environ.get("SWIFT_TEST_TRUNCATE") == "alternate":
        start = 0
        for entry in micro_batches:
            batch = entry["grpo_batch"]
            rows = batch.truncated_mask.shape[0]
            index = torch.arange(start, start + rows, device=batch.truncated_mask.device)
            batch.truncated_mask = index % 2 == 0
            start += rows
    return micro_batches


GRPOTrainer._generate_and_score_completions = _with_rollout
'''


def write_plugins(folder: Path) -> tuple[Path, Path, Path]:
    """(reward, capture, rollout plugins), each alone in its folder (ms-swift puts a plugin's folder on sys.path)."""
    reward = folder / "reward" / "tiny_reward_plugin.py"
    capture = folder / "capture" / "tiny_capture_plugin.py"
    rollout = folder / "rollout" / "tiny_rollout_plugin.py"
    for file, text in ((reward, REWARD_PLUGIN), (capture, CAPTURE_PLUGIN), (rollout, ROLLOUT_PLUGIN)):
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(text, encoding="utf-8")
    return reward, capture, rollout
