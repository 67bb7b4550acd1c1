"""Client side: the ClientApp, the client state store, and one trainer per method."""
