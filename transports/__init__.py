"""KV transfer plugins: the interface (`base`), the registry, and the built-in transports.

    base            the Transport ABC and its records (fixed interface)
    registry        transport_class(name) / create_transport(name, **kw): built-ins + entry points
    digest          page digests ("xxh3_64", "none")
    pool_view       byte views of a registered pool, page by page; whether it is staged
    staging         host staging of pools on other devices (CUDA): sender chunks, copies
    receiver_state  the receiver's pure state machine (expect / admit / finish / abort / cancel)
    receiver        PoolReceiver: that state machine + the pool + completion waiters
    sender_state    OutgoingPush(es): in-flight pushes and their cancellation flags
    endpoint        PoolEndpoint: what tcp and inprocess share (expect, completion, cancel, checks)
    tcp, tcp_wire, tcp_io, tcp_send, tcp_receive   the TCP transport
    inprocess       the in-process transport (endpoints meet through an InProcessHub)
    data_plane      DataPlane: the byte mover under a one-sided transport (register, connect, WRITE, poll)
    onesided, onesided_send, onesided_receive, onesided_link, onesided_wire
                    OneSidedTransport: a TCP control channel (pairing, admission, verdicts) over a DataPlane
    nixl, nixl_plane            NIXL (UCX) WRITEs with notifications      (pip install 'kvfence[nixl]')
    mooncake, mooncake_plane    Mooncake transfer engine batch writes     (pip install 'kvfence[mooncake]')
    faults          FaultInjectingTransport: drop, delay, corrupt, truncate, ... around any transport
"""
