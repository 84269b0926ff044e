"""Makes `k8s_stub` importable from the launcher tests (tests dirs have no __init__.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
