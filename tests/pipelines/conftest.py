"""Fixtures for the pipeline tests; the plain fakes live in ``pipeline_fakes.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline_fakes import write_script

@pytest.fixture
def fake_trainer_entrypoint(tmp_path: Path) -> Path:
    """An entrypoint that 'trains': reads --train.run_dir/--train.steps and writes the run files."""
    helper = Path(__file__).resolve().parent / "pipeline_fakes.py"
    return write_script(tmp_path / "entrypoint.sh", f"""
        import sys
        sys.path.insert(0, {str(helper.parent)!r})
        from pipeline_fakes import write_run_files
        from pathlib import Path
        args = dict(a.removeprefix("--").split("=", 1) for a in sys.argv[1:] if "=" in a)
        for s in range(1, int(args["train.steps"]) + 1):
            print(f"step {{s:>6}} loss {{8 - s * 0.05:.4f}} lr 1.00e-03 1,000 tok/s 10 ms", flush=True)
        write_run_files(Path(args["train.run_dir"]), int(args["train.steps"]), {{"injob": 1}})
        Path(args["checkpoint.dir"], "step-00000004").mkdir(parents=True, exist_ok=True)
    """)
