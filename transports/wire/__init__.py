"""What the transports that talk over sockets share: framing, the messages, the channel (a
non-blocking socket), the peer handshake, keep-alive, and the listening endpoint."""
