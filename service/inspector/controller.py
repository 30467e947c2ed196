"""The inspector's routes: GET /inspect (the page), /inspect/static/* (its script and style)
and the JSON API under /inspect/api (in the OpenAPI document, behind --api-key like /v1).

The page carries no data, so it and its files are open; it asks for the key when the API
answers 401. Its Content-Security-Policy allows nothing from elsewhere (no CDN, no inline
script).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from litestar import Controller, Request, Response, Router, get
from litestar.datastructures import CacheControlHeader
from litestar.openapi import ResponseSpec
from litestar.params import Parameter
from litestar.static_files import create_static_files_router

from service.auth import require_api_key
from service.errors import NotFound
from service.inspector import views
from service.inspector.recorder import InspectorRecorder
from service.inspector.schemas import (
    Filter,
    InspectorEngine,
    InspectorRequestDetail,
    InspectorRequestList,
)
from service.openapi_errors import errors
from service.responses import ErrorResponse

STATIC = Path(__file__).parent / "static"
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
}


def _recorder(request: Request) -> InspectorRecorder:
    return request.app.state.serving.inspector


class InspectorController(Controller):
    path = "/inspect"
    tags = ("Inspector",)

    @get("/", include_in_schema=False, media_type="text/html")
    async def page(self) -> Response[bytes]:
        """The inspector page."""
        return Response((STATIC / "index.html").read_bytes(), headers=_PAGE_HEADERS)

    @get(
        "/api/requests",
        operation_id="inspectorListRequests",
        guards=[require_api_key],
        responses=errors(400, 401),
    )
    async def list_requests(
        self,
        request: Request,
        filter: Annotated[
            Filter,
            Parameter(
                description="errors (4xx/5xx but 429s and aborts), aborts (the client left), "
                "rejected (429: queue full), slow (e2e over the current p95)"
            ),
        ] = "all",
        limit: Annotated[int | None, Parameter(ge=1, description="at most this many")] = None,
    ) -> InspectorRequestList:
        """The recorded requests, newest first (a ring of --inspector-requests)."""
        recorder = _recorder(request)
        return views.request_list(recorder, filter, limit or recorder.capacity)

    @get(
        "/api/requests/{id:str}",
        operation_id="inspectorGetRequest",
        guards=[require_api_key],
        responses={
            **errors(401),
            404: ResponseSpec(
                ErrorResponse,
                description="No recorded request has this id",
                generate_examples=False,
            ),
        },
    )
    async def get_request(
        self,
        request: Request,
        id: Annotated[
            str,
            Parameter(description="the inspector's id, or a request id, response id or trace id"),
        ],
    ) -> InspectorRequestDetail:
        """One request: its phases, the engine steps it shared, its log lines."""
        recorder = _recorder(request)
        record = recorder.find(id)
        if record is None:
            raise NotFound(f"no recorded request {id!r}", param="id", code="unknown_request")
        return views.detail(recorder, record, request.app.state.serving.engine.tokenizer.decode)

    @get(
        "/api/engine",
        operation_id="inspectorEngine",
        guards=[require_api_key],
        responses=errors(401),
    )
    async def engine(self, request: Request) -> InspectorEngine:
        """The engine now and over the last minutes (sparklines, expert-load heatmap)."""
        state = request.app.state.serving
        return views.engine_view(
            state.inspector, state.engine, state.model_name, state.in_flight, state.instance_id
        )


def inspector_routes() -> list[Controller | Router | type[Controller]]:
    """The page, its files and the API (absent with --no-inspector: 404s)."""
    static = create_static_files_router(
        "/inspect/static",
        directories=[STATIC],
        name="inspector-static",
        cache_control=CacheControlHeader(no_cache=True),
    )
    return [InspectorController, static]
