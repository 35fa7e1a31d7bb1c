"""Speculative decoding: proposers draft tokens, the target model verifies them in one forward.

interface.py (what the runner calls), ngram.py (prompt lookup), draft_model.py (a second, smaller
model with its own paged KV cache), rejection_sampler.py (which drafts a step accepts). Drafts are
plain extra tokens to the scheduler (``core/scheduler.py``): it schedules them, rolls back the
rejected ones' ``num_computed_tokens`` and counts acceptance for the metrics.
"""
