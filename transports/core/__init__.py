"""What every built-in transport shares, below any wire: page digests, the deployment secret, the
registered bytes of a KV pool and their host staging, the receiver's state machine and the
receiver over those bytes, the sender's bookkeeping, and the endpoint base class."""
