"""pagedllm.sample."""
