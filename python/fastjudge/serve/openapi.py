"""The server's routes as declarations, and its OpenAPI 3.1 document generated from them.

Each :class:`Operation` is one route: its handler, its request body model, its answers and the
statuses it refuses with. The app's Starlette routes are made from the same declarations
(:meth:`Operation.route`), so the document lists exactly what is served, and its schemas are
the pydantic models' own JSON Schema (the models the requests are validated with).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from .schemas import Error

UNAUTHORIZED = "missing or wrong API key (only when the server has one)"


@dataclass(frozen=True)
class Refusal:
    """An error status of a route: what it means and the model of its body."""

    description: str
    body: type[BaseModel] = Error


@dataclass(frozen=True)
class Operation:
    """One route. ``answers``: content type -> body model (or a plain JSON schema) of its 200;
    ``refusals``: status -> :class:`Refusal` (401 is added for a server with an API key);
    ``needs_key``: False for a route every client may call."""

    path: str
    method: str
    endpoint: Callable
    summary: str
    answer: str
    answers: dict[str, Any]
    request: type[BaseModel] | None = None
    refusals: dict[str, Refusal] = field(default_factory=dict)
    parameters: tuple[dict, ...] = ()
    needs_key: bool = True

    def route(self):
        from starlette.routing import Route

        return Route(self.path, self.endpoint, methods=[self.method.upper()])


def _models(operations: list[Operation]) -> list[tuple[type[BaseModel], str]]:
    """Every body model with its JSON Schema mode: requests are validated, answers serialized."""
    found: dict[tuple[type, str], None] = {}
    for op in operations:
        if op.request is not None:
            found[(op.request, "validation")] = None
        bodies = [*op.answers.values(), *(r.body for r in op.refusals.values()), Error]
        for body in bodies:
            if isinstance(body, type) and issubclass(body, BaseModel):
                found[(body, "serialization")] = None
    return list(found)


def openapi_document(operations: list[Operation], title: str, version: str,
                     authenticated: bool) -> dict:
    """The OpenAPI 3.1 document of ``operations``; ``authenticated``: every route that needs a
    key asks for a bearer token."""
    refs, definitions = models_json_schema(_models(operations),
                                           ref_template="#/components/schemas/{model}")

    def schema(body: Any, mode: str = "serialization") -> dict:
        return refs[(body, mode)] if isinstance(body, type) else body

    paths: dict[str, dict] = {}
    for op in operations:
        refusals = dict(op.refusals)
        if authenticated and op.needs_key:
            refusals["401"] = Refusal(UNAUTHORIZED)
        entry: dict[str, Any] = {"summary": op.summary}
        if op.parameters:
            entry["parameters"] = list(op.parameters)
        if op.request is not None:
            entry["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": schema(op.request, "validation")}}}
        entry["responses"] = {"200": {"description": op.answer, "content": {
            kind: {"schema": schema(body)} for kind, body in op.answers.items()}}}
        for status in sorted(refusals):
            refusal = refusals[status]
            entry["responses"][status] = {"description": refusal.description, "content": {
                "application/json": {"schema": schema(refusal.body)}}}
        if authenticated and not op.needs_key:
            entry["security"] = []
        paths.setdefault(op.path, {})[op.method] = entry
    document = {"openapi": "3.1.0", "info": {"title": title, "version": version},
                "paths": paths, "components": {"schemas": definitions.get("$defs", {})}}
    if authenticated:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer",
                       "description": "the server's API key (--api-key or FASTJUDGE_API_KEY)"}}
        document["security"] = [{"bearer": []}]
    return document
