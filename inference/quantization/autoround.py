"""AutoRound's own checkpoint format (quant_method "auto-round", Intel's AutoRound; what
SGLang's CPU backend serves in int4): the tensors of a GPTQ or AWQ packing, named by
`packing_format` ("auto_round:auto_gptq", GPTQ v1's zero points stored minus one;
"auto_round:gptqmodel", GPTQ v2's; "auto_round:auto_awq", AWQ's GEMM packing), with
per-layer overrides in `extra_config` (bits 16: a layer left unquantized, stored as its
16-bit weight). Unpacked by gptq.py / awq.py.

Served: 4-bit integer weights in those packings. Refused, naming the field: other bit
widths (in the config or an extra_config override), float data types (mx_fp, nv_fp...),
other packings."""

from __future__ import annotations

from types import ModuleType

from inference.quantization import awq, gptq
from inference.quantization.published import UnservedVariant, require

SERVED = "bits 4, data_type int, packing_format auto_round:auto_gptq, :gptqmodel or :auto_awq"
_PACKINGS = {
    "auto_round:auto_gptq": (gptq, "gptq"),
    "auto_round:gptqmodel": (gptq, "gptq_v2"),
    "auto_round:auto_awq": (awq, None),
}


def _packing(qc: dict) -> str:
    return qc.get("packing_format", "auto_round:auto_gptq")


def packing_module(qc: dict) -> ModuleType:
    """gptq or awq: the module that reads this checkpoint's tensors."""
    require(qc, "packing_format", tuple(_PACKINGS), SERVED, default=_packing(qc))
    return _PACKINGS[_packing(qc)][0]


def scheme(qc: dict):
    """The packing module's scheme for this checkpoint (gptq.GptqScheme / awq.AwqScheme)."""
    module, checkpoint_format = _PACKINGS[
        require(qc, "packing_format", tuple(_PACKINGS), SERVED, default=_packing(qc))
    ]
    require(qc, "bits", (4,), SERVED)
    require(qc, "data_type", ("int",), SERVED, default="int")
    for layer, override in (qc.get("extra_config") or {}).items():
        bits = override.get("bits", 4)
        if bits < 16 and bits != 4:
            raise UnservedVariant(f"quantization_config.extra_config[{layer!r}].bits", bits, SERVED)
        if bits == 4 and override.get("data_type", "int") != "int":
            raise UnservedVariant(
                f"quantization_config.extra_config[{layer!r}].data_type",
                override["data_type"],
                SERVED,
            )
    if module is gptq:
        return gptq.scheme({**qc, "checkpoint_format": checkpoint_format, "dynamic": None})
    return awq.scheme({**qc, "version": "gemm", "zero_point": not qc.get("sym", True)})
