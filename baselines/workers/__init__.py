"""Worker scripts: each runs as `python FILE` in a process of its own (its engine, no specter imports)."""
