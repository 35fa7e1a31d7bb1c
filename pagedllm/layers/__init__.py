"""pagedllm.layers."""
