import sys
from pathlib import Path

# Tests import the shared helpers (tests/distributed.py) as a top-level module.
sys.path.insert(0, str(Path(__file__).parent))
