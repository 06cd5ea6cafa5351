"""Environment variables through which a WorkerPool tells its workers how to join it."""

from __future__ import annotations

ENV_ADDRESS = "DISTCONV_POOL_ADDRESS"
ENV_AUTHKEY = "DISTCONV_POOL_AUTHKEY"
ENV_BACKEND = "DISTCONV_POOL_BACKEND"
ENV_TIMEOUT = "DISTCONV_POOL_TIMEOUT"
ENV_ARGV = "DISTCONV_POOL_ARGV"  # the driver's sys.argv (JSON), for launch()ed scripts
