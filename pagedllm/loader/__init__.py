"""pagedllm.loader."""
