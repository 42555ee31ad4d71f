"""Prints the figure in docs/integrations/trinity.md: FIPO on the Trinity test mini-batches: the reference (dropped rows leave the denominator) vs verl's
batch_num_tokens (dropped rows kept in the denominator, what the adapter passed before).

Run in the Trinity venv from the repo root: PYTHONPATH=$PWD python tests/integrations/trinity/fipo_denominator_figure.py
"""
import sys
sys.path.insert(0, "tests/integrations/trinity")
import _trinity_cases as C
for seed in (0, 1):
    rows = C.mini_batch(seed)
    n_valid = int(rows["response_mask"].sum())
    ref, metrics = C.registry_loss("fipo", rows, rows["table"])
    kept_in, _ = C.registry_loss("fipo", rows, rows["table"], num_tokens=n_valid)
    print(f"seed {seed}: valid tokens {n_valid}, drop ratio {metrics['fipo/sequence_drop_ratio']:.3f}, "
          f"reference {float(ref):.4f}, batch_num_tokens denominator {float(kept_in):.4f}, "
          f"ratio {float(kept_in) / float(ref):.4f}")
