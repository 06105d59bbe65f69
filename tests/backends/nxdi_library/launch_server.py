"""``neuron-lmi`` with NxD Inference's source trees and the hardware stand-ins installed first, as a
CPU build host with the Neuron pip packages would have them (used by the tier's server tests)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.backends.nxdi_library import library

if __name__ == "__main__":
    library.install()  # 0.8.0's missing CPU-path method is the product's to supply (nxdi.cpu_mode)
    from neuron_lmi.cli import main

    sys.exit(main())
