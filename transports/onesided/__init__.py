"""The one-sided transports: a TCP control channel pairs endpoints and admits each push, and a
`DataPlane` moves the bytes by one-sided WRITEs (`nixl/`, `mooncake/`: each a transport and its plane)."""
