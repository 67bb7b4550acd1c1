"""Server-side strategies: one module per method (math as pure functions + a thin Strategy)."""
