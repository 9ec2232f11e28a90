"""HAProxy in front of a fleet's nodes: its configuration, made from the nodes' Serve proxies,
and the canary's share of requests set on the running HAProxy.

Clients reach one address; HAProxy sends each request to the node proxy with the fewest
connections (streams differ in length), takes a node out when its /readyz fails and back
when it passes, and exposes its own Prometheus metrics. A request goes to the canary
application (the same proxies, under /canary) with the probability its weight map holds,
which the admin socket changes at run time: a canary's steps and its rollback.
"""

from __future__ import annotations

import csv
import io
import socket
from dataclasses import dataclass
from pathlib import Path

from components.errors import KilnError

CHECK_INTERVAL_S = 2  # a node down is out of rotation after 2 failed checks: 4 s
CANARY_KEY = "canary"  # the weight map's one key: the canary's percentage of requests
CANARY_BACKEND = "kiln_canary"


@dataclass(frozen=True)
class NodeProxy:
    name: str  # a server name HAProxy accepts ([A-Za-z0-9_.:-])
    address: str  # host:port


@dataclass(frozen=True)
class HAProxyFiles:
    """Where a fleet's HAProxy keeps what kiln talks to it through."""

    folder: Path

    @property
    def config(self) -> Path:
        return self.folder / "haproxy.cfg"

    @property
    def admin_socket(self) -> Path:
        return self.folder / "haproxy.sock"

    @property
    def weights(self) -> Path:
        return self.folder / "canary.map"


def write_haproxy_config(nodes: list[NodeProxy], listen_port: int, files: HAProxyFiles, listen_host: str = "0.0.0.0") -> Path:
    """The configuration and a weight map giving the canary nothing, written to `files`."""
    files.folder.mkdir(parents=True, exist_ok=True)
    files.weights.write_text(f"{CANARY_KEY} 0\n")
    files.config.write_text(haproxy_config(nodes, listen_port, files, listen_host))
    return files.config


def haproxy_config(nodes: list[NodeProxy], listen_port: int, files: HAProxyFiles, listen_host: str = "0.0.0.0") -> str:
    """The configuration text: a frontend on `listen_host:listen_port` (HAProxy's own
    Prometheus metrics at /haproxy/metrics); two backends of `nodes`, stable and canary,
    each checked on its application's /readyz."""
    if not nodes:
        raise ValueError("a fleet's HAProxy needs at least one node proxy")
    servers = "\n".join(f"    server {node.name} {node.address} check" for node in nodes)
    return f"""# Made by `kiln fleet deploy` from the Ray cluster's nodes; made again at each deploy.
global
    stats socket {files.admin_socket} mode 600 level admin
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 10m   # a stream lasts as long as its generation
    timeout server 10m
    timeout http-request 30s
    default-server inter {CHECK_INTERVAL_S}s fall 2 rise 2

frontend kiln
    bind {listen_host}:{listen_port}
    http-request use-service prometheus-exporter if {{ path /haproxy/metrics }}
    # The canary's share: a draw in 0..99 below the weight the map holds (the admin socket sets it).
    http-request set-var(txn.canary_weight) str({CANARY_KEY}),map_str_int({files.weights},0)
    http-request set-var(txn.draw) rand(100)
    use_backend {CANARY_BACKEND} if {{ var(txn.draw),sub(txn.canary_weight) lt 0 }}
    default_backend kiln_stable

backend kiln_stable
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
{servers}

backend {CANARY_BACKEND}
    balance leastconn
    http-request set-path /canary%[path]
    option httpchk GET /canary/readyz
    http-check expect status 200
{servers}
"""


def set_canary_weight(files: HAProxyFiles, percent: int) -> None:
    """The canary's share of requests on the running HAProxy (its admin socket), and in the
    map file, so that HAProxy restarted keeps it."""
    if not 0 <= percent <= 100:
        raise ValueError(f"a canary's weight is a percentage, not {percent}")
    if answer := _admin(files.admin_socket, f"set map {files.weights} {CANARY_KEY} {percent}").strip():
        raise RuntimeError(f"HAProxy did not set the canary's weight: {answer}")
    files.weights.write_text(f"{CANARY_KEY} {percent}\n")


def canary_weight(files: HAProxyFiles) -> int:
    """The canary's share as the running HAProxy holds it."""
    for line in _admin(files.admin_socket, f"show map {files.weights}").splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] == CANARY_KEY:
            return int(fields[2])
    raise ValueError(f"HAProxy's map {files.weights} has no {CANARY_KEY} entry")


def servers_up(files: HAProxyFiles, backend: str) -> int:
    """How many of `backend`'s servers the running HAProxy has up (their checks passing)."""
    table = csv.DictReader(io.StringIO(_admin(files.admin_socket, "show stat").lstrip("# ")))
    return sum(1 for row in table if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND") and row["status"].startswith("UP"))


class HAProxyUnreachable(KilnError):
    """The running HAProxy's admin socket does not answer."""


def _admin(path: Path, command: str) -> str:
    """One command on HAProxy's admin socket; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5)
        try:
            connection.connect(str(path))
        except OSError as err:
            raise HAProxyUnreachable(f"HAProxy's admin socket {path} does not answer ({err.strerror or err}): is HAProxy running with the configuration `kiln fleet deploy` wrote beside it?") from None
        connection.sendall(command.encode() + b"\n")
        chunks = []
        while chunk := connection.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode()
