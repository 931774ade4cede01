"""Mooncake transfer-engine batch WRITEs: the transport and its data plane."""
