"""Stand-in for sglang.srt.utils.network: NetworkAddress, the one name kv_events.py imports (the
real module needs psutil). Parses `host:port` and `[v6]:port` as the real one does."""

import ipaddress
from dataclasses import dataclass


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class NetworkAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "NetworkAddress":
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise ValueError(f"bad address {text!r}")
            port = rest[1:]
        else:
            host, sep, port = text.rpartition(":")
            if not sep or ":" in host:
                raise ValueError(f"bad address {text!r}")
        if not port.isdigit():
            raise ValueError(f"bad port in {text!r}")
        return cls(host, int(port))

    @property
    def is_ipv6(self) -> bool:
        return _is_ipv6(self.host)

    def to_tcp(self) -> str:
        host = f"[{self.host}]" if self.is_ipv6 else self.host
        return f"tcp://{host}:{self.port}"
