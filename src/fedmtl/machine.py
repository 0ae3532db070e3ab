"""What the machine has: its memory (the one place that asks the operating system)."""

from __future__ import annotations

import os


def physical_memory() -> int:
    """Bytes of RAM on this machine (2^40 where the operating system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40
