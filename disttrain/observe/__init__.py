"""Rank-aware logging, metrics (jsonl + TensorBoard) and the rank-0 progress bar."""
