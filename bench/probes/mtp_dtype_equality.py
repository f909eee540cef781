"""Whether speculative greedy output equals plain greedy output on the tiny GLM checkpoints, in
float32 and bfloat16, and whether plain decode agrees with itself across batch composition and
prefill chunk size (what a batched verify changes for a row).

python3 bench/probes/mtp_dtype_equality.py [--device cpu] [--tokens 24] [--linear as-is]
    [--mla as-is]

Runs from the repository root (it uses tests/glm_checkpoints.py to write the checkpoints).
Prints one JSON object: per model and dtype, `plain_batch_vs_alone` and `plain_chunk16_vs_whole`
(plain decode against itself), and per k `spec_vs_plain` (both one request at a time, whole
prefill) and `spec_vs_plain_chunk16_batch` (five requests at once, prefill chunks of 16, as
tests/test_speculative.py's float32 test runs them).

`--linear` replaces the torch backend's 16-bit linear for the run, to find which operation makes
a row depend on the rows beside it: "float32" computes it in float32 and rounds the result,
"rows" runs each row alone (a batch of one, whatever the batch). `--mla decode-rows` computes
the MLA attention of an extend batch of at most 4 rows a request (a verify's) one row at a time
the way decode computes it (`mla_decode_absorbed`, float32) instead of expanding the latents.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from snapfn.handler.llm.build import EngineOptions, build_engine  # noqa: E402
from snapfn.handler.llm.engine.engine import SchedulerConfig  # noqa: E402
from snapfn.handler.llm.kernels import torch_ref  # noqa: E402

from glm_checkpoints import TINY_GLM, save_tiny_glm, write_with_mtp  # noqa: E402
from parity import greedy, random_prompts  # noqa: E402

MODELS = {
    "1-layer": {},
    "3-layer": {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--linear", choices=("as-is", "float32", "rows"), default="as-is")
    ap.add_argument("--mla", choices=("as-is", "decode-rows"), default="as-is")
    args = ap.parse_args()
    replace_linear(args.linear)
    if args.mla == "decode-rows":
        mla_as_decode_rows()
    root = Path(tempfile.mkdtemp(prefix="mtp-dtype-"))
    prompts = random_prompts(TINY_GLM["vocab_size"], [3, 21, 9, 30, 14], seed=1)
    out: dict = {}
    for seed, (name, extra) in enumerate(MODELS.items()):
        plain = save_tiny_glm(root / f"plain-{name}", seed=2 * seed, **extra)
        write_with_mtp(plain, root / f"mtp-{name}")
        for dtype in ("float32", "bfloat16"):
            model = root / f"mtp-{name}"

            def run(k: int, chunk: int, alone: bool, model=model, dtype=dtype) -> list:
                opts = EngineOptions(
                    dtype=dtype,
                    device=args.device,
                    num_pages=256,
                    scheduler=SchedulerConfig(
                        page_size=4, max_num_batched_tokens=chunk, speculative_tokens=k
                    ),
                )
                eng = build_engine(model, opts).engine
                if alone:
                    return [eng.generate([p], greedy(args.tokens))[0].token_ids for p in prompts]
                return [r.token_ids for r in eng.generate(prompts, greedy(args.tokens))]

            alone, batch, chunked = run(0, 2048, True), run(0, 2048, False), run(0, 16, False)
            figures = {
                "plain_batch_vs_alone": batch == alone,
                "plain_chunk16_vs_whole": chunked == batch,
            }
            for k in (1, 2, 3):
                figures[f"k{k}"] = {
                    "spec_vs_plain": run(k, 2048, True) == alone,
                    "spec_vs_plain_chunk16_batch": run(k, 16, False) == chunked,
                }
            out[f"{name} {dtype}"] = figures
    print(json.dumps(out, indent=1))


def replace_linear(how: str) -> None:
    import torch
    import torch.nn.functional as F

    as_is = torch_ref.TorchBackend.linear

    def in_float32(self, x, weight, bias=None, weight_scale_inv=None):
        out = as_is(self, x[:0], weight, bias, weight_scale_inv).dtype  # the dtype it returns
        w = self._dense_weight(weight, weight_scale_inv, torch.float32)
        b = None if bias is None else bias.float()
        return F.linear(x.float(), w, b).to(out)

    def by_rows(self, x, weight, bias=None, weight_scale_inv=None):
        flat = x.reshape(-1, x.shape[-1])
        rows = [
            as_is(self, flat[i : i + 1], weight, bias, weight_scale_inv) for i in range(len(flat))
        ]
        return (
            torch.cat(rows).reshape(*x.shape[:-1], -1)
            if rows
            else as_is(self, x, weight, bias, weight_scale_inv)
        )

    if how != "as-is":
        torch_ref.TorchBackend.linear = {"float32": in_float32, "rows": by_rows}[how]


def mla_as_decode_rows() -> None:
    import torch

    as_is = torch_ref.TorchBackend.mla_attention

    def decode_rows(self, q, latent_cache, kv_b, kv_b_scale_inv, batch, scale, topk=None):
        if batch.is_decode or max(batch.q_lens_cpu) > 4:
            return as_is(self, q, latent_cache, kv_b, kv_b_scale_inv, batch, scale, topk)
        w = self._dense_weight(kv_b, kv_b_scale_inv, q.dtype)
        outs, start = [], 0
        for b, (q_len, seq_len) in enumerate(
            zip(batch.q_lens_cpu, batch.seq_lens_cpu, strict=True)
        ):
            latent = latent_cache[batch.page_table[b : b + 1].long()].flatten(1, 2)
            for i in range(q_len):
                row = slice(start + i, start + i + 1)
                lens = torch.tensor([seq_len - q_len + i + 1], dtype=torch.int32)
                picked = None if topk is None else topk[row]
                outs.append(torch_ref.mla_decode_absorbed(q[row], latent, w, lens, scale, picked))
            start += q_len
        return torch.cat(outs)

    torch_ref.TorchBackend.mla_attention = decode_rows


if __name__ == "__main__":
    main()
