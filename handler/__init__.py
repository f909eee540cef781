"""snapfn's top floor: the function API, front doors (CLI, HTTP, queue) and the built-in LLM."""
