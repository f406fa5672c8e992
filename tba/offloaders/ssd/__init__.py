"""The SSD offloader: activation bytes go to preallocated slab files on one or more NVMe drives.

See ``docs/ssd.md``. Importing this package starts nothing: no thread, no file, no kvikio.
"""

from tba.offloaders.ssd._offloader import SSDOffloader, SSDToken

__all__ = ["SSDOffloader", "SSDToken"]
