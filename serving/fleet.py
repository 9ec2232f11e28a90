"""kiln serve on a Ray cluster: replicas of the same app (engine process, scheduler, OpenAI
API, /metrics) as a Ray Serve deployment, so that Ray places them on the nodes, checks their
health, restarts them and rolls them; each node's Serve proxy takes the clients (HAProxy in
front of the proxies: serving.haproxy).

Two applications at most: `stable` at `/`, following the alias as `kiln serve` does, and,
while a version is on trial, `canary` at `/canary`, serving that one version (HAProxy sends
it its share of the clients: open-source Serve splits no traffic).

Every replica pulls into its node's cache (shared by the node's replicas under the loader's
lock) and verifies the signature itself. Each also serves its own /metrics on a port of its
node, listed by a directory actor at `/fleet/targets` in the form of Prometheus' HTTP
service discovery, labelled with its application and the version it serves: a scrape of
/metrics through a proxy would reach whichever replica the proxy picked.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

from serving.app import ServerSettings, create_app
from serving.haproxy import NodeProxy
from serving.sources import AliasSource, EngineSource, VersionSource

log = logging.getLogger("kiln.serving")
STABLE, CANARY = "stable", "canary"
ROUTE_PREFIX = {STABLE: "/", CANARY: "/canary"}
DIRECTORY = "kiln-fleet-directory"  # the named actor that lists the replicas' /metrics
REGISTER_EVERY_S = 2.0  # what it serves changes with each swap: Prometheus' labels follow within this
STALE_AFTER_S = 10.0


@dataclass(frozen=True)
class FleetOptions:
    """How the deployment is placed; `kiln fleet deploy` fills it from `serving.fleet`."""

    replicas: int = 2
    cpus_per_replica: float = 1.0  # Ray's reservation (fractions work); the engine's threads are serving.threads
    # Ray Serve's own default (5) would hold back requests kiln's continuous batching takes.
    max_ongoing_requests: int = 256
    max_replicas_per_node: int | None = None  # 1: spread over the nodes
    port: int = 8200  # each node's Serve proxy
    host: str = "0.0.0.0"


@dataclass(frozen=True)
class Replica:
    """One replica as the directory lists it."""

    replica_id: str
    app: str  # STABLE or CANARY
    version: str  # what it serves now ("" while it loads)
    node: str  # the node's IP address
    node_id: str  # Ray's (nodes on one machine share an address)
    metrics: str  # host:port of its own /metrics

    @property
    def labels(self) -> dict[str, str]:
        return {"replica": self.replica_id, "app": self.app, "version": self.version, "node": self.node, "node_id": self.node_id}


def _replica_source(source: EngineSource, node: str) -> EngineSource:
    """The source as a replica pulls it: into its node's cache (one per node, so that
    replicas of several nodes sharing a disk still verify each their own copy)."""
    if isinstance(source, AliasSource | VersionSource):
        return replace(source, cache_root=source.cache_root / f"node-{node}")
    return source


class KilnReplica:
    """A Ray Serve replica: kiln's app, built on the replica (`__serve_build_asgi_app__`, after
    the constructor), its lifespan pulling and warming the engine as `kiln serve`'s does."""

    def __init__(self, source: EngineSource, settings: ServerSettings) -> None:
        import ray
        from ray import serve

        context = serve.get_replica_context()
        self.app_name, self.replica_id = context.app_name, context.replica_id.unique_id
        self.node, self.node_id = ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        self.source, self.settings = _replica_source(source, self.node), settings

    def __serve_build_asgi_app__(self):
        from prometheus_client import start_http_server

        self.kiln_app = create_app(self.source, self.settings)
        self._metrics_server, _ = start_http_server(0, addr=self.node, registry=self.kiln_app.state.metrics.registry)
        threading.Thread(target=self._keep_registering, name="kiln-fleet-register", daemon=True).start()

        @self.kiln_app.get("/fleet/targets", include_in_schema=False)
        async def targets() -> list[dict]:
            """Every live replica's /metrics, as Prometheus' http_sd_configs read them."""
            return [{"targets": [r.metrics], "labels": r.labels} for r in await _directory().replicas.remote()]

        return self.kiln_app

    def check_health(self) -> None:
        """Ray restarts a replica whose engine process is gone for good (a reload in
        progress has the old engine until the new one serves)."""
        current = self.kiln_app.state.follower.current
        if current is None or not current.scheduler.alive:
            raise RuntimeError("no engine process serves in this replica")

    def _keep_registering(self) -> None:
        directory, metrics = _directory(), f"{self.node}:{self._metrics_server.server_port}"
        while True:
            current = self.kiln_app.state.follower.current
            directory.register.remote(Replica(self.replica_id, self.app_name, current.version if current else "", self.node, self.node_id, metrics))
            time.sleep(REGISTER_EVERY_S)

    def __del__(self) -> None:  # Ray Serve's graceful shutdown of a replica
        try:
            _directory().forget.remote(self.replica_id)
        except Exception:  # the cluster is going away with it
            pass


