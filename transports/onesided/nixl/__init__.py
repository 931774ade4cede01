"""NIXL (UCX) one-sided WRITEs with notifications: the transport and its data plane."""
