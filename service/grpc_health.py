"""grpc.health.v1.Health following `state.ready` (services "" and moeserve.v1.Inference):
NOT_SERVING while the engine is not running or the server drains. Check reads the state
live; Watch streams follow a HEALTH_POLL_S poll. Once draining it stays NOT_SERVING."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from service.state import ServingState
from telemetry.logging import get_logger

log = get_logger("service.grpc")

HEALTH_POLL_S = 0.2


class ServingHealth(HealthServicer):
    def __init__(self, state: ServingState, services: tuple[str, ...]) -> None:
        super().__init__()
        self._state, self._services = state, services

    async def sync(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        status = serving if self._state.ready else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != serving and not self._gracefully_shutting_down and self._state.draining:
            await self.enter_graceful_shutdown()  # draining is for good
        for service in self._services:
            if self._server_status.get(service) != status:
                await self.set(service, status)

    async def Check(self, request, context):
        await self.sync()
        return await super().Check(request, context)

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            try:
                await self.sync()
            except Exception:  # health reporting must outlive a bad sync
                log.exception("gRPC health sync failed")
