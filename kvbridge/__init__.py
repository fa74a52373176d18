"""kvbridge: KV-cache transfer metadata side channel and NIXL data plane."""

__version__ = "0.1.0"
