"""The built-in LLM function: HF checkpoint loading, models, paged KV engine, sampling."""