class FleetDirectory:
    """The replicas' /metrics addresses, each dropped when it stops re-registering."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Replica, float]] = {}

    def register(self, replica: Replica) -> None:
        self._seen[replica.replica_id] = (replica, time.monotonic())

    def forget(self, replica_id: str) -> None:
        self._seen.pop(replica_id, None)

    def replicas(self) -> list[Replica]:
        now = time.monotonic()
        self._seen = {k: (r, t) for k, (r, t) in self._seen.items() if now - t < STALE_AFTER_S}
        return sorted((r for r, _ in self._seen.values()), key=lambda r: (r.app, r.node, r.replica_id))


def _directory():
    import ray

    return ray.remote(FleetDirectory).options(name=DIRECTORY, namespace="serve", lifetime="detached", get_if_exists=True, num_cpus=0).remote()


def connect(address: str = "auto") -> None:
    import ray

    ray.init(address=address, namespace="serve", logging_level=logging.WARNING, log_to_driver=False, ignore_reinit_error=True)


def deploy(source: EngineSource, settings: ServerSettings, options: FleetOptions, address: str = "auto", app: str = STABLE) -> None:
    """kiln's app as application `app` (STABLE at /, CANARY at /canary) on the Ray cluster at
    `address`, its Serve proxies on `options.port` of every node, replacing what that
    application ran; returns once every replica serves, else raises with what Ray says."""
    from ray import serve

    connect(address)
    serve.start(proxy_location="EveryNode", http_options={"host": options.host, "port": options.port})
    deployment = serve.deployment(
        serve.ingress()(KilnReplica),
        name="kiln",
        num_replicas=options.replicas,
        max_ongoing_requests=options.max_ongoing_requests,
        max_replicas_per_node=options.max_replicas_per_node,
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        health_check_period_s=10,
        graceful_shutdown_timeout_s=60,  # streams finish before a replica goes
    )
    serve.run(deployment.bind(source, settings), name=app, route_prefix=ROUTE_PREFIX[app], blocking=False)


def remove(app: str, address: str = "auto") -> None:
    """Application `app` deleted, each replica finishing the streams it holds first."""
    from ray import serve

    connect(address)
    serve.delete(app)  # blocks until its replicas are gone


def replicas(address: str = "auto") -> list[Replica]:
    """The replicas registered now, stable ones first."""
    import ray

    connect(address)
    return ray.get(_directory().replicas.remote())


def node_proxies(port: int) -> list[NodeProxy]:
    """The Serve proxy of every live node of the connected cluster, one per address (nodes
    started on one machine share its address, and their proxies its port)."""
    import ray

    addresses = sorted({node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]})
    return [NodeProxy(f"node{i}", f"{address}:{port}") for i, address in enumerate(addresses, 1)]


def shutdown(address: str = "auto") -> None:
    """The fleet's applications and proxies stopped (each replica finishing its streams first)."""
    from ray import serve

    connect(address)
    serve.shutdown()
