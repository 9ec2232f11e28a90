"""HAProxy in front of a fleet's nodes: its configuration, made from the nodes' Serve proxies.

Clients reach one address; HAProxy sends each connection to the node proxy with the fewest
(streams differ in length), takes a node out when its /readyz fails and back when it
passes, and exposes its own Prometheus metrics. The admin socket is where weights and
drains are set at run time (a canary's steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHECK_INTERVAL_S = 2  # a node down is out of rotation after 2 failed checks: 4 s


@dataclass(frozen=True)
class NodeProxy:
    name: str  # a server name HAProxy accepts ([A-Za-z0-9_.:-])
    address: str  # host:port


def haproxy_config(nodes: list[NodeProxy], listen_port: int, admin_socket: Path, listen_host: str = "0.0.0.0") -> str:
    """The configuration text: a frontend on `listen_host:listen_port` (HAProxy's own
    Prometheus metrics at /haproxy/metrics), one backend of `nodes` checked on /readyz."""
    if not nodes:
        raise ValueError("a fleet's HAProxy needs at least one node proxy")
    servers = "\n".join(f"    server {node.name} {node.address} check" for node in nodes)
    return f"""# Made by `kiln fleet deploy` from the Ray cluster's nodes; made again at each deploy.
global
    stats socket {admin_socket} mode 600 level admin
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    timeout client 10m   # a stream lasts as long as its generation
    timeout server 10m
    timeout http-request 30s

frontend kiln
    bind {listen_host}:{listen_port}
    http-request use-service prometheus-exporter if {{ path /haproxy/metrics }}
    default_backend kiln_nodes

backend kiln_nodes
    balance leastconn
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter {CHECK_INTERVAL_S}s fall 2 rise 2
{servers}
"""
