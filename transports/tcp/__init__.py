"""The TCP transport: page bytes stream over the same connection as its frames."""
