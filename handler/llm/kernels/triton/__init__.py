"""Our own Triton kernels and the backend that runs them (over the torch reference).

backend.py    `TritonBackend`: the torch reference with these kernels where they cover an op
kernels.py    RMSNorm, FP8 dequant and GEMM, cache stores: each matching a reference op
gemv.py       decode-sized projections with the norm before and SwiGLU after fused in
attention.py  paged decode attention (split-KV)
mla.py        MLA decode attention over the latent cache (sparse or dense)
absorb.py     MLA's absorbed products, reading `kv_b` as stored
indexer.py    the DSA indexer's scoring, decode and prefill
moe.py        routed experts without a host sync (bf16 / fp32 / FP8)
sampling.py   greedy picks: each row's argmax and its logprob
"""
