"""``swapper-pressure``: train under tight per-tier budgets and prove the result equals an
unlimited run."""
