"""KV transfer plugins: the interface (`base`), the registry, and the built-in transports, in
layers: each imports only from those above it in this list (the registry imports the built-ins
lazily, by name).

    base                the Transport ABC and its records (fixed interface)
    registry            transport_class(name) / create_transport(name, **kw): built-ins + entry points
    core/               what every built-in transport shares, below any wire
        digest          page digests ("xxh3_64", "none")
        secret          DeploymentSecret: the peer-authentication proofs and push capabilities
        pool_bytes      PoolBytes: the registered bytes of a KV pool, page by page; whether it is staged
        staging         host staging of pools on other devices (CUDA): sender chunks, copies
        receiver_state  the receiver's pure state machine (expect / admit / finish / abort / cancel)
        receiver        Receiver: that state machine + the pool bytes + completion waiters
        sender_state    OutgoingPush(es): in-flight pushes and their cancellation flags
        endpoint        Endpoint: the built-ins' base (expect, completion, cancel, checks)
    wire/               what the socket transports (tcp, one-sided) share
        framing         length-prefixed msgpack frames, ProtocolError
        messages        every wire message, each defined once
        channel         Channel: a non-blocking socket (frames, raw bytes, pages); connect/listen/accept
        handshake       the peer handshake (mutual authentication) on a connection
        keepalive       ping while idle, drop a silent peer
        listening       ListeningEndpoint: listener, accept loop, connection guards, dialing, Hello
    inprocess           the in-process transport (endpoints meet through an InProcessHub)
    tcp/                TcpTransport: pages stream inline on the connection
        transport, wire (its protocol), send, receive
    onesided/           OneSidedTransport: a TCP control channel (pairing, admission, verdicts) over a DataPlane
        transport, wire (its protocol), send, receive, link
        data_plane      DataPlane: the byte mover under it (register, connect, WRITE, poll)
        nixl/           transport + plane: NIXL (UCX) WRITEs with notifications   (pip install 'kvfence[nixl]')
        mooncake/       transport + plane: Mooncake transfer engine batch writes  (pip install 'kvfence[mooncake]')
    faults              FaultInjectingTransport: drop, delay, corrupt, truncate, ... around any transport
"""
