"""snapfn's ground floor: the generic snapshot-restore runtime. Knows nothing of LLMs or HTTP."""
