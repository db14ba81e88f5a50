"""Stand-in for the four helpers of vllm.utils.network_utils that kv_events.py imports (the real
module needs psutil, urllib3 and vllm.envs). Same behaviour, except get_ip: the node IP is
VLLM_HOST_IP, else 127.0.0.1, so `tcp://*:0` binds loopback only."""

import ipaddress
import os
from urllib.parse import urlsplit


def get_ip() -> str:
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def get_tcp_uri(ip: str, port: int) -> str:
    if is_valid_ipv6_address(ip):
        return f"tcp://[{ip}]:{port}"
    return f"tcp://{ip}:{port}"


def split_zmq_path(path: str) -> tuple[str, str, str]:
    parsed = urlsplit(path)
    if not parsed.scheme:
        raise ValueError(f"Invalid zmq path: {path}")
    scheme = parsed.scheme
    host = parsed.hostname or ""
    port = "" if parsed.port is None else str(parsed.port)
    if scheme == "tcp" and not all((host, port)):
        raise ValueError(f"Invalid zmq path: {path}")
    if scheme != "tcp" and port:
        raise ValueError(f"Invalid zmq path: {path}")
    return scheme, host, port
