"""Minimal async client for the Prometheus HTTP API (query_range, query_exemplars)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np


class PrometheusError(Exception):
    """Prometheus could not answer; ``unavailable`` is True for transport failures."""

    def __init__(self, reason: str, *, unavailable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unavailable = unavailable


@dataclass(frozen=True, slots=True)
class RangeSeries:
    labels: dict[str, str]
    timestamps: np.ndarray
    values: np.ndarray


@dataclass(frozen=True, slots=True)
class ExemplarSample:
    series_labels: dict[str, str]
    labels: dict[str, str]
    value: float
    timestamp: float


def _as_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


class PrometheusAPI:
    """``GET /api/v1/query_range`` and ``GET /api/v1/query_exemplars`` over httpx."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, transport=transport
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get(self, path: str, params: dict[str, str]) -> Any:
        try:
            resp = await self._client.get(path, params=params)
        except httpx.TimeoutException as exc:
            raise PrometheusError(
                f"timeout after {self._client.timeout.read}s: {self.base_url}", unavailable=True
            ) from exc
        except httpx.TransportError as exc:
            raise PrometheusError(
                f"unreachable: {self.base_url}: {exc.__class__.__name__}: {exc}",
                unavailable=True,
            ) from exc
        try:
            body = resp.json()
        except ValueError as exc:
            raise PrometheusError(f"HTTP {resp.status_code}: not JSON") from exc
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(
                f"HTTP {resp.status_code}: {body.get('errorType', '')}: {body.get('error', '')}"
            )
        return body.get("data")

    async def query_range(
        self, query: str, start: float, end: float, step: float
    ) -> list[RangeSeries]:
        data = await self._get(
            "/api/v1/query_range",
            {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
        )
        out: list[RangeSeries] = []
        for item in (data or {}).get("result", []):
            values = item.get("values") or []
            ts = np.array([_as_float(t) for t, _ in values], dtype=float)
            vs = np.array([_as_float(v) for _, v in values], dtype=float)
            out.append(RangeSeries(dict(item.get("metric") or {}), ts, vs))
        return out

    async def query_exemplars(self, query: str, start: float, end: float) -> list[ExemplarSample]:
        data = await self._get(
            "/api/v1/query_exemplars",
            {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}"},
        )
        out: list[ExemplarSample] = []
        for item in data or []:
            series_labels = dict(item.get("seriesLabels") or {})
            for ex in item.get("exemplars") or []:
                out.append(
                    ExemplarSample(
                        series_labels,
                        dict(ex.get("labels") or {}),
                        _as_float(ex.get("value")),
                        _as_float(ex.get("timestamp")),
                    )
                )
        return out
