"""``python -m pipelines.compile --out pipeline.yaml [--local]``: the pipeline as IR YAML for the KFP UI/API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kfp import compiler

from pipelines.training_pipeline import local_pipeline, training_pipeline


def compile_pipeline(out: str | Path, local: bool = False) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(local_pipeline if local else training_pipeline, str(out))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.compile", description=__doc__)
    parser.add_argument("--out", default="pipeline.yaml", help="output YAML path (default: pipeline.yaml)")
    parser.add_argument("--local", action="store_true",
                        help="the local variant (retry backoff of seconds, for kfp.local)")
    args = parser.parse_args(argv)
    print(f"wrote {compile_pipeline(args.out, args.local)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
