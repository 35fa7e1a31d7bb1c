"""Scheduling and KV-cache bookkeeping: pure Python, never imports torch (DESIGN rule 2)."""
