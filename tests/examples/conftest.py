"""The example apps are imported from their folders, as ``flwr run`` imports them."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flowertune-lora"

if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))
