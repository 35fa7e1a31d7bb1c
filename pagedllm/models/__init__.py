"""pagedllm.models."""
