"""Parallel serving: the executor, its per-rank workers, data-parallel KV bookkeeping."""
