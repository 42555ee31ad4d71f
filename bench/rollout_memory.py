"""Peak memory of generation with behaviour log-probs, for a real vocabulary size, on CPU.

A from-scratch Qwen2 (vocab 151,936, hidden 64, 2 layers; random init, nothing downloaded) samples 64 rows x 64
new tokens (16 prompts x 4 samples, no eos stop in practice: an untrained model almost never samples it). Two
methods, each in its own child process (peak RSS is a process-wide high-water mark), on the same prompts and seed:

* old: the previous engine's method, reimplemented inline here as the baseline: ``generate(output_scores=True)``,
  then ``torch.stack`` of every step's scores and a ``log_softmax`` over (rows x steps x vocab), then the gather;
* new: ``stalerl.rollout.engine.HFRolloutEngine.generate`` (the sampled token's log-prob recorded per step).

Printed per method: the peak RSS during generation (the high-water mark is reset once the model is built, so model
construction does not count; its own peak is printed too), the RSS before generating, their difference, the
generate time; and the size of one step's logits (rows x vocab x 4 B) with the ratio of the generation's extra peak
to it. The two methods' behaviour log-probs are compared (same seed, same sampled tokens).

    python bench/rollout_memory.py                   # 64 rows x 64 new tokens
    python bench/rollout_memory.py --rows 16 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VOCAB = 151_936


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_rss_bytes() -> int:
    """The process's RSS high-water mark (VmHWM; since the last reset, see _reset_peak)."""
    try:
        return _status_kib("VmHWM") * 1024
    except (OSError, KeyError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs), so the peak measured next
    is the generation's, not the model construction's; returns the current RSS in bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmRSS") * 1024
    except (OSError, KeyError):
        return _peak_rss_bytes()


def _build(threads: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stalerl.core.model import build_char_tokenizer

    torch.set_num_threads(threads)
    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                         tie_word_embeddings=True, attn_implementation="sdpa", pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float().eval()
    return model, tok


def _questions(rows: int, samples: int) -> tuple[list[str], list[str]]:
    n = max(1, rows // samples)
    return [f"{i}+{2 * i + 1}=?" for i in range(n)], [str(3 * i + 1) for i in range(n)]


def child(method: str, rows: int, new_tokens: int, samples: int, threads: int, out_path: str) -> None:
    import torch

    from stalerl.core.model import PromptFormatter
    from stalerl.core.reward import gsm8k_reward
    from stalerl.rollout.engine import HFRolloutEngine

    model, tok = _build(threads)
    questions, answers = _questions(rows, samples)
    engine = HFRolloutEngine(model, tok, PromptFormatter(tok).format, gsm8k_reward)
    construction_peak = _peak_rss_bytes()
    before = _reset_peak()
    torch.manual_seed(123)
    start = time.perf_counter()
    if method == "new":
        batch = engine.generate(questions, answers, n_samples=samples, max_new_tokens=new_tokens)
        response_ids, mask, logp = batch.response_ids, batch.response_mask, batch.behavior_logp
    else:
        from transformers import GenerationConfig

        prompt_ids, prompt_mask = engine.tokenize_prompts(questions)
        prompt_ids = prompt_ids.repeat_interleave(samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(samples, dim=0)
        gen = GenerationConfig(max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                               return_dict_in_generate=True, repetition_penalty=1.0, num_beams=1, do_sample=True,
                               temperature=1.0, top_p=1.0, top_k=0, output_scores=True)
        with torch.no_grad():
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=gen)
            response_ids = out.sequences[:, prompt_ids.shape[1]:]
            from stalerl.rollout.engine import _mask_through_first_eos

            mask = _mask_through_first_eos(response_ids, tok.eos_token_id)
            scores = torch.stack(out.scores, dim=1).float()
            full = torch.log_softmax(scores, dim=-1)
            logp = full.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
            logp = torch.where(mask, logp, torch.zeros_like(logp))
            del out, scores, full
    seconds = time.perf_counter() - start
    result = {"method": method, "peak_rss": _peak_rss_bytes(), "rss_before": before, "seconds": seconds,
              "construction_peak": construction_peak,
              "rows": int(response_ids.shape[0]), "steps": int(response_ids.shape[1]), "valid": int(mask.sum()),
              "response_ids": response_ids.tolist(), "logp": logp.tolist()}
    with open(out_path, "w") as f:
        json.dump(result, f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default="old,new", help="comma-separated subset of old,new")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.rows, args.new_tokens, args.samples, args.threads, args.out)
        return

    import tempfile

    gib = 1024 ** 3
    step_logits = args.rows * VOCAB * 4
    print(f"Qwen2 from scratch: vocab {VOCAB:,d}, hidden 64, 2 layers; {args.rows} rows x {args.new_tokens} new "
          f"tokens, {args.threads} thread(s), CPU")
    print(f"one step's logits (rows x vocab x 4 B): {step_logits / 2**20:.1f} MiB; all steps' scores "
          f"(rows x steps x vocab x 4 B): {step_logits * args.new_tokens / gib:.2f} GiB")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            out = os.path.join(tmp, f"{method}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", method, "--out", out,
                   "--rows", str(args.rows), "--new-tokens", str(args.new_tokens), "--samples", str(args.samples),
                   "--threads", str(args.threads)]
            subprocess.run(cmd, check=True)
            with open(out) as f:
                r = json.load(f)
            results[method] = r
            extra = r["peak_rss"] - r["rss_before"]
            print(f"  {method:>3}: peak RSS during generate {r['peak_rss'] / gib:6.2f} GiB (RSS before "
                  f"{r['rss_before'] / gib:.2f} GiB, model construction peak {r['construction_peak'] / gib:.2f} GiB; "
                  f"generation adds {extra / 2**20:8.1f} MiB = {extra / step_logits:6.1f}x one step's logits), "
                  f"generate {r['seconds']:6.1f} s, {r['rows']} x {r['steps']} tokens ({r['valid']} valid)")
    if "old" in results and "new" in results:
        old, new = results["old"], results["new"]
        old_extra = old["peak_rss"] - old["rss_before"]
        new_extra = new["peak_rss"] - new["rss_before"]
        print(f"  old/new: peak RSS {old['peak_rss'] / new['peak_rss']:.1f}x, generation's extra peak "
              f"{old_extra / max(new_extra, 1):.1f}x, time {old['seconds'] / new['seconds']:.2f}x")
        if old["response_ids"] == new["response_ids"]:
            import math

            diff = max((abs(a - b) for ra, rb in zip(old["logp"], new["logp"]) for a, b in zip(ra, rb)
                        if math.isfinite(a) and math.isfinite(b)), default=0.0)
            print(f"  same sampled tokens; max |behaviour log-prob difference| old vs new: {diff:.2e}")
        else:
            print("  WARNING: the two methods sampled different tokens; log-probs not compared")


if __name__ == "__main__":
    main()
