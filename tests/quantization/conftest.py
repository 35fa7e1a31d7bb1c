import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub from tests
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:  # `from tests.helpers import ...` also under plain `pytest`
    sys.path.insert(0, _ROOT)
