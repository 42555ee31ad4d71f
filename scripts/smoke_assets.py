"""Builds what scripts/gpu_smoke.sh and scripts/gpu_check.sh run on, with nothing downloaded:

* a from-scratch Qwen2 (the Qwen2.5 layout: GQA, biases on q/k/v, tied embeddings) with the real vocabulary size
  151,936, saved as a Hugging Face directory with a byte-level BPE tokenizer built here: the 256 byte symbols, filler
  tokens up to Qwen2.5's 151,643 regular tokens, Qwen's special tokens and its chat template (so the prompt format is
  the "chat" one, as with Qwen2.5-Instruct), and a generation_config.json listing Qwen2.5-Instruct's two end tokens
  (<|im_end|>, <|endoftext|>); sizes: qwen2.5-1.5b (Qwen2.5-1.5B's exact shape, 1.54B parameters, random weights),
  gpu (85M), cpu (10M, nearly all embedding);
* a GSM8K-format data directory (train.jsonl / test.jsonl: question, answer ending in "#### N").

    python scripts/smoke_assets.py OUT_DIR --size qwen2.5-1.5b|gpu|cpu [--device cuda] [--save-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

VOCAB_SIZE = 151_936  # Qwen2 / Qwen2.5 embedding rows
REGULAR_TOKENS = 151_643  # Qwen2.5's byte-level BPE tokens before the special ones
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPES = {  # Qwen2.5-0.5B is hidden 896, 24 layers, 14 heads / 2 kv heads, intermediate 4864
    # Qwen2.5-1.5B(-Instruct)'s config.json, vocabulary included (tied embeddings, no sliding window)
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, max_position_embeddings=32768, rope_theta=1_000_000.0,
                         rms_norm_eps=1e-6, use_sliding_window=False),
    "gpu": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=1408, max_position_embeddings=2048),
    "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=512),
}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(vocab) < REGULAR_TOKENS:  # never produced by encode (no merges); decode to letter strings
        n, word = i, ""
        while True:
            word = letters[n % 26] + word
            n //= 26
            if n == 0:
                break
        vocab.setdefault("Ġ" + word, len(vocab))
        i += 1
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIAL[1:2], padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_model(tok, size: str, device: str = "cpu"):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB_SIZE, tie_word_embeddings=True, attn_implementation="sdpa",
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                         **SHAPES[size])
    torch.manual_seed(0)
    with torch.device(device):  # random init of 1.5B parameters takes seconds on a GPU, a minute on a few cores
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    # As Qwen2.5-Instruct's generation_config.json: both end tokens (both rollout engines stop at either).
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"),
                                            tok.convert_tokens_to_ids("<|endoftext|>")]
    return model


def write_data(out: Path, n_train: int, n_test: int) -> None:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        with open(out / f"{split}.jsonl", "w") as fh:
            for _ in range(n):
                a, b, c = rng.randint(2, 60), rng.randint(2, 60), rng.randint(2, 9)
                q = (f"Tom has {a} apples. He buys {b} more and then gives each of his {c} friends one apple. "
                     "How many apples does Tom have now?")
                ans = f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b}. Then {a + b}-{c}=<<{a + b}-{c}={a + b - c}>>" \
                      f"{a + b - c}.\n#### {a + b - c}"
                fh.write(json.dumps({"question": q, "answer": ans}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--size", choices=sorted(SHAPES), default="gpu")
    ap.add_argument("--device", default="cpu", help="where to initialise the weights (cuda: much faster at 1.5B)")
    ap.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the saved weights (the trainer loads float32 master weights either way; bfloat16 "
                         "halves the files and the load time)")
    args = ap.parse_args()
    import torch

    tok = build_tokenizer()
    model = build_model(tok, args.size, args.device)
    model_dir = args.out / "model"
    model = model.to("cpu", torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    write_data(args.out / "data", n_train=1024, n_test=128)
    n = sum(p.numel() for p in model.parameters())
    print(f"smoke assets: {model_dir} (Qwen2, vocab {VOCAB_SIZE}, {n / 1e6:.1f}M parameters, tokenizer "
          f"{len(tok)} tokens), data {args.out / 'data'}")


if __name__ == "__main__":
    main()
