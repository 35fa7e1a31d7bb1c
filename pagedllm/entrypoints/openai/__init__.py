"""pagedllm.entrypoints.openai."""
