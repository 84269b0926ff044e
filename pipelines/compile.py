"""``python -m pipelines.compile --image IMAGE [--out pipeline.yaml]``: the pipeline as IR YAML for the KFP UI/API.

The YAML is compiled for one image: ``--image`` becomes the default of the ``image`` parameter (every step
and the training pods run it; there is no built-in default), ``--image-pull-secret`` the pull secrets of
every step (the first one as the default of the run parameter ``step_image_pull_secret``) and the default
of the training pods' ``image_pull_secrets``, and the project's build stamp (``--print-version``) goes into the
pipeline's description and its first step, which fails when the image was built from another version.
Build the image with the same stamp: ``docker build --build-arg VERSION="$(python -m pipelines.compile
--print-version)" ...``. Running it needs a KFP backend >= 2.4 (parameterized image and resources); the
run-time node selector and tolerations of the steps and their ``step_image_pull_secret`` need >= 2.5 (a 2.4
backend ignores them, pulling with the first compiled secret): see deploy/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kfp import compiler

from components.lib.params import ParamError, PipelineParams
from components.lib.version import build_stamp
from pipelines.training_pipeline import CLUSTER_RETRY, LOCAL_RETRY, PIPELINE_NAME, Build, make_pipeline

IMAGE_ENV = "IMAGE"


def compile_pipeline(out: str | Path, local: bool = False, image: str = "", image_pull_secrets: Sequence[str] = (),
                     version: str | None = None) -> Path:
    """Write the pipeline YAML; ``version`` defaults to this checkout's `build_stamp`. ParamError on a bad image."""
    errors = PipelineParams(image=image, image_pull_secrets=list(image_pull_secrets), backend="local").errors()
    if errors:
        raise ParamError(errors)
    build = Build(image=image, image_pull_secrets=tuple(image_pull_secrets),
                  version=build_stamp() if version is None else version)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pipeline = make_pipeline(LOCAL_RETRY if local else CLUSTER_RETRY, PIPELINE_NAME, build)
    compiler.Compiler().compile(pipeline, str(out))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.compile", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--out", default="pipeline.yaml", help="output YAML path (default: pipeline.yaml)")
    parser.add_argument("--image", default=os.environ.get(IMAGE_ENV, ""),
                        help=f"the trainer image you built and pushed (default: ${IMAGE_ENV}); required "
                             "unless --local")
    parser.add_argument("--image-pull-secret", action="append", default=[], metavar="SECRET",
                        help="a docker-registry Secret in the namespace to pull the image with (repeatable)")
    parser.add_argument("--local", action="store_true",
                        help="the local variant (retry backoff of seconds, for kfp.local)")
    parser.add_argument("--print-version", action="store_true",
                        help="print the build stamp (the image's VERSION build arg) and exit")
    args = parser.parse_args(argv)
    if args.print_version:
        print(build_stamp())
        return 0
    if not args.image and not args.local:
        print(f"error: pass --image REGISTRY/resilient-train:TAG (or set ${IMAGE_ENV}): the image you built from "
              "trainer_image/Dockerfile and pushed; every step and the training pods run it", file=sys.stderr)
        return 2
    try:
        path = compile_pipeline(args.out, args.local, args.image, args.image_pull_secret)
    except ParamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} (image {args.image or '(none)'}, version {build_stamp()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
