"""Is a fast 16-bit path as faithful as the reference's own 16-bit path? Compares two outputs of
bench/probes/model_parity.py, both run with `--ref-dtype float32`: FAST (the fast backend) and
REF (`--backend torch --graphs ''`, the torch reference in the same 16-bit dtype).

python3 bench/probes/parity_envelope.py FAST.json REF.json [--slack 1.25]

Where exact arithmetic is the judge, a 16-bit path strays anyway: an MoE model's routing flips
at near-ties, and random weights give flat logits, so neither path's greedy tokens equal the
float32 ones everywhere. The fast path passes when its mean and largest logprob differences from
float32 are at most `--slack` times the reference's; the tokens past the tie are counted beside
them (a count of a few flips is too noisy to judge by). Both must have read the same positions.
Prints one JSON object; exits 1 when the fast path strays further.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MEASURES = ("mean_logprob_diff", "largest_logprob_diff")


def past_tie(run: dict) -> int:
    """How many positions' tokens were beyond the near-tie: the failures that name a token
    ("token T is N nats below the reference's R", model_parity.compare's wording)."""
    return sum(1 for f in run["failures"] if "nats below" in f)


def envelope(fast: dict, ref: dict, slack: float) -> dict:
    if fast.get("ref_dtype") != "float32" or ref.get("ref_dtype") != "float32":
        raise ValueError(
            "both runs must compare against float32 (model_parity --ref-dtype float32)"
        )
    if fast["positions"] != ref["positions"]:
        raise ValueError(f"positions differ: {fast['positions']} against {ref['positions']}")
    verdict = {"slack": slack, "positions": fast["positions"]}
    ok = True
    for name in MEASURES:
        verdict[name] = {"fast": fast[name], "reference": ref[name]}
        ok &= fast[name] <= slack * ref[name]
    verdict["past_tie"] = {"fast": past_tie(fast), "reference": past_tie(ref)}
    verdict["ok"] = bool(ok)
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("fast", type=Path)
    parser.add_argument("ref", type=Path)
    parser.add_argument("--slack", type=float, default=1.25)
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in (args.fast, args.ref)]
    try:
        verdict = envelope(*runs, args.slack)
    except (KeyError, ValueError) as exc:
        print(f"parity_envelope: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(verdict))
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
