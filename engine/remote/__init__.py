"""What a worker in another process speaks with its scheduler (protocol.py)."""
