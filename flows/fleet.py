"""`kiln fleet`: params.yaml's `serving.fleet` → replicas on a Ray cluster, and the HAProxy
configuration in front of its nodes (serving.fleet, serving.haproxy)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from components.config import FleetParams, Params
from components.errors import KilnError
from components.workspace import Workspace
from flows.serving import engine_source, server_settings


OBJECT_STORE_BYTES = 256 << 20
# Each node's proxy routes to the replica with the shorter queue of two drawn from all, not
# to its own node's first: nodes on one machine share one address, so HAProxy, which spreads
# requests over addresses, sees a single proxy.
LOCAL_CLUSTER_ENV = {"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}


class FleetError(KilnError):
    """The Ray cluster could not be started, reached or deployed to."""


@dataclass(frozen=True)
class Deployed:
    proxies: list[str]  # host:port of each node's Serve proxy
    haproxy_config: Path
    prometheus_config: Path


def fleet_options(config: FleetParams):
    from serving.fleet import FleetOptions

    return FleetOptions(
        replicas=config.replicas, cpus_per_replica=config.cpus_per_replica, max_ongoing_requests=config.max_ongoing_requests,
        max_replicas_per_node=config.max_replicas_per_node, port=config.port,
    )  # fmt: skip


def deploy_fleet(root: Path, params: Params, alias: str | None, engine: Path | None, address: str | None = None) -> Deployed:
    """Deploy `kiln serve`'s app to the cluster (replacing what is there), wait until every
    replica serves, and write HAProxy's configuration for the cluster's nodes."""
    from serving.fleet import deploy, node_proxies
    from serving.haproxy import write_haproxy_config

    config = params.serving.fleet
    source, settings = engine_source(root, params, alias, engine), server_settings(root, params, follows_alias=engine is None)
    try:
        deploy(source, settings, fleet_options(config), address or config.address)
    except (ConnectionError, RuntimeError) as err:  # Ray's own: no cluster there, or replicas that never became healthy
        raise FleetError(f"the fleet could not be deployed on the Ray cluster at {address or config.address}: {err}") from err
    proxies = node_proxies(config.port)
    files = fleet_haproxy(root)
    write_haproxy_config(proxies, config.haproxy_port, files)
    prometheus = files.folder / "prometheus.yml"
    # Scrapes four to a canary's interval at least: its checks read increases over one interval.
    scrape_s = max(1, min(5, int(params.canary.interval_s // 4)))
    prometheus.write_text(prometheus_config([p.address for p in proxies], f"127.0.0.1:{config.haproxy_port}", f"{scrape_s}s"))
    return Deployed([p.address for p in proxies], files.config, prometheus)


def fleet_haproxy(root: Path):
    from serving.haproxy import HAProxyFiles

    return HAProxyFiles(Workspace(root).state / "fleet")


def prometheus_config(proxies: list[str], haproxy: str, scrape_interval: str = "5s") -> str:
    """A Prometheus configuration scraping every replica (found through each node proxy's
    /fleet/targets: replica, app, version, node labels on every series) and HAProxy."""
    discovery = "\n".join(f"      - url: http://{proxy}/fleet/targets\n        refresh_interval: 5s" for proxy in proxies)
    return f"""# Made by `kiln fleet deploy`: prometheus --config.file=THIS
global:
  scrape_interval: {scrape_interval}
  evaluation_interval: {scrape_interval}
scrape_configs:
  - job_name: kiln-replicas
    http_sd_configs:
{discovery}
  - job_name: haproxy
    metrics_path: /haproxy/metrics
    static_configs:
      - targets: ["{haproxy}"]
"""


def start_local_cluster(nodes: int, cpus_per_node: int, port: int = 6379) -> str:
    """A Ray cluster on this machine: a head and `nodes - 1` workers, each a node of its own
    (its own raylet and object store), for a fleet on one machine; the head's address."""
    address = f"127.0.0.1:{port}"
    # Ray's object store would take 30 % of memory per node; replicas pass it nothing large.
    each = (f"--num-cpus={cpus_per_node}", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats")
    _ray("start", "--head", f"--port={port}", "--include-dashboard=false", *each)
    for _ in range(nodes - 1):
        _ray("start", f"--address={address}", *each)
    return address


def stop_fleet(address: str) -> None:
    """The deployment shut down (replicas drained), then every Ray process on this machine."""
    from serving.fleet import shutdown

    try:
        shutdown(address)
    finally:
        _ray("stop")


def _ray(*args: str) -> None:
    ray = Path(sys.executable).with_name("ray")
    done = subprocess.run([str(ray), *args], capture_output=True, text=True, env=os.environ | LOCAL_CLUSTER_ENV)
    if done.returncode != 0:
        raise FleetError(f"`ray {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()[-800:]}")
