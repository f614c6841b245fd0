"""Developer tools that `make` targets run (the server, trainer and SDK never import them)."""
