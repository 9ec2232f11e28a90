"""`kiln fleet`: kiln serve's replicas on a real Ray cluster of two nodes (both on this
machine, each its own raylet), Debian's HAProxy in front of the nodes' Serve proxies, a real
MLflow store with a signed champion that every replica pulls and verifies itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from components.runtime.sampling import Sampling
from components.runtime.tokenizer import EngineTokenizer
from registry import CHAMPION, RegistryTarget, promote, register_engine
from serving.app import VERSION_HEADER, ServerSettings
from serving.haproxy import NodeProxy, haproxy_config
from serving.sources import AliasSource

from .conftest import SIGNING, new_mlflow_store
from .live_server import free_port
from .test_registry import record

MODEL = "kiln-fleet"
HAPROXY = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
needs_haproxy = pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (Debian's package haproxy; .ci/run installs it)")


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each: one replica fits each node."""
    import ray

    from flows.fleet import start_local_cluster, stop_fleet

    address = start_local_cluster(nodes=2, cpus_per_node=1, port=free_port())
    yield address
    try:
        stop_fleet(address)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster, engine_dir, tmp_path_factory):
    from serving.fleet import FleetOptions, deploy

    root = tmp_path_factory.mktemp("fleet")
    target = RegistryTarget(new_mlflow_store(root / "mlflow.db"), MODEL, MODEL, root / "artifacts", SIGNING)
    version = register_engine(target, engine_dir.path, engine_dir.sha256, record()).version
    promote(target, CHAMPION, version=version)
    options = FleetOptions(replicas=2, cpus_per_replica=1, max_replicas_per_node=1, port=free_port())
    deploy(AliasSource(target, CHAMPION, root / "cache"), ServerSettings(poll_interval_s=0, max_tokens=64), options, cluster)
    return SimpleNamespace(root=root, version=version, options=options, url=f"http://127.0.0.1:{options.port}")


@pytest.fixture(scope="module")
def haproxy(fleet, tmp_path_factory):
    """HAProxy run with the configuration kiln made for the cluster's nodes."""
    import time

    from serving.fleet import node_proxies

    folder, port = tmp_path_factory.mktemp("haproxy"), free_port()
    config = folder / "haproxy.cfg"
    config.write_text(haproxy_config(node_proxies(fleet.options.port), port, folder / "admin.sock", listen_host="127.0.0.1"))
    process = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not _ready(url):  # its first health checks pass within a few seconds
        assert process.poll() is None and time.monotonic() < deadline, process.stdout.read() if process.poll() is not None else "HAProxy never passed a node"
        time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def replica_metrics(fleet) -> dict[str, dict[str, float]]:
    """Each replica's own /metrics (by replica id), found through /fleet/targets."""
    targets = httpx.get(f"{fleet.url}/fleet/targets", timeout=10).json()
    out = {}
    for target in targets:
        text = httpx.get(f"http://{target['targets'][0]}/metrics", timeout=10).text
        out[target["labels"]["replica"]] = {
            f"{sample.name}{json.dumps(sample.labels, sort_keys=True) if sample.labels else ''}": sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }
    return out


def test_two_replicas_serve_on_two_nodes_each_listing_its_own_metrics_for_prometheus(fleet):
    targets = httpx.get(f"{fleet.url}/fleet/targets", timeout=10).json()
    assert len(targets) == 2 and len({t["labels"]["node_id"] for t in targets}) == 2  # spread: one a node
    assert all(set(t["labels"]) == {"replica", "node", "node_id"} for t in targets)
    for metrics in replica_metrics(fleet).values():
        assert metrics["kiln_ready"] == 1.0


@needs_haproxy
def test_clients_through_haproxy_get_the_champions_greedy_answers_from_both_replicas(fleet, haproxy, engine, engine_dir):
    tokenizer = EngineTokenizer(engine_dir.path)
    client = OpenAI(base_url=f"{haproxy}/v1", api_key="none", max_retries=0)
    before = {replica: m.get('kiln_requests_total{"outcome": "ok"}', 0.0) for replica, m in replica_metrics(fleet).items()}
    prompts = [f"The list {i}" for i in range(16)]
    for prompt in prompts:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert raw.headers[VERSION_HEADER] == fleet.version
        expected = engine.generate([tokenizer.encode(prompt)], Sampling(max_new_tokens=6))[0]
        assert raw.parse().choices[0].text == tokenizer.decode(expected)
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, stream=True))
    assert streamed == tokenizer.decode(engine.generate([tokenizer.encode(prompts[0])], Sampling(max_new_tokens=6))[0])
    served = Counter({replica: m.get('kiln_requests_total{"outcome": "ok"}', 0.0) - before[replica] for replica, m in replica_metrics(fleet).items()})
    assert sum(served.values()) == 17 and all(n > 0 for n in served.values()), served  # all 16 on one replica: 2**-15


def test_haproxy_config_checks_every_node_on_readyz_and_refuses_no_nodes(tmp_path):
    config = haproxy_config([NodeProxy("node1", "10.0.0.1:8200"), NodeProxy("node2", "10.0.0.2:8200")], 8300, tmp_path / "admin.sock")
    assert "option httpchk GET /readyz" in config and "balance leastconn" in config
    assert "server node1 10.0.0.1:8200 check" in config and "server node2 10.0.0.2:8200 check" in config
    if HAPROXY:
        checked = subprocess.run([HAPROXY, "-c", "-f", "/dev/stdin"], input=config, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    with pytest.raises(ValueError, match="at least one node"):
        haproxy_config([], 8300, tmp_path / "admin.sock")
