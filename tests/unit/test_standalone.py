"""The project stands alone: a fresh clone has nothing beside it, so no file may reach outside the repo."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A path that climbs out of the repository to a sibling folder, written either as a string or with pathlib.
OUTSIDE = re.compile(r"""\.\./shared|parent\s*/\s*["']shared["']|REPO\.parent|parents\[\d+\]\s*/\s*["']shared""")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in out.decode().split("\0") if name]


def test_no_file_reads_a_sibling_of_the_repository():
    this = Path(__file__).resolve()
    offenders = []
    for path in tracked_files():
        if path.resolve() == this or path.suffix not in {".py", ".sh", ".toml", ".cfg", ".ipynb", ""} \
                or not path.is_file():
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{no}: {line.strip()}")
    assert not offenders, "files reach outside the repository:\n" + "\n".join(offenders)


def test_crd_schemas_ship_with_the_repository():
    crds = {p.name for p in (REPO / "deploy" / "crds").glob("*.yaml")}
    assert {"kubeflow.org_pytorchjobs.v1.9.4.yaml", "trainer.kubeflow.org_trainjobs.v2.3.0.yaml",
            "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.yaml"} <= crds
