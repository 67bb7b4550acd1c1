"""Shared ML code for server and clients: data, partitioning, models, training loops."""
