"""Attention backends behind one boundary: the contract in backend.py, the names in registry.py."""
