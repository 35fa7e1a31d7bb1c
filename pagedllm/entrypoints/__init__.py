"""pagedllm.entrypoints."""
