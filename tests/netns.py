"""A Ray cluster whose worker nodes are hosts of their own: each in a Linux network namespace
with its own address on a bridge to this machine, which runs the head (the tests' driver
must be on a node). Their Serve proxies then listen on addresses of their own, as on
separate machines, and HAProxy balances over them. Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
IP = shutil.which("ip") or shutil.which("ip", path="/usr/sbin:/sbin")


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()[-600:]}")


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if IP is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"kprobe{random.randrange(10**6)}"
    done = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


@contextmanager
def bridged_namespaces(count: int) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """`count` namespaces on a new bridge: this machine's address on it, and each
    namespace's (name, address); all deleted at the end."""
    tag, subnet = f"{random.randrange(16**4):04x}", f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
    bridge, made = f"kbr{tag}", []
    try:
        _run(IP, "link", "add", bridge, "type", "bridge")
        _run(IP, "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run(IP, "link", "set", bridge, "up")
        for i in range(1, count + 1):
            name, outer, inner, address = f"kns{tag}{i}", f"kv{tag}{i}", f"kp{tag}{i}", f"{subnet}.{i + 1}"
            _run(IP, "netns", "add", name)
            made.append(name)
            _run(IP, "link", "add", outer, "type", "veth", "peer", "name", inner)
            _run(IP, "link", "set", outer, "master", bridge, "up")
            _run(IP, "link", "set", inner, "netns", name)
            for step in (["addr", "add", f"{address}/24", "dev", inner], ["link", "set", inner, "up"], ["link", "set", "lo", "up"], ["route", "add", "default", "via", f"{subnet}.1"]):
                _run(IP, "netns", "exec", name, IP, *step)
        yield f"{subnet}.1", [(name, f"{subnet}.{i + 2}") for i, name in enumerate(made)]
    finally:
        for name in made:
            subprocess.run([IP, "netns", "del", name], capture_output=True)
        subprocess.run([IP, "link", "del", bridge], capture_output=True)


def start_namespaced_cluster(host: str, nodes: list[tuple[str, str]], port: int, cpus_per_node: int, env: dict[str, str]) -> str:
    """The head on this machine at `host` (no CPUs: replicas go to the workers), a worker in
    each namespace at its own address; the cluster's address."""
    object_store = "--object-store-memory=268435456"
    _env_run(env, RAY, "start", "--head", f"--node-ip-address={host}", f"--port={port}", "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats", object_store)
    for name, address in nodes:
        _env_run(env, IP, "netns", "exec", name, RAY, "start", f"--address={host}:{port}", f"--node-ip-address={address}", f"--num-cpus={cpus_per_node}", "--disable-usage-stats", object_store)
    return f"{host}:{port}"


def _env_run(env: dict[str, str], *command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | env)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {(done.stderr or done.stdout).strip()[-800:]}")
