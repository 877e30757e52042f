"""The ``curvax`` command line: ``curvax demo``."""

from __future__ import annotations

import argparse
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="curvax", description="curvax: K-FAC and curvature tools for JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the MNIST autoencoder with curvax K-FAC and with Adam, and compare")
    demo.add_argument("--num-images", type=int, default=2000, help="full-batch size (1..10000, default 2000)")
    demo.add_argument("--steps", type=int, default=1000, help="maximum K-FAC steps (default 1000)")
    demo.add_argument("--adam-steps", type=int, default=5000, help="maximum Adam steps (default 5000)")
    demo.add_argument("--time-budget", type=float, default=55.0, help="seconds per optimizer, compile included (default 55)")
    demo.add_argument("--adam-lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    demo.add_argument("--initial-damping", type=float, default=10.0, help="K-FAC initial damping (default 10)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--output", default="curvax_demo.png", help="where to write the loss-vs-time plot")
    demo.add_argument("--quiet", action="store_true", help="no progress bars or registration table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        if not 1 <= args.num_images <= 10_000:
            raise SystemExit("curvax demo: --num-images must be between 1 and 10000.")
        if args.steps < 1 or args.adam_steps < 1 or args.time_budget <= 0:
            raise SystemExit("curvax demo: --steps and --adam-steps must be >= 1 and --time-budget > 0.")
        from curvax import demo

        return demo.main(args)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
