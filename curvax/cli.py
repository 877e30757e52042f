"""The ``curvax`` command line (``curvax demo``)."""

from __future__ import annotations

import argparse
from typing import Sequence

from curvax.datasets import NUM_EXAMPLES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _num_images(text: str) -> int:
    value = int(text)
    if not 1 <= value <= NUM_EXAMPLES:
        raise argparse.ArgumentTypeError(f"must be between 1 and {NUM_EXAMPLES}, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for ``curvax`` and its subcommands."""
    parser = argparse.ArgumentParser(prog="curvax", description="curvax: K-FAC and curvature tools for JAX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="train the MNIST autoencoder with curvax K-FAC and with Adam, and compare",
        description="Trains the deep MNIST autoencoder (784-1000-500-250-30-250-500-1000-784) full batch with "
        "curvax K-FAC (adaptive learning rate, momentum and damping) and with Optax Adam, prints a results "
        "table and writes plots of the loss against steps and seconds. Defaults take about 2 minutes on 2 CPU cores.",
    )
    demo.add_argument("--num-images", type=_num_images, default=1000,
                      help=f"full-batch size, real MNIST test images (1..{NUM_EXAMPLES}, default 1000)")
    demo.add_argument("--steps", type=_positive_int, default=100, help="K-FAC steps (default 100)")
    demo.add_argument("--adam-steps", type=_positive_int, default=500,
                      help="Adam steps (default 500: a K-FAC step costs 2-4 Adam steps)")
    demo.add_argument("--time-budget", type=_positive_float, default=None,
                      help="optional cap on each optimizer's training seconds after its first step "
                      "(default: none; the step counts decide)")
    demo.add_argument("--adam-lr", type=_positive_float, default=1e-3, help="Adam learning rate (default 1e-3)")
    demo.add_argument("--initial-damping", type=_positive_float, default=1.0,
                      help="K-FAC initial damping (default 1.0)")
    demo.add_argument("--curvature-batch-fraction", type=_fraction, default=1.0, metavar="F",
                      help="estimate K-FAC's curvature on a random fraction F of the batch each step "
                      "(default 1.0, the whole batch, as kfac-jax; 0.25 makes each step cheaper)")
    demo.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")
    demo.add_argument("--output", default="curvax_demo.png",
                      help="where to write the loss-vs-time plot (default curvax_demo.png)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars or layer-registration table")
    demo.add_argument("--compilation-cache", metavar="DIR", default=None,
                      help="keep compiled steps in DIR (JAX's persistent compilation cache) so that a later run "
                      "skips most of the compile time (default: no cache)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``curvax`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from curvax import demo

        return demo.main(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
