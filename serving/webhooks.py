"""Checking an MLflow registry webhook delivery before acting on it.

MLflow signs `f"{delivery_id}.{timestamp}.{raw body}"` with HMAC-SHA256 and sends
`X-MLflow-Signature: v1,<base64>` (mlflow/webhooks/delivery.py). It checks no freshness, so
the receiver does: a delivery older than `max_age_s` (or from the future by as much) is a
replay. Standard-library hmac, compared in constant time; mlflow itself stays in the
registry room.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass

from components.errors import KilnError

SIGNATURE = "x-mlflow-signature"
TIMESTAMP = "x-mlflow-timestamp"
DELIVERY_ID = "x-mlflow-delivery-id"
ALIAS_EVENTS = {("model_version_alias", "created"), ("model_version_alias", "deleted")}


class WebhookRejected(KilnError):
    """A delivery that is unsigned, badly signed, stale or unreadable."""


@dataclass(frozen=True)
class AliasEvent:
    model: str
    alias: str
    action: str  # "created" | "deleted"
    version: str | None = None  # the version the alias names now (created only)


def signature_of(secret: str, delivery_id: str, timestamp: str, body: bytes) -> str:
    signed = f"{delivery_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()


def verified_alias_event(secret: str, headers: Mapping[str, str], body: bytes, now: float, max_age_s: float) -> AliasEvent | None:
    """The alias event a genuine, fresh delivery carries (None for other events); raises
    WebhookRejected naming what was wrong otherwise."""
    signature, timestamp, delivery = (headers.get(h) for h in (SIGNATURE, TIMESTAMP, DELIVERY_ID))
    if not (signature and timestamp and delivery):
        raise WebhookRejected(f"unsigned delivery: {SIGNATURE}, {TIMESTAMP} and {DELIVERY_ID} are required")
    if not hmac.compare_digest(signature.encode(), signature_of(secret, delivery, timestamp, body).encode()):
        raise WebhookRejected("the signature does not match this server's webhook secret")
    try:
        age = now - int(timestamp)
    except ValueError:
        raise WebhookRejected(f"{TIMESTAMP} is not Unix seconds: {timestamp!r}") from None
    if abs(age) > max_age_s:
        raise WebhookRejected(f"stale delivery: sent {age:.0f} s ago (limit {max_age_s:.0f} s)")
    try:
        payload = json.loads(body)
        data = payload["data"]
        kind = (payload["entity"], payload["action"])
        version = None if data.get("version") is None else str(data["version"])
        return AliasEvent(data["name"], data["alias"], payload["action"], version) if kind in ALIAS_EVENTS else None
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        raise WebhookRejected(f"the delivery is not an MLflow webhook payload: {err}") from None
