"""The CPU kernel paths the tests force one by one (inference/kernels/cpu.py): each native
build, best first, then the emulated ones (the AVX-512 source on SIMDe's portable
intrinsics, AMX on amx_emulation.h's plain-C tiles) that any CPU with AVX2 runs. A path this
CPU cannot run is skipped with the reason."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from inference.kernels import cpu as cpu_kernels


@dataclass(frozen=True)
class Path:
    isa: str
    amx: bool = False
    emulated: bool = False

    def __str__(self) -> str:
        return f"{self.isa}{'+amx' if self.amx else ''}{'-emulated' if self.emulated else ''}"

    def missing(self) -> str | None:
        """Why this CPU cannot run the path, or None."""
        if platform.machine() not in ("x86_64", "AMD64"):
            return f"{platform.machine()}: no x86 kernels"
        if self.emulated:
            if "avx2" not in cpu_kernels.runnable_isas():
                return "emulation builds need AVX2"
            return None
        lacking = cpu_kernels.BUILDS[self.isa][1] - cpu_kernels.cpu_flags()
        if self.amx:
            lacking |= {"amx_tile", "amx_bf16"} - cpu_kernels.cpu_flags()
        return f"this CPU lacks {', '.join(sorted(lacking))}" if lacking else None


# Native paths best first (AMX, AVX512-BF16, AVX-512, AVX2), then the emulated builds.
PATHS = [
    Path("avx512", amx=True),
    Path("avx512bf16"),
    Path("avx512"),
    Path("avx2"),
    Path("avx512bf16", emulated=True),
    Path("avx512", emulated=True),
    Path("avx2", amx=True, emulated=True),
]


@contextlib.contextmanager
def forced(p: Path) -> Iterator[Path]:
    """Runs the block on path `p` (skipping the test where this CPU cannot run it), then
    restores the automatic choice."""
    reason = p.missing()
    if reason:
        pytest.skip(f"{p}: {reason}")
    chosen = cpu_kernels.enable(p.isa, amx=p.amx, emulated=p.emulated)
    try:
        if p.amx and not p.emulated and chosen == p.isa and not cpu_kernels.AMX:
            pytest.skip(f"{p}: Linux refused the AMX register state")
        if chosen != p.isa or cpu_kernels.AMX != p.amx:
            pytest.fail(f"{p}: enable() chose {chosen} amx={cpu_kernels.AMX}")
        # enable() falls back to the plain products with a warning where the VNNI library
        # fails to build: a forced path must run the products it names
        vnni_cpu = p.emulated or cpu_kernels._VNNI[p.isa][1] in cpu_kernels.cpu_flags()
        if vnni_cpu and cpu_kernels.INT8 == p.isa:
            pytest.fail(f"{p}: the int8 products are off VNNI (its library did not build)")
        yield p
    finally:
        cpu_kernels.enable()
