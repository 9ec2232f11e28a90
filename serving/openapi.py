"""kiln serve's OpenAPI schema (`GET /openapi.json`, the `/docs` page, the HTTP reference).

The completion routes parse their bodies themselves (OpenAI-style errors naming the field,
a size limit before parsing), so FastAPI cannot see their request and response models:
they are added here from the same pydantic models the handlers use."""

from __future__ import annotations

import json
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from serving.schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ErrorBody, ModelList

DESCRIPTION = (
    "OpenAI-compatible completions and chat completions from the engine an MLflow alias names, "
    "with Prometheus metrics. `/v1/*` wants `Authorization: Bearer <KILN_API_KEY>` when the key is set."
)
# (path, method) → (request body, 200 answer); a streamed request answers server-sent events instead.
BODIES: dict[tuple[str, str], tuple[type[BaseModel] | None, type[BaseModel]]] = {
    ("/v1/completions", "post"): (CompletionRequest, Completion),
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletion),
    ("/v1/models", "get"): (None, ModelList),
}


def kiln_version() -> str:
    """kiln's version: its installed metadata, or a checkout's pyproject.toml where kiln runs
    from the source tree without being installed (as on the lent GPU machine)."""
    try:
        return version("kiln")
    except PackageNotFoundError:
        return tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]


def documented_schema(app: FastAPI, version: str) -> dict:
    schema = get_openapi(title="kiln serve", version=version, description=DESCRIPTION, routes=app.routes)
    found: dict[str, dict] = {}
    for (path, method), (request, answer) in BODIES.items():
        operation = schema["paths"][path][method]
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request, found)}}}
            operation["responses"]["400"] = {"description": "a bad request, naming the field", "content": {"application/json": {"schema": _ref(ErrorBody, found)}}}
        operation["responses"]["200"]["content"] = {"application/json": {"schema": _ref(answer, found)}}
        operation["security"] = [{"bearer": []}]
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(found)
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description": "KILN_API_KEY, where it is set"}}
    return schema


def _ref(model: type[BaseModel], found: dict[str, dict]) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    found.update(schema.pop("$defs", {}))
    found[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def docs_page(schema: dict) -> str:
    """Swagger UI with the schema inlined: a page fetched with the API key needs no second,
    authorised fetch of /openapi.json (which a browser could not make)."""
    spec = json.dumps(schema).replace("</", "<\\/")
    return f"""<!doctype html>
<html><head><title>kiln serve API</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{spec: {spec}, dom_id: "#swagger-ui"}});</script>
</body></html>"""
