"""The Prefect events kiln emits and the deployments' triggers listen for.

Resources are named by the registered model (`kiln.data.<model>`, `kiln.registry.<model>`),
the one name a pipeline has on every machine: deployments of two projects on one Prefect
server never hear each other's events.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from components.errors import KilnError

DATA_CHANGED = "kiln.data.changed"  # payload: md5, previous, how
ALIAS_SET = "kiln.registry.alias-set"  # payload: model, alias, version


class EventNotDelivered(KilnError):
    """No Prefect server took the event."""


def data_resource(model_name: str) -> dict[str, str]:
    return {"prefect.resource.id": f"kiln.data.{model_name}", "prefect.resource.name": f"{model_name} data"}


def registry_resource(model_name: str) -> dict[str, str]:
    return {"prefect.resource.id": f"kiln.registry.{model_name}", "prefect.resource.name": f"{model_name} registry"}


def prefect_api_url() -> str | None:
    return os.environ.get("PREFECT_API_URL") or None


def announce(event: str, resource: dict[str, str], payload: dict[str, Any], api_url: str | None = None, timeout_s: float = 15.0) -> str:
    """Send one event to the Prefect server at `api_url` (default PREFECT_API_URL) and wait
    until it is sent; returns its id. Prefect's own `emit_event` queues in the background
    and drops what it cannot send, which would turn "nobody heard the data change" into
    silence."""
    url = api_url or prefect_api_url()
    if url is None:
        raise EventNotDelivered(f"no Prefect server to announce {event} to: PREFECT_API_URL is not set (kiln up starts one)")
    try:
        return asyncio.run(asyncio.wait_for(_send(url, event, resource, payload), timeout_s))
    except TimeoutError as err:
        raise EventNotDelivered(f"the Prefect server at {url} did not take {event} within {timeout_s:.0f} s") from err
    except OSError as err:  # Prefect appends a paragraph of advice to the reason: keep the reason
        reason = os.strerror(err.errno) if err.errno else str(err)[:200]
        raise EventNotDelivered(f"the Prefect server at {url} did not take {event}: {reason}") from err
    except Exception as err:  # websockets raises its own types for a refused handshake
        raise EventNotDelivered(f"the Prefect server at {url} did not take {event}: {type(err).__name__}: {err}") from err


async def _send(url: str, event: str, resource: dict[str, str], payload: dict[str, Any]) -> str:
    from prefect.events import Event
    from prefect.events.clients import PrefectEventsClient

    message = Event(event=event, resource=resource, payload=payload)
    async with PrefectEventsClient(api_url=url, reconnection_attempts=1) as client:
        await client.emit(message)
    return str(message.id)
