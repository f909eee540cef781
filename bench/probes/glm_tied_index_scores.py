"""How many greedy generations of tiny GLM checkpoints with few DSA indexer heads differ from
transformers on the CPU, where the indexer's top-k often cuts through keys scoring exactly 0.

python3 bench/probes/glm_tied_index_scores.py [--pick as-cpu-topk] [--tokens 24]

Runs from the repository root (it uses tests/glm_checkpoints.py and tests/parity.py to write the
checkpoints through transformers and run both). For each (indexer heads, index_topk) and seed, a
checkpoint; for each of its prompts (3, 9 and 16 tokens, then 5, 17 and 40), the engine's greedy
tokens against transformers' `generate`. `--pick earliest` runs the engine with the rule GPUs use
(`torch_ref.pick_causal_topk`: the earlier key first among equal scores) in place of the CPU's
(`pick_as_cpu_topk`: `torch.topk` over the row transformers scores). Prints one JSON object:
the cases, how many differ, and where each first differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from test_glm_moe_dsa import hf_greedy  # noqa: E402

from snapfn.handler.llm.kernels import torch_ref  # noqa: E402

from glm_checkpoints import TINY_GLM, save_tiny_glm  # noqa: E402
from parity import greedy, hf_model, our_engine, random_prompts  # noqa: E402

CASES = [  # (indexer heads, index_topk, seeds, prompt lengths)
    *((heads, 4, (0, 1, 2), (3, 9, 16)) for heads in (1, 2, 4)),
    *((heads, topk, (3, 4), (5, 17, 40)) for heads, topk in ((1, 2), (2, 3), (4, 8), (1, 8))),
    (3, 5, (3, 4), (5, 17, 40)),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pick", choices=("as-cpu-topk", "earliest"), default="as-cpu-topk")
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    if args.pick == "earliest":
        torch_ref.pick_as_cpu_topk = lambda scores, q_offset, topk, _prompt_len: (
            torch_ref.pick_causal_topk(scores, q_offset, topk)
        )
    differ = []
    total = 0
    for heads, topk, seeds, lengths in CASES:
        for seed in seeds:
            folder = Path(tempfile.mkdtemp(prefix="glm-ties-"))
            save_tiny_glm(folder, seed=seed, index_n_heads=heads, index_topk=topk)
            hf = hf_model(folder)
            prompts = random_prompts(TINY_GLM["vocab_size"], list(lengths), seed=seed)
            engine = our_engine(folder, page_size=4, max_tokens=16)
            results = engine.generate(prompts, greedy(args.tokens))
            for prompt, result in zip(prompts, results, strict=True):
                total += 1
                ours, theirs = list(result.token_ids), hf_greedy(hf, prompt, args.tokens)
                if ours != theirs:
                    first = next(
                        i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b
                    )
                    differ.append(
                        {"heads": heads, "index_topk": topk, "seed": seed,
                         "prompt_tokens": len(prompt), "first_differing_token": first}
                    )  # fmt: skip
    print(json.dumps({"pick": args.pick, "tokens": args.tokens, "generations": total,
                      "differ_from_transformers": len(differ), "where": differ}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
