"""The `moeserve` command: serve, demo-model, import-gguf, anomaly-webhook."""

from __future__ import annotations

import argparse
import sys

from service.settings import add_arguments, from_namespace


def _serve(ns: argparse.Namespace) -> int:
    from service.server import serve

    return serve(from_namespace(ns))


def _demo_model(ns: argparse.Namespace) -> int:
    from inference.demo_model import write_demo_model

    path = write_demo_model(ns.out_dir, preset=ns.preset, seed=ns.seed, arch=ns.arch)
    print(path)
    return 0


def _import_gguf(ns: argparse.Namespace) -> int:
    from inference import ModelLoadError
    from inference.gguf_import import import_gguf

    try:
        print(import_gguf(ns.file, ns.out_dir))
    except ModelLoadError as exc:
        print(f"moeserve import-gguf: {exc}", file=sys.stderr)
        return 2
    return 0


def _anomaly_webhook(ns: argparse.Namespace) -> int:
    from telemetry.anomaly import run

    run(
        host=ns.host,
        port=ns.port,
        prometheus_url=ns.prometheus_url,
        forward_url=ns.forward_url,
        window_s=ns.window_s,
        step_s=ns.step_s,
        onset_lookback_s=ns.onset_lookback_s,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from inference.demo_model import ARCHS, PRESETS

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
    hook.add_argument("--host", default="127.0.0.1")
    hook.add_argument("--port", type=int, default=9095)
    hook.add_argument("--prometheus-url", default="http://127.0.0.1:9090")
    hook.add_argument(
        "--forward-url", default=None, help="forward enriched incidents to this webhook"
    )
    hook.add_argument(
        "--window-s", type=float, default=1800, help="history pulled per alert (seconds)"
    )
    hook.add_argument(
        "--step-s", type=float, default=15, help="resolution of that history (seconds)"
    )
    hook.add_argument(
        "--onset-lookback-s",
        type=float,
        default=300,
        help="how far before the alert the anomaly may have started (seconds)",
    )
    hook.set_defaults(func=_anomaly_webhook)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns) or 0


if __name__ == "__main__":
    sys.exit(main())
