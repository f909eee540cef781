"""FlashInfer behind the backend seam (imported only where flashinfer is installed).

backend.py   `FlashInferBackend`: the triton backend with FlashInfer's paged attention
mla.py       FlashInfer's sparse MLA kernel for `glm_moe_dsa`
plan.py      the plan of the forward in progress, for one kind of attention
"""
