"""The LLM function's init, snapshot and restore recipes, tier 0 and tier 1.

function.py         `LLMFunction`: the init recipe, its portable snapshot, its restore
snapshot_files.py   the model files, config and content hash a snapshot records
section.py          the manifest's "llm" section: its wire format, checked before a restore uses it
sources.py          where a cold init after a refused snapshot reads from (never unverified)
releasable.py       weights and KV pool in releasable regions (tier 1)
process_host.py     what the checkpointed worker runs (tier 1)
process_service.py  an `LLMService` whose engine runs in a restored worker
process_restore.py  tier 1 first, then tier 0, then a cold init
process_diag.py     what a tier-1 worker still holds when it is checkpointed
cli.py              `snapfn init` and `snapfn inspect`
waterfall.py        stage waterfall plots of a startup manifest
"""
