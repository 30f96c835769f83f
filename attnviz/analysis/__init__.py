"""Pure functions on captures and ``[query, key]`` matrices (numpy only, no torch)."""
