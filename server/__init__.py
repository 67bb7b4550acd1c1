"""Server side: the ServerApp, the round loop, checkpoints, the run folder, results, summary,
figures and TensorBoard (the command line is ``ops/``)."""
