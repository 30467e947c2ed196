"""The `moeserve` command: serve, demo-model, import-gguf, anomaly-webhook."""

from __future__ import annotations

import argparse
import sys

from service.settings import add_arguments, from_namespace


def _serve(ns: argparse.Namespace) -> int:
    from service.process import serve

    return serve(from_namespace(ns))


def _demo_model(ns: argparse.Namespace) -> int:
    from inference.checkpoints.demo_model import write_demo_model

    path = write_demo_model(ns.out_dir, preset=ns.preset, seed=ns.seed, arch=ns.arch)
    print(path)
    return 0


def _import_gguf(ns: argparse.Namespace) -> int:
    from inference import ModelLoadError
    from inference.checkpoints.gguf_import import import_gguf

    try:
        print(import_gguf(ns.file, ns.out_dir))
    except ModelLoadError as exc:
        print(f"moeserve import-gguf: {exc}", file=sys.stderr)
        return 2
    return 0


def _anomaly_webhook(ns: argparse.Namespace) -> int:
    from telemetry.anomaly import run

    run(**{k: v for k, v in vars(ns).items() if k not in ("command", "func")})
    return 0


# flag, type, default, help
_WEBHOOK_FLAGS = (
    ("--host", str, "127.0.0.1", None),
    ("--port", int, 9095, None),
    ("--prometheus-url", str, "http://127.0.0.1:9090", None),
    ("--forward-url", str, None, "forward enriched incidents to this webhook"),
    ("--window-s", float, 1800, "history pulled per alert (seconds)"),
    ("--step-s", float, 15, "resolution of that history (seconds)"),
    ("--onset-lookback-s", float, 300, "how far before the alert the anomaly may start (seconds)"),
)


def build_parser() -> argparse.ArgumentParser:
    from inference.checkpoints.demo_model import ARCHS, PRESETS

    parser = argparse.ArgumentParser(prog="moeserve", description="Observable MoE inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over REST (OpenAI-compatible) and gRPC")
    add_arguments(serve)
    serve.set_defaults(func=_serve)

    demo = sub.add_parser("demo-model", help="write a random-weight demo checkpoint folder")
    demo.add_argument("out_dir")
    demo.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--arch", choices=sorted(ARCHS), default="mixtral")
    demo.set_defaults(func=_demo_model)

    imp = sub.add_parser(
        "import-gguf",
        help="convert a GGUF checkpoint into a Hugging Face folder (dequantised, bfloat16)",
    )
    imp.add_argument("file")
    imp.add_argument("out_dir")
    imp.set_defaults(func=_import_gguf)

    hook = sub.add_parser("anomaly-webhook", help="Alertmanager webhook that explains what moved")
    for flag, kind, default, help_text in _WEBHOOK_FLAGS:
        hook.add_argument(flag, type=kind, default=default, help=help_text)
    hook.set_defaults(func=_anomaly_webhook)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns) or 0


if __name__ == "__main__":
    sys.exit(main())
