"""Server side: the ServerApp, the federation loop, checkpoints, results and the CLI."""
