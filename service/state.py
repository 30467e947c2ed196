"""What the REST and gRPC servers share: the engine, the settings, the API keys, readiness and
draining."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from inference import AsyncLLMEngine
from service.api_keys import KeyRing
from service.inspector.recorder import InspectorRecorder
from service.observability import Observability
from service.parsers.reasoning import reasoning_parser_for
from service.parsers.tool_calls import parser_for
from service.reasoning import enable_in_reasoning
from service.settings import Settings


@dataclass
class ServingState:
    engine: AsyncLLMEngine
    settings: Settings
    model_name: str
    draining: bool = False
    in_flight: int = 0
    observability: Observability = field(default_factory=Observability.disabled)
    inspector: InspectorRecorder | None = None  # None with --no-inspector
    keys: KeyRing | None = None  # None: from --api-key / --api-keys-file (KeysFileError)
    startup: Any = None  # service.startup.StartupProgress of this start (MoeServer's)
    # this server's service.instance.id (telemetry.instance: process-wide, the last server's)
    instance_id: str | None = None
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        if self.keys is None:
            self.keys = KeyRing(self.settings.api_key, self.settings.api_keys_file)
        self.observability.add_keys(self.keys.labels())

    @property
    def tool_parser(self) -> str:
        """The tool-call syntax the model writes: --tool-call-parser, or its family's (auto)."""
        if self.settings.tool_call_parser != "auto":
            return self.settings.tool_call_parser
        template = getattr(self.engine.tokenizer, "chat_template", None)
        return parser_for(self.engine.args.architecture, template)

    @property
    def reasoning_parser(self) -> str | None:
        """How the model marks its reasoning: --reasoning-parser, or its family's (auto); None
        where it does not reason (or with `none`)."""
        name = self.settings.reasoning_parser
        if name != "auto":
            return None if name == "none" else name
        template = getattr(self.engine.tokenizer, "chat_template", None)
        return reasoning_parser_for(self.engine.args.architecture, template)

    @property
    def grammar_in_reasoning(self) -> bool:
        """--structured-outputs-config's enable_in_reasoning: grammars constrain the reasoning
        too (by default they start where it ends)."""
        return enable_in_reasoning(self.settings.structured_outputs_config)

    @property
    def ready(self) -> bool:
        return self.engine.is_alive and not self.draining

    def enter(self) -> None:
        """A generation request entered the engine (service/generation.py)."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Stops admitting requests and waits for the in-flight ones; False on timeout."""
        self.draining = True
        if self.in_flight == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
