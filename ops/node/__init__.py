"""The node runtime, run on every SuperLink and client machine: pflower-supernode, its
ClientApp runner, and the SuperLink entry point with pflower's Flower settings."""
